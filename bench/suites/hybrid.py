"""Decode throughput of hybrid, latent-attention and sliding-window models: Qwen3-Next and Qwen3.5
(Gated DeltaNet), Granite 4.0-H (Mamba-2), DeepSeek-V3 (multi-head latent attention), Gemma 4
(sliding and full attention layers with two head sizes) and LFM2 (gated short convolutions), one
run; and the memory an idle engine holds.

Six random-weight checkpoints written locally with the tests' writers at larger shapes
(`write_hybrid_model`), all of hidden 1024 in their families' layer patterns (8 layers; Gemma 4
10), an untied (Qwen3-Next, DeepSeek-V3) or tied (Granite, Qwen3.5, Gemma 4, as released)
32,000-row vocabulary, the layers followed by MoE blocks of 8 experts (SwiGLU, intermediate 512,
top-2) plus a shared expert of 512, but for Qwen3.5's and Gemma 4's dense MLPs:

- Qwen3-Next (`Qwen3NextForCausalLM`): 3 Gated DeltaNet layers then 1 gated full attention,
  twice; the linear layers have 8 key and 16 value heads of 128 (a 1 MiB float32 recurrent state
  per layer and request), the attention 8 query / 2 KV heads of 128.
- Qwen3.5 (the text-only `Qwen3_5ForCausalLM`, dense; the published wrapper's language model is
  the same): Qwen3.5-0.8B's layers, 8 of them: 3 Gated DeltaNet layers (16 key / 16 value heads
  of 128, a 1 MiB state per layer and request) then 1 gated full attention (8 query / 2 KV heads
  of 256, a quarter of each rotated), twice, each with a SwiGLU MLP of 3584.
- Granite 4.0-H (`GraniteMoeHybridForCausalLM`): 3 Mamba-2 layers then 1 attention layer, twice;
  Mamba-2 with 32 heads of 64 (intermediate 2048), state 128, one group of B/C, the attention 16
  query / 4 KV heads of 64. One group because vLLM's gated RMSNorm (`Mixer2RMSNormGated`)
  normalises each group's slice while transformers and mlx-lm (the plugin's model code)
  normalise the whole intermediate: with more groups the two backends compute different models
  and the agreement check would mean nothing. The released Granite 4.0-H models have one group.
- DeepSeek-V3 (`DeepseekV3ForCausalLM`): MLA with DeepSeek-V3's own head shapes (16 heads; query
  LoRA rank 384; latent 512 plus a rotary part of 64, so 576 values cached per token and layer;
  nope and value head dims 128), the first layer dense (intermediate 2048), the other 7 MoE with
  sigmoid routing.
- Gemma 4 (the text-only `Gemma4ForCausalLM`, dense): E2B's layer layout, 10 layers at hidden
  1024: 4 sliding-window layers (window 512, one KV head of 256) then 1 full-attention layer (one
  KV head of 512, a quarter of it rotated), twice, 8 query heads; the last 5 layers compute no K/V
  and read layer 3's (sliding) or layer 4's (full), with a double-wide MLP (8192 against 4096);
  per-layer inputs of 256 (a 32,000 x 10 x 256 per-layer embedding); final logits softcapped at
  30. It is here for that layer mix: no state layers, but two kinds of attention layers with
  their own head sizes, which vLLM puts in KV-cache groups of their own (as it does a hybrid's
  attention and state layers), plus layers that own no KV. At this suite's lengths (32 + 64
  tokens) every sliding layer still attends over its whole context: the window never slides.
- LFM2 (`Lfm2ForCausalLM`, dense): LFM2-350M's first 8 layers at its width: gated
  short-convolution layers (window 3, hidden-wide, no biases) and attention layers (16 query / 8
  KV heads of 64, query and key norms) in the pattern conv, conv, attention, twice, then two
  convolutions, each followed by a SwiGLU feed-forward of 4608 (6656 as LFM2 adjusts it).

Weights are drawn from N(0, 0.02) (the embedding of the tied Granite from N(0, 0.01), as its
muP multiplier scales it by 12; Gemma 4's embeddings and norm scales from the tests' Gemma init),
so the layers' activations stay tame. The tokenizer is the
project's tiny BPE tokenizer padded to the vocabulary (`bench.harness.checkpoints.pad_tokenizer`).

Each (family, backend) is one `vllm.LLM` (greedy, EOS ignored, float32, the same engine
arguments, prefix caching off: the rounds' prompts share nothing; `hybrid_prefix` measures hits) in a worker process of its
own; each worker reports its resident memory (its process and the engine core's) once the engine
is up and idle, with the KV cache allocated; the rounds are `bench.harness.decode_rounds`' (as the moe suite's): one warm-up round of each size,
then single stream (1 request) and 16 concurrent streams (16 requests at once), 32-token prompts
and 64 output tokens; decode tok/s = streams / median TPOT. Granite runs the plugin and vLLM's own
CPU backend (`VLLM_TARGET_DEVICE=cpu`) side by side, the same rounds in turn, and compares their
greedy tokens of one 16-stream round; so do LFM2, DeepSeek-V3 (vLLM's CPU MLA kernel is built for
576-value rows only, which these shapes have) and Gemma 4 (vLLM's CPU attention takes head sizes
256 and 512). Qwen3-Next runs the plugin alone: vLLM's CPU backend does not
serve a float32 Qwen3-Next (its Gated DeltaNet CPU kernel, `cpu_gdn_attention_core`, asserts
bfloat16 inputs, so the engine dies on its first step with "CPU GDN attention requires BF16"), and
a bfloat16 vLLM against the plugin's float32 would measure two different computations (other
matmul kernels, other precision, no meaningful agreement check), so there is no like-for-like peer.
Qwen3.5 runs the plugin alone too: on Linux vLLM cannot even inspect it (its `qwen3_5` model
module imports `qwen3_vl`, which imports transformers' torchvision-only Qwen2-VL image processor,
and torchvision does not load beside torch 2.13.0+cpu), so no vLLM engine starts for it, in any
dtype.
The KV cache is 1 GiB per engine (`kv_cache_memory_bytes`), far more than 16 requests of 112
tokens need with their state pages; every worker's log line "Maximum concurrency for N tokens per
request" is recorded and must be at least 16, so no request is preempted.

    python -m bench.run hybrid --out docs/benchmarks             # ~20 min on 2 cores
    python -m bench.run hybrid --quick --out /tmp/hybrid-quick   # tiny model, ~30 s: the harness

`--families qwen3_5,...` runs a subset; with `--out` holding an earlier `hybrid.json` of the same
settings, the families it does not run are kept from there, with the run that measured them
(`bench.harness.stages.keep_earlier_families`), so one family's rows can be measured again or
added without running the others.

`--quick`: DeepSeek-V3 alone on the plugin (the family that drives every path of the suite: rounds,
idle memory, the report), its idle memory the rounds' engine's at ready (one KV cache size, no
engine of its own); `--quick --peers` adds the other families, vLLM CPU and the idle engines at two
sizes. ~30 s on 2 cores, most of it the MLA engine's start. Either way: the tests' tiny checkpoints (hidden 128; Granite with one group, as above; DeepSeek-V3
with the 512 + 64 latent vLLM's CPU kernel needs; Gemma 4 the tests' E2B-like one, hidden 64,
window 8; LFM2 the tests' one with weights from N(0, 0.02)),
8 output tokens, one round per case, `enforce_eager` on every engine (vLLM's CPU backend then
skips its torch.compile warm-up), and DeepSeek-V3's idle memory measured on the plugin's engine
only (vLLM CPU's idle engine is started by the same worker code that just ran its rounds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.decode_rounds import STREAMS, fill_round_defaults, round_parser
from bench.harness.stages import (
    chosen_families,
    command_line,
    describe_machine_apart,
    keep_earlier_families,
    run_families,
    runs_peers,
)
from bench.suites.hybrid_describe import describe_hybrid_model
from bench.suites.hybrid_models import DTYPE, write_hybrid_model

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (the workers are `bench.harness.workers`).

FAMILIES = ("qwen3_next", "qwen3_5", "granite", "deepseek_v3", "gemma4", "lfm2")
# vLLM's CPU backend cannot start Qwen3-Next or Qwen3.5 here (module docstring): the plugin runs
# alone.
BACKENDS = {
    "qwen3_next": ("plugin",),
    "qwen3_5": ("plugin",),
    "granite": ("plugin", "cpu"),
    "deepseek_v3": ("plugin", "cpu"),
    "gemma4": ("plugin", "cpu"),
    "lfm2": ("plugin", "cpu"),
}
KV_CACHE_BYTES = {False: 2**30, True: 256 * 2**20}  # by --quick
# Families whose vLLM CPU peer is known to compute other tokens than transformers float32 (which
# the plugin's tokens equal in the tests): their agreement is reported, not required.
PEER_DEVIATES = {
    "deepseek_v3": (
        "vLLM's CPU backend does not always reproduce transformers float32 on random-weight MLA "
        "models: on the tests' tiny DeepSeek-V3 shapes with weights from N(0, 0.3) (the `--quick` "
        "model), and on a 1-layer dense one with DeepSeek's own head shapes, its first token "
        "(prefill, `CPU_SDPA_MLA`) equals transformers' but its decode steps (`CPU_MLA`, "
        "`mla_decode_kvcache_cpu`) drift within a few tokens, while the plugin's tokens and "
        "logprobs equal transformers' (tests/backends/mlx/runner/test_mla.py). So the agreement "
        "below is reported, not required."
    ),
}
# Engine arguments of a family's vLLM CPU peer: on an x86 CPU with AMX tiles vLLM picks its AMX MLA
# backend, which takes no float32 weights (`convert_weight_packed` refuses them at load), unless
# the reference MLA backend is asked for.
PEER_ENGINE = {"deepseek_v3": {"attention_backend": "CPU_MLA"}}
# What must agree between this run and an earlier hybrid.json for its other families to be kept.
SAME_SETTINGS = ("quick", "dtype", "input_len", "output_len", "streams", "c1_rounds", "c16_rounds",
                 "seed")  # fmt: skip
# Idle memory of the MLA engines at these KV cache sizes (by --quick).
IDLE_KV_BYTES = {False: (2**30, 4 * 2**30), True: (256 * 2**20, 2**30)}


def cases() -> list[dict[str, Any]]:
    return [{"name": f"{f}_c{n}_{be}", "family": f, "streams": n, "backend": be}
            for f in FAMILIES for n in STREAMS for be in BACKENDS[f]]  # fmt: skip


# ------------------------------------------------------------------------------ the whole run


def run_family(args: argparse.Namespace, family: str, logs: Path) -> dict[str, Any]:
    from bench.harness.decode_rounds import kv_log
    from bench.harness.decode_rounds import run as run_rounds

    print(f"[hybrid] {family}: checkpoint", flush=True)
    model = write_hybrid_model(Path(args.work_dir), family, args.quick, args.seed)
    logs.mkdir(parents=True, exist_ok=True)
    backends = BACKENDS[family] if runs_peers(args) else ("plugin",)
    backend_engine = {"cpu": PEER_ENGINE.get(family, {})}
    result = run_rounds(args, describe_hybrid_model(model), logs, backends=backends,
                        tag=f"hybrid_{family}", dtype=DTYPE,
                        kv_cache_bytes=KV_CACHE_BYTES[args.quick],
                        backend_engine=backend_engine)  # fmt: skip
    for w in result["workers"].values():
        w["kv"] = kv_log(w["log"])
    if family == "deepseek_v3":
        print(f"[hybrid] {family}: idle memory", flush=True)
        # --quick: the plugin's engine only; vLLM CPU's idle engine is the same Worker code
        # (its rounds just ran through it).
        idle_backends = ("plugin",) if args.quick else BACKENDS[family]
        if runs_peers(args):
            result["idle_memory"] = idle_memory(args, model, idle_backends, logs, backend_engine)
        else:
            # The rounds' engine was idle when it reported ready: its figure at its KV cache size,
            # without starting another engine.
            w = result["workers"]["plugin"]
            result["idle_memory"] = [{"backend": "plugin", "kv_cache_bytes": KV_CACHE_BYTES[True],
                                      "idle_rss_bytes": w["idle_rss_bytes"]}]  # fmt: skip
    return result


def idle_memory(args: argparse.Namespace, model: Path, backends: tuple[str, ...], logs: Path,
                backend_engine: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """Resident memory of each backend's engine, up and idle, at each of `IDLE_KV_BYTES`: one
    engine at a time, started, asked nothing, shut down (each with its `backend_engine`
    arguments besides the common ones, as in the rounds). A pool committed at allocation shows
    as the difference between the sizes; one committed as it is written does not."""
    from bench.harness.decode_rounds import engine_args, max_model_len
    from bench.harness.workers import Worker, close_all

    inputs = logs / "prompts.json"  # written by the rounds; nothing is generated here
    rows = []
    for kv_bytes in IDLE_KV_BYTES[args.quick]:
        for be in backends:
            engine = {**engine_args(model, DTYPE, kv_bytes, max_model_len(args), args.quick),
                      **backend_engine.get(be, {})}  # fmt: skip
            name = f"idle_{be}_{kv_bytes >> 20}mib"
            worker = Worker(name, be, engine, inputs, logs / f"{name}.log", args.timeout)  # fmt: skip
            try:
                ready = worker.receive()
            finally:
                close_all([worker])
            rows.append({"backend": be, "kv_cache_bytes": kv_bytes,
                         "idle_rss_bytes": ready["idle_rss_bytes"]})  # fmt: skip
    return rows


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    big = max(STREAMS)
    out: dict[str, Any] = {}
    for family, r in report["families"].items():
        cs, backends = r["cases"], list(r["workers"])
        s: dict[str, Any] = {
            f"c{big}_vs_c1": {be: round(cs[f"c{big}_{be}"]["decode_tok_s"]
                                        / cs[f"c1_{be}"]["decode_tok_s"], 2)
                              for be in backends},
            "concurrency_ok": all((w["kv"]["max_concurrency"] or 0) >= big
                                  for w in r["workers"].values()),
        }  # fmt: skip
        if "cpu" in backends:
            s["ratios"] = {f"c{n}_plugin_vs_cpu": round(cs[f"c{n}_plugin"]["decode_tok_s"]
                                                        / cs[f"c{n}_cpu"]["decode_tok_s"], 3)
                           for n in STREAMS}  # fmt: skip
            s["agreement_passed"] = r["agreement"]["passed"]
        elif "cpu" in BACKENDS[family]:  # not measured: --quick without --peers
            s["ratios"] = {f"c{n}_plugin_vs_cpu": None for n in STREAMS}
            s["agreement_passed"] = None
        out[family] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = round_parser("hybrid", __doc__, "tiny hybrids: checks the harness")
    p.add_argument("--families", default=None,
                   help="comma-separated subset: all (deepseek_v3 with --quick, no --peers); "
                        "the others are kept from --out's hybrid.json where its settings match")  # fmt: skip
    args = p.parse_args(argv)
    fill_round_defaults(args)
    if args.families is None:
        args.families = ",".join(FAMILIES) if runs_peers(args) else "deepseek_v3"
    families = chosen_families(p, args.families, FAMILIES)

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("hybrid-quick" if args.quick else "hybrid")
    logs.mkdir(parents=True, exist_ok=True)
    print("[hybrid] machine", flush=True)
    machine = describe_machine_apart(logs)
    results = run_families(families, lambda family: run_family(args, family, logs / family))
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "streams": list(STREAMS),
            "c1_rounds": args.c1_rounds,
            "c16_rounds": args.c16_rounds,
            "seed": args.seed,
            "command": command_line("hybrid", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        "families": results,
    }
    report = keep_earlier_families(report, Path(args.out) / "hybrid.json", FAMILIES,
                                   SAME_SETTINGS)  # fmt: skip
    report["settings"]["backends"] = {f: list(r["workers"]) for f, r in report["families"].items()}
    report["summary"] = summarize(report)
    from bench.suites.hybrid_report import write_report

    write_report(report, Path(args.out))
    status = 0
    for family, s in report["summary"].items():
        if s.get("agreement_passed") is False and family not in PEER_DEVIATES:
            print(f"[hybrid] {family}: the backends' first greedy tokens differ", file=sys.stderr)
            status = 1
        if not s["concurrency_ok"]:
            print(f"[hybrid] {family}: an engine holds fewer than {max(STREAMS)} requests",
                  file=sys.stderr)  # fmt: skip
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
