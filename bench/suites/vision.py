"""Images through `vllm serve`: time to first token and decode tok/s of a vision-language model,
the plugin against vLLM's own CPU backend, one run.

The model is a random-weight Idefics3 (SmolVLM's architecture) written locally with
`tests.fixtures.tiny_idefics3.write_tiny_idefics3`. Its text model has SmolVLM-256M's widths
(hidden 576, MLP 1536, 9 query / 3 KV heads of 64) at 10 layers instead of 30; its vision tower is
SigLIP-base-wide (hidden 768, MLP 3072, 12 heads) at 6 layers instead of 12, and it sees images
as SmolVLM does: 512x512 tiles of 16x16 patches (1,024 patches), folded by the connector's pixel
shuffle (scale factor 4) into 64 image embeddings per tile. The image processor's longest edge is
512, so the 512x512 test image is one tile (SmolVLM-256M's processor first resizes to a longest
edge of 2,048: 16 tiles plus a global view, 17 times the encoder work), and the prompt is 85
tokens. The vocabulary is the tiny tokenizer's 808 tokens. Weights are drawn narrower than the
tiny model's (`FULL_INIT`), so float32 rounding does not decide greedy tokens; the answer still
depends on the image. The tile geometry is set by patching `tiny_idefics3`'s module constants
while it writes the checkpoint (`write_vision_model`); config.json is checked after.

Each backend is one `vllm serve` (`bench.harness.servers.Server`; `VLLM_TARGET_DEVICE=cpu` for
vLLM's), with the same arguments: `--dtype float32 --max-model-len 512 --max-num-seqs 8
--max-num-batched-tokens 1024 --kv-cache-memory-bytes 256M --limit-mm-per-prompt {"image": 1}`.
Both servers are started at once, then this process sends them the same rounds alternately (the
first backend alternating), each round once the other server's processes are idle again, through
the official `openai` client: a streamed `chat.completions.create` with one user message of an
`image_url` part (`tiny_image(seed, (512, 512))` as a PNG data URL) and the text "Describe this
image.", `temperature=0`, `max_tokens=64`, `extra_body={"ignore_eos": True, "return_token_ids":
True}`, `stream_options={"include_usage": True}`. Every request decodes exactly 64 tokens (checked
on the streamed token ids, the usage's `completion_tokens` and the server's
`vllm:generation_tokens_total`).

- TTFT: send -> first streamed chunk carrying a generated token, 1 concurrent request per round;
  median of the rounds. (This includes the API server's image decoding and preprocessing, the same
  vLLM code on both backends, the vision tower, the connector and the prompt's prefill.)
- Decode tok/s of a request: (generated tokens after the first chunk's) / (last token's arrival -
  first token's arrival). 1 concurrent: median over the TTFT rounds' requests (the same requests).
  8 concurrent: 8 requests released together (threads behind a barrier); median over all
  requests of all rounds. Beside it the round's output tok/s (all generated tokens / round wall
  time, first sent -> last token) and TTFT of the 8.
- Where the time goes: after the servers stop, a process of its own times the plugin's vision tower
  on one tile, and one of its layers operation by operation in MLX against the same operations in
  torch on one thread (`tower_profile`).

Every request gets an image of its own (a new seed), the same image for both backends in a round:
the same image again would hit vLLM's multimodal processor cache and prefix cache (its prompt's KV
blocks are keyed by the image's hash), and an image a real user sends is new. One warm-up round of
each size per backend comes first (their own images). The greedy token ids of every image must be
identical on both backends, or the run fails (exit code 1, the report written anyway, with the
first difference).

    python -m bench.run vision --out docs/benchmarks            # ~6 min on 2 cores
    python -m bench.run vision --quick --out /tmp/vision-quick  # tiny Idefics3, ~30 s: checks harness

`--quick`: the tests' tiny Idefics3 (`write_tiny_idefics3` defaults: 32x32 tiles, 2-layer towers),
64x64 images (4 tiles and a global view, 20 image embeddings), 16 tokens, one round per case, and
`--enforce-eager` on both servers (vLLM's CPU backend then skips its torch.compile warm-up, most of
its start-up); without `--peers` the plugin's server alone (its answers still checked for full
length and for depending on the image), with `--peers` vLLM CPU's beside it and the token-by-token
comparison.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.servers import round_robin, server_info, stop_all, wait_all_healthy
from bench.harness.stages import command_line, runs_peers, suite_parser
from bench.suites.vision_model import describe_model, write_vision_model
from bench.suites.vision_servers import (
    CONCURRENCY,
    DTYPE,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    QUESTION,
    Answer,
    Backend,
    image_data_url,
    launch,
)

# Nothing here imports the plugin, MLX or torch at module level: the servers run in processes of
# their own, and this one only sends requests (and must stay idle between them).

BACKENDS = ("plugin", "cpu")
FULL_CASE = {"image_size": 512, "max_tokens": 64}
QUICK_CASE = {"image_size": 64, "max_tokens": 16}


def cases() -> list[dict[str, Any]]:
    return [{"name": f"c{n}_{be}", "concurrency": n, "backend": be}
            for n in CONCURRENCY for be in BACKENDS]  # fmt: skip


# ------------------------------------------------------------------------------ the whole run


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(answers: dict[str, list[Answer]], counted: dict[str, list[float]],
              max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Whether every image's greedy tokens are the same on both backends, and every request
    decoded `max_tokens` tokens (streamed ids, the usage's count and the server's counter, per
    request of each round); `identical_across_backends` is None where vLLM CPU did not run."""
    by_image = {be: {a.image_seed: a for a in ans} for be, ans in answers.items()}
    seeds = sorted(by_image["plugin"])
    compared = "cpu" in by_image
    if compared and sorted(by_image["cpu"]) != seeds:
        raise RuntimeError("the backends were sent different images")
    first = None
    differing = []
    for seed in seeds if compared else ():
        p, c = by_image["plugin"][seed], by_image["cpu"][seed]
        at = _first_difference(p.token_ids, c.token_ids)
        if at is not None:
            differing.append(seed)
            if first is None:
                first = {
                    "image_seed": seed,
                    "token_index": at,
                    "plugin_tokens": p.token_ids,
                    "cpu_tokens": c.token_ids,
                    "plugin_text": p.text,
                    "cpu_text": c.text,
                }
    full_length = {
        be: all(len(a.token_ids) == max_tokens and a.completion_tokens == max_tokens for a in ans)
        and all(t == max_tokens for t in counted[be])
        for be, ans in answers.items()
    }
    distinct = len({tuple(by_image["plugin"][s].token_ids) for s in seeds})
    return {
        "images": len(seeds),
        "requests": {be: len(ans) for be, ans in answers.items()},
        "identical_across_backends": not differing if compared else None,
        "images_differing": differing,
        "first_difference": first,
        "tokens_per_request": {
            be: sorted({len(a.token_ids) for a in ans}) for be, ans in answers.items()
        },
        "server_counted_per_request": {be: sorted(set(ts)) for be, ts in counted.items()},
        "every_request_full_length": full_length,
        "distinct_answers": distinct,
        "passed": not differing and all(full_length.values()),
    }


def _median(xs: list[float | None]) -> float | None:
    values = [x for x in xs if x is not None]
    return statistics.median(values) if values else None


def _case(n: int, backend: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    requests = [a.summary() for r in rounds for a in r["answers"]]
    spread = [max(a.chunk_times[0] for a in r["answers"]) - min(a.chunk_times[0]
              for a in r["answers"]) for r in rounds]  # fmt: skip
    return {
        "concurrency": n,
        "backend": backend,
        "rounds": len(rounds),
        "median_ttft_ms": 1000 * statistics.median(q["ttft_s"] for q in requests),
        "max_ttft_ms": 1000 * max(q["ttft_s"] for q in requests),
        "median_decode_tok_s": _median([q["decode_tok_s"] for q in requests]),
        "min_decode_tok_s": min(q["decode_tok_s"] or 0.0 for q in requests),
        "first_token_spread_s": [round(x, 3) for x in spread],
        "round_wall_s": [round(r["wall_s"], 3) for r in rounds],
        "output_tok_s": statistics.median(r["generated_tokens"] / r["wall_s"] for r in rounds),
        "tokens_per_request": sorted({q["generated_tokens"] for q in requests}),
        # Streamed chunks carrying tokens, per request: fewer than the tokens when the API server
        # (or this client) fell behind and sent several tokens in one chunk.
        "token_chunks_per_request": sorted({q["token_chunks"] for q in requests}),
        "server_generated_tokens": [r["generated_tokens"] for r in rounds],
        "prompt_tokens": sorted({q["prompt_tokens"] for q in requests if q["prompt_tokens"]}),
        "preemptions": sum(r["preemptions"] for r in rounds),
        "busy_after_round_s": statistics.median(r["busy_after_s"] for r in rounds),
        "server_cpu_s": [round(r["cpu_s"], 2) for r in rounds],
        "other_server_cpu_s": [round(r["other_cpu_s"], 2) for r in rounds],
        "load_average_1m": [round(r["load_1m"], 2) for r in rounds],
        "requests": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in q.items()}
            for q in requests
        ],
    }


def run(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    case = QUICK_CASE if args.quick else FULL_CASE
    size, max_tokens = (case["image_size"],) * 2, case["max_tokens"]
    rounds = {1: args.c1_rounds, 8: args.c8_rounds}
    # Every request its own image: warm-up rounds first, then the measured ones, in send order.
    seeds = itertools.count()
    plan = {(n, k): [next(seeds) for _ in range(n)]
            for n in CONCURRENCY for k in range(-1, rounds[n])}  # fmt: skip
    urls = {s: image_data_url(s, size) for ss in plan.values() for s in ss}
    print(f"[vision] {len(urls)} images of {size[0]}x{size[1]}", flush=True)

    run_backends = BACKENDS if runs_peers(args) else ("plugin",)
    print(f"[vision] starting {', '.join(run_backends)}", flush=True)
    servers = {be: launch(model, be, args.quick, logs / f"server-{be}.log") for be in run_backends}
    try:
        ready, both_ready_s = wait_all_healthy(servers, args.startup_timeout)
        backends = {be: Backend(be, s, args.timeout) for be, s in servers.items()}

        def rounds_of(n: int, k: int) -> dict[str, dict[str, Any]]:
            images = [(s, urls[s]) for s in plan[n, k]]
            return round_robin(servers, k, lambda be: backends[be].round(images, max_tokens))

        answers: dict[str, list[Answer]] = {be: [] for be in run_backends}
        # Tokens the server counted (vllm:generation_tokens_total) per request, every round.
        counted: dict[str, list[float]] = {be: [] for be in run_backends}
        for n in CONCURRENCY:
            for be, r in rounds_of(n, -1).items():
                ready[be].setdefault("warmup_s", []).append(round(r["wall_s"], 3))
                answers[be].extend(r["answers"])
                counted[be].append(r["generated_tokens"] / n)
        calls: dict[int, dict[str, list[dict]]] = {n: {be: [] for be in run_backends}
                                                  for n in CONCURRENCY}  # fmt: skip
        for n in CONCURRENCY:
            print(f"[vision] {rounds[n]} round(s) of {n} concurrent per backend", flush=True)
            for k in range(rounds[n]):
                for be, r in rounds_of(n, k).items():
                    calls[n][be].append(r)
                    answers[be].extend(r["answers"])
                    counted[be].append(r["generated_tokens"] / n)
                    ttft = statistics.median(a.ttft_s for a in r["answers"])
                    print(f"[vision] c={n} {be}: TTFT {1000 * ttft:.0f} ms, "
                          f"round {r['wall_s']:.2f} s", flush=True)  # fmt: skip
    finally:
        stop_all(servers)

    out_cases = {f"c{n}_{be}": _case(n, be, calls[n][be])
                 for n in CONCURRENCY for be in run_backends}  # fmt: skip
    return {
        "model": describe_model(model),
        "workload": {
            **case,
            "question": QUESTION,
            "image_format": "PNG data URL",
            "images_per_request": 1,
            "image_seeds": {f"c{n}_round{k}": ss for (n, k), ss in plan.items()},
        },
        "servers": {be: server_info(s, ready[be]) for be, s in servers.items()},
        "both_ready_s": round(both_ready_s, 1),
        "cases": out_cases,
        "agreement": agreement(answers, counted, max_tokens),
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    cs = report["cases"]
    big = max(CONCURRENCY)

    ran = [be for be in BACKENDS if f"c1_{be}" in cs]

    def ratio(key: str, n: int) -> float | None:  # None where vLLM CPU did not run
        if f"c{n}_cpu" not in cs:
            return None
        p, c = cs[f"c{n}_plugin"][key], cs[f"c{n}_cpu"][key]
        return None if p is None or not c else round(p / c, 3)

    # plugin / vLLM CPU: TTFT below 1 and decode tok/s above 1 mean the plugin is faster.
    return {
        "ttft_ms": {be: round(cs[f"c1_{be}"]["median_ttft_ms"], 1) for be in ran},
        "decode_tok_s": {
            f"c{n}": {be: cs[f"c{n}_{be}"]["median_decode_tok_s"] for be in ran}
            for n in CONCURRENCY
        },
        "ratios": {
            "ttft_plugin_vs_cpu": ratio("median_ttft_ms", 1),
            **{f"decode_c{n}_plugin_vs_cpu": ratio("median_decode_tok_s", n) for n in CONCURRENCY},
            f"ttft_c{big}_plugin_vs_cpu": ratio("median_ttft_ms", big),
            f"output_c{big}_plugin_vs_cpu": ratio("output_tok_s", big),
        },
        "agreement_passed": report["agreement"]["passed"],
    }


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("vision", __doc__, "tiny Idefics3: checks the harness")
    p.add_argument("--c1-rounds", type=int, default=None, help="1-concurrent rounds: 8 (1)")
    p.add_argument("--c8-rounds", type=int, default=None, help="8-concurrent rounds: 3 (1)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args(argv)
    if args.c1_rounds is None:
        args.c1_rounds = 1 if args.quick else 8
    if args.c8_rounds is None:
        args.c8_rounds = 1 if args.quick else 3

    from bench.harness.stages import describe_machine_apart, python_stage

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("vision-quick" if args.quick else "vision")
    logs.mkdir(parents=True, exist_ok=True)
    print("[vision] machine", flush=True)
    machine = describe_machine_apart(logs)
    print("[vision] checkpoint", flush=True)
    model = write_vision_model(work, args.quick)
    result = run(args, model, logs)
    print("[vision] vision tower profile", flush=True)
    result["tower_profile"] = python_stage("bench.suites.vision_model", ["--model",
                                            str(model)], 600, logs / "tower.log")  # fmt: skip
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            "concurrency": list(CONCURRENCY),
            "c1_rounds": args.c1_rounds,
            "c8_rounds": args.c8_rounds,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "enforce_eager": args.quick,
            "command": command_line("vision", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        **result,
    }
    report["summary"] = summarize(report)
    from bench.suites.vision_report import write_report

    write_report(report, Path(args.out))
    if not report["agreement"]["passed"]:
        print("[vision] the backends' greedy tokens disagree (or stopped short); see the report",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
