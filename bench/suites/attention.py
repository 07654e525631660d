"""Decode attention benchmark: the native CPU paged_attention against pure-MLX baselines.

Writes docs/benchmarks/attention_decode.{json,md,png}. Usage:
    python -m bench.run attention [--dtype float32] [--quick] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_metal.ops import _native, reference

# A Llama-3-8B-like attention layer.
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384]
BATCHES = [1, 4, 16, 64]
# Larger cells are skipped: the native op's pools, or the baselines' gathered copies, get too big
# (or too slow) for a shared 2-core machine.
MAX_NATIVE_TOKENS = 256 * 1024
MAX_BASELINE_TOKENS = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


def make_decode_batch(batch: int, context: int, dtype: mx.Dtype, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    value_cache = mx.random.normal(shape, key=mx.random.key(seed + 1)).astype(dtype)
    tables = rng.permutation(num_blocks).reshape(batch, blocks_per_seq).astype(np.int32)
    query = mx.random.normal((batch, NUM_HEADS, HEAD_SIZE), key=mx.random.key(seed + 2))
    batch_args = {
        "query": query.astype(dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": mx.array(tables),
        "seq_lens": mx.array(np.full(batch, context, np.int32)),
        "cu_seqlens_q": mx.array(np.arange(batch + 1, dtype=np.int32)),
    }
    mx.eval(*batch_args.values())
    return batch_args


def gather_sdpa(b: dict, scale: float) -> mx.array:
    """The plain-MLX way: gather each sequence's blocks, then fused attention on the copies."""
    batch, context = b["query"].shape[0], int(b["seq_lens"][0].item())
    tables = b["block_tables"]
    k = b["key_cache"][tables].reshape(batch, -1, NUM_KV_HEADS, HEAD_SIZE)[:, :context]
    v = b["value_cache"][tables].reshape(batch, -1, NUM_KV_HEADS, HEAD_SIZE)[:, :context]
    q = b["query"][:, :, None]
    out = mx.fast.scaled_dot_product_attention(
        q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale
    )
    return out.reshape(batch, NUM_HEADS, HEAD_SIZE)


def best_time(fn: Callable[[], mx.array], runs: int, warmup: bool = True) -> float:
    """Fastest of `runs` timed evaluations (after one untimed unless warmup=False), in seconds."""
    if warmup:
        mx.eval(fn())
    best = math.inf
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best


def run(dtype_name: str, quick: bool) -> dict:
    dtype = getattr(mx, dtype_name)
    scale = HEAD_SIZE**-0.5
    contexts = [512, 2048] if quick else CONTEXTS
    batches = [1, 4] if quick else BATCHES
    cells = []
    for batch in batches:
        for context in contexts:
            tokens = batch * context
            if tokens > MAX_NATIVE_TOKENS:
                continue
            b = make_decode_batch(batch, context, dtype)
            args = list(b.values())
            cell = {"batch": batch, "context": context, "kv_bytes": 2 * b["key_cache"].nbytes}
            cell["native_ms"] = 1e3 * best_time(
                lambda args=args: _native.paged_attention(*args, scale=scale), runs=5
            )
            if tokens <= MAX_BASELINE_TOKENS:
                out = _native.paged_attention(*args, scale=scale)
                want = gather_sdpa(b, scale)
                cell["max_abs_diff"] = float(mx.abs(out.astype(mx.float32) - want).max())
                cell["gather_sdpa_ms"] = 1e3 * best_time(
                    lambda b=b: gather_sdpa(b, scale), runs=2, warmup=tokens <= 16384
                )
                cell["reference_ms"] = 1e3 * best_time(
                    lambda args=args: reference.paged_attention(*args, scale=scale),
                    runs=2,
                    warmup=tokens <= 16384,
                )
                baseline = min(cell["gather_sdpa_ms"], cell["reference_ms"])
                cell["speedup"] = baseline / cell["native_ms"]
            cells.append(cell)
            print(json.dumps(cell), flush=True)
            del b, args  # free this cell's pools before building the next
    return {
        "what": "decode paged attention (one query token per sequence), MLX CPU stream",
        "layer": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_size": HEAD_SIZE,
            "block_size": BLOCK_SIZE,
            "dtype": dtype_name,
        },
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "native_threads": _native.num_threads(),
            "native_kernel": _native.cpu_isa(),
            "load_average_at_start": os.getloadavg(),
            "mlx": mx.__version__,
        },
        "method": (
            "best of 5 (native) / best of 2 (baselines) timed runs after a warm-up run (none for "
            "baselines above 16k cached tokens); each sequence's blocks scattered at random"
        ),
        "cells": cells,
    }


def write_markdown(result: dict, path: Path) -> None:
    layer, machine = result["layer"], result["machine"]
    lines = [
        "# Decode attention: native CPU op vs pure-MLX baselines",
        "",
        (
            f"Layer: {layer['num_heads']} query heads, {layer['num_kv_heads']} KV heads, head size "
            f"{layer['head_size']}, block size {layer['block_size']}, {layer['dtype']}. "
            f"Machine: {machine['processor']}, {machine['cpus']} CPUs, native kernel "
            f"`{machine['native_kernel']}` on {machine['native_threads']} threads, MLX "
            f"{machine['mlx']}; load average at start {machine['load_average_at_start'][0]:.1f} "
            "(shared machine: absolute times are noisy)."
        ),
        "",
        (
            "`native` = `vllm_metal.ops` paged_attention (eval_cpu). `gather+sdpa` = gather every "
            "sequence's blocks and run `mx.fast.scaled_dot_product_attention`. `reference` = "
            "`vllm_metal.ops.reference.paged_attention`. Speedup is against the faster baseline. "
            f"{result['method']}."
        ),
        "",
        "| batch | context | KV MiB | native ms | gather+sdpa ms | reference ms | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:

        def fmt(key: str, c: dict = c) -> str:
            return f"{c[key]:.1f}" if key in c else "—"

        speedup = f"{c['speedup']:.1f}x" if "speedup" in c else "—"
        lines.append(
            f"| {c['batch']} | {c['context']} | {c['kv_bytes'] / 2**20:.0f} | {fmt('native_ms')} | "
            f"{fmt('gather_sdpa_ms')} | {fmt('reference_ms')} | {speedup} |"
        )
    lines += ["", "— : not run (baselines above 64k cached tokens take too long here).", ""]
    path.write_text("\n".join(lines))


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = sorted({c["batch"] for c in result["cells"]})
    for i, batch in enumerate(batches):
        cells = [c for c in result["cells"] if c["batch"] == batch]
        color = f"C{i}"
        ax_t.plot(
            [c["context"] for c in cells],
            [c["native_ms"] for c in cells],
            "o-",
            color=color,
            label=f"native, batch {batch}",
        )
        base = [c for c in cells if "speedup" in c]
        if base:
            ax_t.plot(
                [c["context"] for c in base],
                [min(c["gather_sdpa_ms"], c["reference_ms"]) for c in base],
                "x--",
                color=color,
                label=f"best MLX baseline, batch {batch}",
            )
            ax_s.plot(
                [c["context"] for c in base],
                [c["speedup"] for c in base],
                "o-",
                color=color,
                label=f"batch {batch}",
            )
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per call (ms)")
    ax_t.legend(fontsize=7)
    ax_s.set_yscale("log")
    ax_s.set_ylabel("speedup of native over best baseline")
    ax_s.axhline(3, color="gray", lw=0.8, ls=":")
    ax_s.legend(fontsize=7)
    layer = result["layer"]
    fig.suptitle(
        f"Paged decode attention on the CPU ({layer['num_heads']}/{layer['num_kv_heads']} heads, "
        f"d={layer['head_size']}, {layer['dtype']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run attention",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="a 2x2 grid, for a smoke run")
    # The pure-MLX baselines are also the native op's correctness check: they always run.
    parser.add_argument("--peers", action="store_true", help="the same run (baselines always run)")
    parser.add_argument("--out", "--out-dir", dest="out_dir", type=Path,
                        default=ROOT / "docs" / "benchmarks")  # fmt: skip
    parser.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    result = run(args.dtype, args.quick)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "attention_decode"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, stem.with_suffix(".md"))
    write_plot(result, stem.with_suffix(".png"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {stem}.json/.md/.png")
    return 0


def regenerate_report(folder: Path) -> None:
    """attention_decode.md and .png again from folder/attention_decode.json."""
    stem = Path(folder) / "attention_decode"
    result = json.loads(stem.with_suffix(".json").read_text())
    write_markdown(result, stem.with_suffix(".md"))
    write_plot(result, stem.with_suffix(".png"))


if __name__ == "__main__":
    raise SystemExit(main())
