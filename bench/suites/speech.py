"""Speech-to-text real-time factor through `vllm serve`: the plugin against vLLM's own CPU
backend, one run.

The model is a random-weight Whisper written locally (`write_speech_model`): whisper-tiny's
shapes (4 encoder and 4 decoder layers, d_model 384, 6 heads, MLP 1536, 80 mel bins, 1500 encoder
positions) with the tiny Whisper tokenizer of `tests.fixtures.tiny_whisper` (2,113 tokens
instead of 51,865), float32, weight seed 12. The clip is `tiny_whisper.audio_clip(0, 20 s)` sent
as 16-bit PCM WAV; on this checkpoint greedy decoding of it runs past 128 tokens without
`<|endoftext|>`, so every request decodes exactly `max_completion_tokens` = 128 tokens (checked
on the servers' `vllm:generation_tokens_total` counter) and the work per request is fixed.

Each backend is one `vllm serve` (`bench.harness.servers.Server`; `VLLM_TARGET_DEVICE=cpu` for
vLLM's), the same arguments for both: `--dtype float32 --max-model-len 448 --max-num-seqs 8
--kv-cache-memory-bytes 256M`. Both servers are started at once, then this process sends them the
same rounds alternately (the first backend alternating), each round once the other server's
processes are idle again, through the official `openai` client:
`client.audio.transcriptions.create(model, file=("clip.wav", wav, "audio/wav"), language="en",
temperature=0.0, extra_body={"max_completion_tokens": 128})`.

- 1 concurrent: one request per round; RTF = median latency / clip seconds.
- 8 concurrent: 8 requests released together (threads behind a barrier); RTF = wall time of the
  round (first request sent -> last answer) / (8 x clip seconds). Per-request latency and audio
  seconds transcribed per second (8 x clip seconds / wall) beside it.

One warm-up round of each size per backend comes first. Every answer's text must be the same on
both backends and equal to transformers' float32 greedy transcription of the same clip (the
reference, run in a process of its own before the servers start), or the run fails (exit code 1,
the report written anyway, with the first difference).

    python -m bench.run speech --out docs/benchmarks          # ~4 min on 2 cores
    python -m bench.run speech --quick --out /tmp/speech-quick  # tiny Whisper, ~30 s: checks harness

`--quick`: the tests' tiny Whisper (`write_tiny_whisper` defaults: 2 layers, d_model 128), a 5 s
clip, 32 tokens, one round per case, and `--enforce-eager` on both servers (vLLM's CPU backend
then skips its torch.compile warm-up, most of its start-up); without `--peers` the plugin's server
alone (its answers still checked against the transformers reference), with `--peers` vLLM CPU's
beside it. ~30 s on 2 cores: a `vllm serve` start to its first answers is ~18 s of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.servers import round_robin, server_info, stop_all, wait_all_healthy
from bench.harness.stages import command_line, runs_peers, suite_parser
from bench.suites.speech_servers import (
    CONCURRENCY,
    DTYPE,
    KV_CACHE_BYTES,
    LANGUAGE,
    MAX_MODEL_LEN,
    Backend,
    launch,
)

# Nothing here imports the plugin, MLX or torch at module level: the servers and the reference
# run in processes of their own, and this one only sends requests (and must stay idle between
# them).

BACKENDS = ("plugin", "cpu")
# whisper-tiny's shapes (its vocabulary aside: the tiny Whisper tokenizer's 2,113 tokens).
SHAPE = {"d_model": 384, "num_layers": 4, "num_heads": 6, "ffn_dim": 1536}
# (weight seed, clip seed, clip seconds, max_completion_tokens): with these, greedy decoding runs
# to the token limit (no <|endoftext|> before it) with clear margins (full: the top logit leads
# the runner-up by >= 0.47 and <|endoftext|> by >= 41 at every step), and the text is varied
# (31 distinct tokens in 128), so comparing the backends' texts tells their tokens apart.
FULL_CLIP = {"weight_seed": 12, "clip_seed": 0, "seconds": 20.0, "max_tokens": 128}
QUICK_CLIP = {"weight_seed": 0, "clip_seed": 0, "seconds": 5.0, "max_tokens": 32}
REPLACEMENT = "\ufffd"


def cases() -> list[dict[str, Any]]:
    return [{"name": f"c{n}_{be}", "concurrency": n, "backend": be}
            for n in CONCURRENCY for be in BACKENDS]  # fmt: skip


# ------------------------------------------------------------------------------ checkpoint


def write_speech_model(work: Path, quick: bool, seed: int) -> Path:
    """Write (or reuse) the benchmark checkpoint (`--quick`: the tests' tiny Whisper)."""
    from tests.fixtures.tiny_whisper import write_tiny_whisper

    name = "whisper-tiny-test" if quick else "whisper-tiny-shaped-random"
    path = Path(work) / "models" / f"{name}-s{seed}-{DTYPE}"
    shape = None if quick else SHAPE
    stamp = {"kind": "whisper", "shape": shape, "dtype": DTYPE, "seed": seed, "format": 1}
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path
    write_tiny_whisper(path, dtype=DTYPE, seed=seed, **(shape or {}))
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def describe_whisper(path: Path) -> dict[str, Any]:
    """Shape and parameter count from config.json and the safetensors header."""
    from bench.harness.checkpoints import safetensors_sizes

    config = json.loads((path / "config.json").read_text())
    sizes = safetensors_sizes(path / "model.safetensors")
    encoder = sum(v for n, v in sizes.items() if ".encoder." in n)
    return {
        "path": str(path),
        "name": path.name,
        "architecture": config["architectures"][0],
        "dtype": DTYPE,
        "encoder_layers": config["encoder_layers"],
        "decoder_layers": config["decoder_layers"],
        "d_model": config["d_model"],
        "num_heads": config["encoder_attention_heads"],
        "ffn_dim": config["encoder_ffn_dim"],
        "num_mel_bins": config["num_mel_bins"],
        "encoder_positions": config["max_source_positions"],
        "decoder_positions": config["max_target_positions"],
        "vocab_size": config["vocab_size"],
        "num_parameters": sum(sizes.values()) // 4,
        "encoder_parameters": encoder // 4,
        "weight_bytes": sum(sizes.values()),
        # Self- and cross-attention K and V per decoder layer.
        "kv_bytes_per_token": 2 * config["decoder_layers"] * config["d_model"] * 4,
    }


# ------------------------------------------------------------------------------ reference


def reference(args: argparse.Namespace) -> int:
    """transformers float32 greedy transcription of the clip as the servers decode it (the WAV
    read back), with vLLM's decoder prompt; its tokens and text, in `--json`."""
    import io

    import soundfile
    from transformers import AutoTokenizer

    from tests.fixtures.oracles import whisper_generate
    from tests.fixtures.tiny_whisper import EOT_TOKEN, decoder_prompt_ids, token_ids

    samples, rate = soundfile.read(io.BytesIO(Path(args.wav).read_bytes()), dtype="float32")
    started = time.perf_counter()
    (tokens,) = whisper_generate(args.model, [samples], decoder_prompt_ids(LANGUAGE),
                                 args.max_tokens, sample_rate=rate)  # fmt: skip
    seconds = time.perf_counter() - started
    text = AutoTokenizer.from_pretrained(args.model).decode(tokens, skip_special_tokens=True)
    Path(args.json).write_text(json.dumps({
        "token_ids": tokens,
        "num_tokens": len(tokens),
        "stopped_at_eos": token_ids()[EOT_TOKEN] in tokens,
        "distinct_tokens": len(set(tokens)),
        "text": text,
        "seconds": round(seconds, 2),
    }, indent=2))  # fmt: skip
    return 0


def normalized(text: str) -> str:
    """vLLM's incremental detokenizer holds back an incomplete UTF-8 sequence at the end, where a
    one-shot decode writes replacement characters (the random model emits byte tokens)."""
    return text.rstrip(REPLACEMENT).strip()


# ------------------------------------------------------------------------------ the whole run


def _first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(texts: dict[str, list[str]], ref: dict[str, Any], tokens: dict[str, list[float]],
              max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Whether every answer of both backends is the same text, equal to the reference's, and
    every request decoded `max_tokens` tokens (`identical_across_backends` None where vLLM CPU
    did not run)."""
    distinct = {be: sorted(set(ts)) for be, ts in texts.items()}
    plugin, cpu = distinct["plugin"][0], distinct.get("cpu", [None])[0]
    want = normalized(ref["text"])
    same_within = all(len(d) == 1 for d in distinct.values())
    same_across = None if cpu is None else same_within and plugin == cpu
    matches_reference = {be: all(normalized(t) == want for t in d) for be, d in distinct.items()}
    full_length = {be: all(t == max_tokens for t in ts) for be, ts in tokens.items()}
    diff = None if cpu is None else _first_difference(plugin, cpu)
    return {
        "requests": {be: len(ts) for be, ts in texts.items()},
        "distinct_texts": {be: len(d) for be, d in distinct.items()},
        "identical_across_backends": same_across,
        "first_difference_at_char": diff,
        "texts_if_different": None if same_across in (None, True) else distinct,
        "matches_reference": matches_reference,
        "tokens_per_request": {be: sorted(set(ts)) for be, ts in tokens.items()},
        "every_request_full_length": full_length,
        "text": plugin,
        "text_chars": len(plugin),
        "replacement_chars": plugin.count(REPLACEMENT),
        "reference": {k: v for k, v in ref.items() if k != "token_ids"},
        "passed": same_within
        and same_across is not False
        and all(matches_reference.values())
        and all(full_length.values()),
    }


def run(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    from bench.harness.stages import python_stage
    from tests.fixtures.tiny_whisper import audio_clip, wav_bytes

    clip = QUICK_CLIP if args.quick else FULL_CLIP
    seconds, max_tokens = clip["seconds"], clip["max_tokens"]
    wav = wav_bytes(audio_clip(clip["clip_seed"], seconds))
    wav_path = logs / "clip.wav"
    wav_path.write_bytes(wav)
    print("[speech] reference (transformers float32)", flush=True)
    ref = python_stage("bench.suites.speech", ["--reference", "--model", str(model), "--wav",
                        str(wav_path), "--max-tokens", str(max_tokens)], 900,
                        logs / "reference.log")  # fmt: skip
    ref.pop("cpu_blas_logged", None)

    run_backends = BACKENDS if runs_peers(args) else ("plugin",)
    print(f"[speech] starting {', '.join(run_backends)}", flush=True)
    servers = {be: launch(model, be, args.quick, logs / f"server-{be}.log") for be in run_backends}
    try:
        ready, both_ready_s = wait_all_healthy(servers, args.startup_timeout)
        backends = {be: Backend(be, s, args.timeout) for be, s in servers.items()}

        def rounds_of(n: int, k: int) -> dict[str, dict[str, Any]]:
            return round_robin(servers, k, lambda be: backends[be].round(n, wav, max_tokens))

        for n in CONCURRENCY:
            for be, r in rounds_of(n, 0).items():
                ready[be].setdefault("warmup_s", []).append(round(r["wall_s"], 3))
                ready[be].setdefault("warmup_texts", []).extend(r["texts"])
                ready[be].setdefault("warmup_tokens", []).append(r["generated_tokens"] / n)
        rounds = {1: args.c1_rounds, 8: args.c8_rounds}
        calls: dict[int, dict[str, list[dict]]] = {n: {be: [] for be in run_backends}
                                                  for n in CONCURRENCY}  # fmt: skip
        for n in CONCURRENCY:
            print(f"[speech] {rounds[n]} round(s) of {n} concurrent per backend", flush=True)
            for k in range(rounds[n]):
                for be, r in rounds_of(n, k).items():
                    calls[n][be].append(r)
                    print(f"[speech] c={n} {be}: {r['wall_s']:.2f} s", flush=True)
    finally:
        stop_all(servers)

    out_cases: dict[str, dict[str, Any]] = {}
    for n in CONCURRENCY:
        for be in run_backends:
            rs = calls[n][be]
            walls = [r["wall_s"] for r in rs]
            latencies = [x for r in rs for x in r["latency_s"]]
            wall = statistics.median(walls)
            out_cases[f"c{n}_{be}"] = {
                "concurrency": n,
                "backend": be,
                "rounds": len(rs),
                "round_wall_s": [round(x, 3) for x in walls],
                "median_round_wall_s": wall,
                # RTF: processing wall time / audio seconds (lower is better).
                "rtf": wall / (n * seconds),
                "audio_s_per_s": n * seconds / wall,
                "median_latency_s": statistics.median(latencies),
                "max_latency_s": max(latencies),
                "latency_s": [round(x, 3) for x in latencies],
                "decode_tok_s": n * max_tokens / wall,
                "tokens_per_request": [r["generated_tokens"] / n for r in rs],
                "preemptions": sum(r["preemptions"] for r in rs),
                "busy_after_round_s": statistics.median(r["busy_after_s"] for r in rs),
                "other_server_cpu_s": [round(r["other_cpu_s"], 2) for r in rs],
            }
    texts = {be: ready[be]["warmup_texts"] + [t for n in CONCURRENCY for r in calls[n][be]
                                              for t in r["texts"]] for be in run_backends}  # fmt: skip
    tokens = {be: ready[be]["warmup_tokens"] + [t for n in CONCURRENCY
                                                for t in out_cases[f"c{n}_{be}"]
                                                ["tokens_per_request"]]
              for be in run_backends}  # fmt: skip
    check = agreement(texts, ref, tokens, max_tokens)
    servers_out = {}
    for be, s in servers.items():
        info = {k: v for k, v in ready[be].items() if k not in ("warmup_texts", "warmup_tokens")}
        servers_out[be] = server_info(s, info)
    return {
        "model": describe_whisper(model),
        "clip": {**clip, "sample_rate": 16000, "wav_bytes": len(wav)},
        "servers": servers_out,
        "both_ready_s": round(both_ready_s, 1),
        "cases": out_cases,
        "agreement": check,
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    cs = report["cases"]
    big = max(CONCURRENCY)
    # Speed ratios (> 1: the plugin is faster): vLLM CPU's RTF / the plugin's.
    # None where vLLM CPU did not run (`--quick` without `--peers`).
    ratios = {f"c{n}_plugin_vs_cpu": round(cs[f"c{n}_cpu"]["rtf"] / cs[f"c{n}_plugin"]["rtf"], 3)
              if f"c{n}_cpu" in cs else None for n in CONCURRENCY}  # fmt: skip
    batching = {be: round(cs[f"c{big}_{be}"]["audio_s_per_s"] / cs[f"c1_{be}"]["audio_s_per_s"], 2)
                for be in BACKENDS if f"c1_{be}" in cs}  # fmt: skip
    return {"ratios": ratios, f"c{big}_vs_c1": batching,
            "agreement_passed": report["agreement"]["passed"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("speech", __doc__, "tiny Whisper: checks the harness")
    p.add_argument("--c1-rounds", type=int, default=None, help="1-concurrent rounds: 8 (1)")
    p.add_argument("--c8-rounds", type=int, default=None, help="8-concurrent rounds: 4 (1)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    # The reference stage (a process of its own).
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--wav", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reference:
        return reference(args)
    if args.c1_rounds is None:
        args.c1_rounds = 1 if args.quick else 8
    if args.c8_rounds is None:
        args.c8_rounds = 1 if args.quick else 4

    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("speech-quick" if args.quick else "speech")
    logs.mkdir(parents=True, exist_ok=True)
    print("[speech] machine", flush=True)
    machine = describe_machine_apart(logs)
    print("[speech] checkpoint", flush=True)
    clip = QUICK_CLIP if args.quick else FULL_CLIP
    model = write_speech_model(work, args.quick, clip["weight_seed"])
    result = run(args, model, logs)
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            "concurrency": list(CONCURRENCY),
            "c1_rounds": args.c1_rounds,
            "c8_rounds": args.c8_rounds,
            "max_model_len": MAX_MODEL_LEN,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "enforce_eager": args.quick,
            "language": LANGUAGE,
            "command": command_line("speech", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        **result,
    }
    report["summary"] = summarize(report)
    from bench.suites.speech_report import write_report

    write_report(report, Path(args.out))
    if not report["agreement"]["passed"]:
        print("[speech] the backends' transcriptions disagree (or stopped short); see the report",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
