"""GGUF Q4_0 against MLX's own 4-bit quantization of the same weights: single-stream decode, one run.

The benchmark checkpoint of `bench/harness/checkpoints.py` (Qwen3-0.6B's shapes, random weights) in float32 is
written four ways, every matrix quantized alike (the tied embedding included):

- **gguf_q4_0**: a GGUF file, every matrix Q4_0 (`tests.fixtures.tiny_gguf`), served as vLLM
  documents it, `LLM(model="FILE.gguf", tokenizer=DIR)`; the loader maps Q4_0 exactly onto MLX
  4-bit affine layers with groups of 32;
- **mlx_q4_g32** / **mlx_q4_g64**: `mlx_lm.convert -q --q-bits 4 --q-group-size 32 / 64`;
- **dense**: the float32 checkpoint itself, for reference.

1. **Engine** (the plugin through `vllm.LLM`): each case is a worker process of its own (the worker
   protocol of `bench.harness.workers`); all are started, then this process sends them the same
   single-request rounds in turn (the order rotating each round), each once the previous worker is
   idle again, after one warm-up round. Greedy, EOS ignored, float32. Decode tok/s = 1 / median
   TPOT (vLLM's per-request metrics: first to last token), so prefill is left out. On MLX's CPU
   device the plugin serves MLX-quantized layers dense in float32 (its quantized matmul there is
   MLX's own loop, slower than the BLAS: `models/loaders/safetensors._dequantize`), so on this
   machine all four cases decode the same dense model: the figures say what serving a GGUF file
   costs here (its engine start-up includes reading and converting the file), not what the
   quantized layers compute.
2. **Quantized layers** (one process per case, no engine): the model as the plugin's loaders build
   it, quantized layers kept, decoded by stock mlx-lm (`generate_step`, one prompt, after a
   warm-up): MLX's 4-bit matmul with groups of 32 against 64 on this device.

Everything here runs on MLX's CPU device; no figure says anything about Apple GPUs.

    python -m bench.run gguf --out docs/benchmarks           # ~13 min on 2 cores
    python -m bench.run gguf --quick --out /tmp/gguf-quick   # tiny model, checks the harness

`--quick`: the tests' tiny Qwen3, 8 output tokens, one round per case, `enforce_eager`, and only
the GGUF case (its engine and its layers; the others are there to compare with it, so its ratios
are not measured); `--quick --peers` runs all four.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.stages import command_line, runs_peers, suite_parser

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (the workers are `bench.harness.workers`).

CASES = ("gguf_q4_0", "mlx_q4_g32", "mlx_q4_g64", "dense")
DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device


# ------------------------------------------------------------------------------ checkpoints


def write_checkpoints(work: Path, quick: bool, seed: int = 0,
                      cases: tuple[str, ...] = CASES) -> dict[str, Path]:  # fmt: skip
    """The source checkpoint and the quantized forms of `cases` (reused when already written)."""
    from bench.harness.checkpoints import write_model
    from tests.fixtures.tiny_gguf import write_tiny_gguf
    from vllm_metal.testing.tiny_models import quantize_tiny_model

    models = work / "models"
    src = write_model(models, "tiny" if quick else "0.6b", DTYPE, seed)
    stamp = json.loads((src / "bench_model.json").read_text())
    paths = {"dense": src}
    for case, group in (("mlx_q4_g32", 32), ("mlx_q4_g64", 64)):
        if case not in cases:
            continue
        dst = src.with_name(f"{src.name}-{case}")
        if not _fresh(dst / "bench_model.json", stamp):
            quantize_tiny_model(src, dst, bits=4, group_size=group)
            (dst / "bench_model.json").write_text(json.dumps(stamp, indent=2) + "\n")
        paths[case] = dst
    gguf_dir = src.with_name(f"{src.name}-gguf")
    gguf_file = gguf_dir / "model-Q4_0.gguf"
    if not _fresh(gguf_dir / "bench_model.json", stamp):
        gguf_dir.mkdir(parents=True, exist_ok=True)
        write_tiny_gguf(src, gguf_file, "Q4_0", tokenizer=False)
        (gguf_dir / "bench_model.json").write_text(json.dumps(stamp, indent=2) + "\n")
    paths["gguf_q4_0"] = gguf_file
    return paths


def _fresh(stamp_file: Path, stamp: dict[str, Any]) -> bool:
    return stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp


def _bytes_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ---------------------------------------------------------------------------------- worker


def engine_args(case: str, path: Path, src: Path, kv_bytes: int, max_model_len: int,
                eager: bool) -> dict[str, Any]:  # fmt: skip
    args = {
        "model": str(path),
        "dtype": DTYPE,
        "max_model_len": max_model_len,
        "max_num_seqs": 1,
        "kv_cache_memory_bytes": kv_bytes,
        "enable_prefix_caching": False,
        "enforce_eager": eager,
        "disable_log_stats": False,  # per-request metrics (TPOT)
        "seed": 0,
    }
    if case == "gguf_q4_0":
        args["tokenizer"] = str(src)  # `vllm serve FILE.gguf --tokenizer DIR`
    return args


def run_engines(args: argparse.Namespace, paths: dict[str, Path], logs: Path,
                cases: tuple[str, ...]) -> dict[str, Any]:  # fmt: skip
    from bench.harness.checkpoints import describe_model
    from bench.harness.single_stream import make_prompts
    from bench.harness.stages import blas_log_lines, kv_bytes
    from bench.harness.workers import Worker, close_all

    src = paths["dense"]
    inputs = logs / "prompts.json"
    inputs.write_text(json.dumps(make_prompts(1 + args.rounds, args.input_len, args.seed)))
    max_model_len = args.input_len + args.output_len + 16
    kv = kv_bytes(describe_model(src), max_model_len, 1)
    print("[gguf] starting the engines", flush=True)
    workers = {
        case: Worker(f"gguf_{case}", "plugin",
                     engine_args(case, paths[case], src, kv, max_model_len, args.quick),
                     inputs, logs / f"engine_{case}.log", args.timeout)
        for case in cases
    }  # fmt: skip
    calls: dict[str, list[dict]] = {case: [] for case in cases}
    try:
        ready = {case: w.receive() for case, w in workers.items()}
        for k in range(1 + args.rounds):  # round 0 warms up
            order = cases[k % len(cases) :] + cases[: k % len(cases)]
            for case in order:
                r = workers[case].call(op="generate", start=k, n=1,
                                       max_tokens=4 if k == 0 else args.output_len)  # fmt: skip
                workers[case].settle()
                if k == 0:
                    ready[case]["warmup_s"] = round(r["seconds"], 3)
                else:
                    calls[case].append(r)
            print(f"[gguf] engine round {k}/{args.rounds} done", flush=True)
    finally:
        close_all(list(workers.values()))
    out = {}
    for case in cases:
        rs = calls[case]
        counts = [c for r in rs for c in r["tokens"]]
        assert counts == [args.output_len] * len(counts), (case, counts)
        tpot = statistics.median(t for r in rs for t in r["tpot_ms"])
        log = workers[case].log.read_text(encoding="utf-8", errors="replace")
        loading = re.search(r"Model loading took ([0-9.]+) s", log)
        out[case] = {
            "rounds": len(rs),
            "tpot_ms": [round(t, 2) for r in rs for t in r["tpot_ms"]],
            "median_tpot_ms": tpot,
            "decode_tok_s": 1e3 / tpot,
            "engine_start_s": ready[case]["engine_start_s"],
            "model_load_s": float(loading.group(1)) if loading else None,
            "warmup_s": ready[case].get("warmup_s"),
            "load_log": [line.split("] ", 1)[-1] for line in log.splitlines()
                         if "gguf.py" in line or "Dequantized" in line or "Model loading took" in line],
            "cpu_blas_logged": blas_log_lines(log),
        }  # fmt: skip
    return out


# --------------------------------------------------------------------------- quantized layers


def layers_stage(args: argparse.Namespace) -> int:
    """One case's model as the plugin's loaders build it, quantized layers kept; stock mlx-lm's
    decode loop over one prompt (after a warm-up) -> decode tok/s."""
    # The plugin's import sets up MLX's CPU BLAS, which has to precede mlx.core: the dense
    # matmuls then run on the same library as the engine's.
    import vllm_metal  # noqa: F401, I001

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from bench.harness.single_stream import make_prompts
    from vllm_metal.models import load_model

    started = time.perf_counter()
    adapter = load_model(args.model, compute_dtype=getattr(mx, DTYPE))
    load_s = time.perf_counter() - started
    model = adapter.model
    prompts = make_prompts(2, args.input_len, args.seed)

    def decode(prompt: list[int], n: int) -> tuple[float, float]:
        """(seconds to the first token, seconds for the n - 1 after it)"""
        t0 = time.perf_counter()
        first = None
        for i, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=n)):
            if i == 0:
                first = time.perf_counter()
        return first - t0, time.perf_counter() - first

    decode(prompts[0], 4)
    ttft, rest = decode(prompts[1], args.output_len)
    from vllm_metal.backends.mlx import blas
    from vllm_metal.models.loaders import parameter_bytes

    quantized = sum("Quantized" in type(m).__name__ for _, m in model.named_modules())
    Path(args.json).write_text(json.dumps({
        "cpu_blas": blas.setup_cpu_blas().describe(),
        "mlx_cblas_sgemm": blas.mlx_sgemm_provider(),
        "load_s": round(load_s, 2),
        "weight_bytes": parameter_bytes(model),
        "quantized_layers": quantized,
        "ttft_ms": ttft * 1e3,
        "decode_tok_s": (args.output_len - 1) / rest,
    }))  # fmt: skip
    return 0


def run_layers(args: argparse.Namespace, paths: dict[str, Path], logs: Path,
               cases: tuple[str, ...]) -> dict[str, Any]:  # fmt: skip
    from bench.harness.stages import python_stage

    out = {}
    for case in cases:
        print(f"[gguf] quantized layers: {case}", flush=True)
        argv = ["--layers", "--model", str(paths[case]), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--seed", str(args.seed)]  # fmt: skip
        out[case] = python_stage(
            "bench.suites.gguf", argv, args.timeout, logs / f"layers_{case}.log"
        )
    return out


# ------------------------------------------------------------------------------- the whole run


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    def ratios(section: str) -> dict[str, float | None]:
        """Each case against MLX g64; None where g64 did not run (`--quick` without `--peers`)."""
        cs = report[section]
        ref = cs["mlx_q4_g64"]["decode_tok_s"] if "mlx_q4_g64" in cs else None
        return {case: None if ref is None else round(cs[case]["decode_tok_s"] / ref, 3)
                for case in cs}  # fmt: skip

    return {"engine_vs_mlx_q4_g64": ratios("engine"), "layers_vs_mlx_q4_g64": ratios("layers")}


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("gguf", __doc__, "tiny model: checks the harness")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="engine rounds per case: 5 (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker reply")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)

    args = p.parse_args(argv)
    if args.output_len is None:
        args.output_len = 8 if args.quick else 64
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.layers:
        return layers_stage(args)

    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("gguf-quick" if args.quick else "gguf")
    logs.mkdir(parents=True, exist_ok=True)
    print("[gguf] machine", flush=True)
    machine = describe_machine_apart(logs)
    print("[gguf] checkpoints", flush=True)
    t0 = time.perf_counter()
    cases = CASES if runs_peers(args) else ("gguf_q4_0",)
    paths = write_checkpoints(work, args.quick, args.seed, cases)
    checkpoints_s = time.perf_counter() - t0
    from bench.harness.checkpoints import describe_model

    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "seed": args.seed,
            "command": command_line("gguf", argv),
        },
        "machine": machine,
        "model": describe_model(paths["dense"]),
        "checkpoints": {
            case: {"path": str(paths[case]), "bytes": _bytes_on_disk(paths[case])} for case in cases
        },
        "checkpoints_s": round(checkpoints_s, 1),
        "engine": run_engines(args, paths, logs, cases),
        "layers": run_layers(args, paths, logs, cases),
    }
    report["settings"]["total_seconds"] = round(time.perf_counter() - started, 1)
    report["summary"] = summarize(report)
    from bench.suites.gguf_report import write_report

    write_report(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
