"""The main run: single stream and `vllm serve` against mlx-lm and vLLM's CPU backend.

`python -m bench.run --out docs/benchmarks` (or `python -m bench.run main ...`) writes
results.json, results.md and PNG plots: mlx-lm, the plugin (vllm.LLM and `vllm serve`), vLLM's CPU
backend, kernels, startup and the roofline. Each stage runs in a process of its own
(`bench.harness.stages`).

`--quick` runs the tiny model (16 + 8 tokens, one single-stream prompt) at concurrency 1 and 4,
the plugin only: the machine, bandwidth, `plugin_offline`, `serve_plugin` and `startup` stages
(the start-up figure is `serve_plugin`'s, on the same tiny model); `--quick --peers` adds mlx-lm
and vLLM CPU's server (`serve_cpu`). The kernels and profile stages are suites of their own
(`attention`, `profile`), each with its own quick run. The quick run takes ~45 s on 2 cores, not
~25: it starts two plugin engines, `vllm.LLM` and `vllm serve` (~20 s each), both of which the
suite is about.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.checkpoints import SHAPES, describe_model, write_model
from bench.harness.machine import describe_machine, measure_bandwidth, measure_matmul_scaling
from bench.harness.stages import ROOT, StageLog, blas_log_lines, kv_bytes, python_stage

# Every stage section results.json has, in run order; a stage not run says so in its entry.
# Beside them: "settings", "model" and "summary" (targets and roofline fractions).
SECTIONS = (
    "machine",
    "bandwidth",
    "mlx_lm",
    "plugin_offline",
    "serve_plugin",
    "serve_cpu",
    "startup",
    "kernels",
    "profile",
)

# Defaults per model size. With MLX's CPU float32 matmuls on MKL a decode step of the 0.6B model
# takes ~0.15 s at batch 1 and ~0.5 s at batch 32 on the 2-core reference machine (mlx-lm in bf16,
# on MLX's own loops, ~0.5 s per token). 128 output tokens make every serve level a decode-bound
# run of 128 steps (a 32-token prompt is under 10% of the 32-concurrent run); the whole run stays
# near 17 minutes there, most of it mlx-lm in bf16 and the kernel micro-benchmark.
PRESETS: dict[str, dict[str, Any]] = {
    "0.6b": {"input_len": 32, "output_len": 128, "num_prompts": 3},
    # Qwen3-0.6B's depth and vocabulary at a width of 64: per-op and per-step costs weigh.
    "0.6b-narrow": {"input_len": 32, "output_len": 128, "num_prompts": 3},
    "tiny": {"input_len": 32, "output_len": 32, "num_prompts": 3},
    "quick": {"input_len": 16, "output_len": 8, "num_prompts": 1},
}
# The stages of `--quick`: the plugin's own; with `--peers` also the engines it is compared with.
QUICK_STAGES = ("machine", "bandwidth", "plugin_offline", "serve_plugin", "startup")
QUICK_PEERS = ("mlx_lm", "serve_cpu")
CONCURRENCY = (1, 4, 16, 32)
QUICK_CONCURRENCY = (1, 4)
TARGETS = {
    "single_stream_vs_mlx_lm": 1.0,  # plugin decode tok/s / mlx-lm decode tok/s (faster variant)
    "aggregate_32_vs_single": 12.0,  # serve output tok/s at 32 concurrent / at 1
    "plugin_32_vs_cpu_32": 1.0,  # plugin serve output tok/s at 32 / vLLM CPU's at 32
    "tiny_startup_s": 10.0,  # `vllm serve` tiny model: launch to first served token
}


class Bench:
    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args = args
        self.argv = argv
        self.out = Path(args.out)
        self.work = Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = StageLog(self.out / "results.json", SECTIONS, args.stages)
        self.results = self.log.results
        self.results.update(settings={}, model={}, summary={})
        self.model_path: Path | None = None
        self.model: dict[str, Any] = {}

    @property
    def max_model_len(self) -> int:
        return self.args.input_len + self.args.output_len + 16

    def _common(self) -> list[str]:
        return [
            "--model", str(self.model_path),
            "--dtype", self.args.dtype,
            "--input-len", str(self.args.input_len),
            "--output-len", str(self.args.output_len),
            "--max-model-len", str(self.max_model_len),
        ]  # fmt: skip

    # ------------------------------------------------------------------ stages

    def machine(self) -> dict[str, Any]:
        info = describe_machine()
        if self.args.model:
            self.model_path = Path(self.args.model)
        else:
            self.model_path = write_model(
                self.work / "models", self.args.model_size, self.args.dtype
            )
        self.model = describe_model(self.model_path)
        settings = {
            k: getattr(self.args, k)
            for k in ("model_size", "dtype", "input_len", "output_len", "num_prompts", "quick")
        }
        settings["concurrency"] = list(self.args.concurrency)
        settings["stages"] = list(self.args.stages)
        settings["command"] = " ".join(["python -m bench.run", *self.argv])
        self.results["settings"] = settings
        self.results["model"] = self.model
        return info

    def bandwidth(self) -> dict[str, Any]:
        size = 64 * 2**20 if self.args.quick else 1024 * 2**20
        bw = measure_bandwidth(size, repeats=2 if self.args.quick else 5)
        dtypes = dict.fromkeys([self.args.dtype, "float32"])
        matmul = {
            d: measure_matmul_scaling(d, rows=(1, max(self.args.concurrency))) for d in dtypes
        }
        return {"gbps": bw, "buffer_bytes": size, "matmul": matmul}

    def mlx_lm(self) -> dict[str, Any]:
        argv = ["--engine", "mlx-lm", *self._common(), "--num-prompts", str(self.args.num_prompts)]
        if "cpu" in str(self.results["machine"].get("mlx_device", "")).lower():
            # The plugin computes in float32 on MLX's CPU device: measure mlx-lm that way too.
            argv.append("--also-float32")
        return python_stage(
            "bench.harness.single_stream", argv, self.args.timeout, self.work / "mlx_lm.log"
        )

    def plugin_offline(self) -> dict[str, Any]:
        argv = [
            "--engine", "vllm", *self._common(),
            "--num-prompts", str(self.args.num_prompts),
            "--max-num-seqs", "1",
            "--kv-cache-memory-bytes", str(kv_bytes(self.model, self.max_model_len, 1)),
        ]  # fmt: skip
        return python_stage(
            "bench.harness.single_stream", argv, self.args.timeout, self.work / "plugin_offline.log"
        )

    def _serve(self, backend: str, startup_only: bool = False, model: Path | None = None) -> dict:
        seqs = max(self.args.concurrency)
        argv = [
            *self._common(),
            "--backend", backend,
            "--concurrency", *map(str, self.args.concurrency),
            "--max-num-seqs", str(seqs),
            "--kv-cache-memory-bytes", str(kv_bytes(self.model, self.max_model_len, seqs)),
            "--work-dir", str(self.work / f"serve-{backend}"),
        ]  # fmt: skip
        if model is not None:
            argv[argv.index("--model") + 1] = str(model)
        if startup_only:
            argv.append("--startup-only")
        name = f"serve_{backend}{'_startup' if startup_only else ''}"
        data = python_stage(
            "bench.harness.serve_load", argv, self.args.timeout * 4, self.work / f"{name}.log"
        )
        server_log = self.work / f"serve-{backend}" / f"server-{backend}.log"
        if server_log.is_file():
            lines = blas_log_lines(server_log.read_text(encoding="utf-8", errors="replace"))
            if lines:
                data["cpu_blas_logged"] = lines
        return data

    def startup(self) -> dict[str, Any]:
        """Launch-to-first-token of `vllm serve` on the tiny model (and the benchmark model)."""
        out: dict[str, Any] = {}
        for backend in ("plugin", "cpu"):
            serve = self.results.get(f"serve_{backend}", {})
            if serve.get("status") == "ok":
                out[f"{backend}_bench_model"] = serve["startup"]
        if self.args.model_size == "tiny" and not self.args.model and "plugin_bench_model" in out:
            out["plugin_tiny"] = out["plugin_bench_model"]
        else:
            tiny = write_model(self.work / "models", "tiny", self.args.dtype)
            out["plugin_tiny"] = self._serve("plugin", startup_only=True, model=tiny)["startup"]
        return out

    def kernels(self) -> dict[str, Any]:
        out_dir = self.out if self.args.kernels_out is None else Path(self.args.kernels_out)
        argv = ["--out", str(out_dir), *(["--quick"] if self.args.quick else [])]
        data = python_stage("bench.suites.attention", argv, self.args.timeout * 4,
                            self.work / "kernels.log")  # fmt: skip
        data.pop("cpu_blas_logged", None)
        return {"attention_decode": data, "files": [f"attention_decode.{s}" for s in ("md", "png")]}

    def profile(self) -> dict[str, Any]:
        """The decode step profiled at batch 1 and 32: on the tiny model, where the work around
        the forward shows, and on the benchmark model, where the forward dominates."""
        tiny = write_model(self.work / "models", "tiny", self.args.dtype)
        targets = [("tiny", tiny, 32, 32 if self.args.quick else 64)]
        if not self.args.quick and self.model_path is not None and self.model_path != tiny:
            targets.append(("bench_model", self.model_path, self.args.input_len, 16))
        out: dict[str, Any] = {"models": []}
        for name, path, input_len, output_len in targets:
            model = describe_model(path)
            max_len = input_len + output_len + 16
            argv = [
                "--model", str(path),
                "--dtype", self.args.dtype,
                "--input-len", str(input_len),
                "--output-len", str(output_len),
                "--batch-sizes", "1", "32",
                "--kv-cache-memory-bytes", str(kv_bytes(model, max_len, 32)),
                "--text-dir", str(self.work / f"profile-{name}"),
            ]  # fmt: skip
            data = python_stage(
                "bench.suites.profile", argv, self.args.timeout, self.work / f"profile-{name}.log"
            )
            out["models"].append({"name": name, "model_name": path.name, **data})
        return out

    # --------------------------------------------------------------------- run

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        # The machine stage also writes the model: every later stage needs it.
        if "machine" not in self.args.stages:
            self.args.stages.append("machine")
        self.log.run("machine", self.machine)
        if self.results["machine"]["status"] != "ok":
            raise SystemExit("could not describe the machine or write the model; see above")
        self.log.run("bandwidth", self.bandwidth)
        self.log.run("mlx_lm", self.mlx_lm)
        self.log.run("plugin_offline", self.plugin_offline)
        self.log.run("serve_plugin", lambda: self._serve("plugin"))
        self.log.run("serve_cpu", lambda: self._serve("cpu"))
        self.log.run("startup", self.startup)
        self.log.run("kernels", self.kernels)
        self.log.run("profile", self.profile)
        self.results["settings"]["total_seconds"] = round(time.perf_counter() - started, 1)
        from bench.suites.main_report import write_report
        from bench.suites.main_summary import summarize

        self.results["summary"] = summarize(self.results, TARGETS)
        self.log.save()
        write_report(self.results, self.out)
        return self.results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run main", description=__doc__)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="results directory")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, short runs: checks the harness"
    )
    p.add_argument("--peers", action="store_true",
                   help="with --quick: also mlx-lm and vLLM CPU's server")  # fmt: skip
    p.add_argument(
        "--model-size",
        choices=sorted(SHAPES),
        default=None,
        help="random checkpoint to write (default 0.6b; tiny with --quick)",
    )
    p.add_argument("--model", default=None, help="benchmark this checkpoint directory instead")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=None, help="single-stream requests")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help=f"serve levels (default {' '.join(map(str, CONCURRENCY))}; "
        f"{' '.join(map(str, QUICK_CONCURRENCY))} with --quick)",
    )
    p.add_argument(
        "--stages",
        default=None,
        help=f"comma-separated subset of: {', '.join(SECTIONS)} (default all; "
        f"{','.join(QUICK_STAGES)} with --quick, and {','.join(QUICK_PEERS)} with --peers)",
    )
    p.add_argument(
        "--work-dir",
        default=str(Path(tempfile.gettempdir()) / "vllm-metal-bench"),
        help="checkpoints (reused between runs) and raw logs",
    )
    p.add_argument(
        "--kernels-out", default=None, help="where the attention stage writes (def. --out)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per stage process")
    args = p.parse_args(argv)  # fmt: skip
    if args.model_size is None:
        args.model_size = "tiny" if args.quick else "0.6b"
    preset = "quick" if args.quick and args.model_size == "tiny" else args.model_size
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.concurrency is None:
        args.concurrency = list(QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    if args.stages is None:
        quick = QUICK_STAGES + (QUICK_PEERS if args.peers else ())
        args.stages = ",".join(s for s in SECTIONS if not args.quick or s in quick)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(args.stages) - set(SECTIONS)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = Bench(parse_args(argv), argv).run()
    failed = [k for k, v in results.items() if v.get("status") == "error"]
    if failed:
        print(f"stages with errors: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
