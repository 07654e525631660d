"""Where a decode step's time goes in the plugin: pyinstrument over an in-process `vllm.LLM`.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so one sampling profiler
sees the scheduler, the model runner, MLX evaluation and vLLM's output processing together.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.single_stream import make_prompts

# (label, file suffix, function): the step phases reported, matched on pyinstrument frames.
# Each figure is inclusive time (children included), counted once per call path.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("engine step (total)", "v1/engine/core.py", "step"),
    ("scheduler.schedule", "v1/core/sched/scheduler.py", "schedule"),
    ("scheduler.update_from_output", "v1/core/sched/scheduler.py", "update_from_output"),
    ("runner.execute_model", "vllm_metal/backends/mlx/runner/model_runner.py", "execute_model"),
    ("  RequestStates.update", "vllm_metal/backends/mlx/runner/request_state.py", "update"),
    ("    InputBatch.refresh_metadata", "v1/worker/gpu_input_batch.py", "refresh_metadata"),
    ("    InputBatch.condense", "v1/worker/gpu_input_batch.py", "condense"),
    ("  pack_batch", "vllm_metal/backends/mlx/runner/batch.py", "pack_batch"),
    ("  forward", "vllm_metal/backends/mlx/runner/forward.py", "forward"),
    ("    model graph build (model.model)", "mlx_lm/models/qwen3.py", "__call__"),
    ("    paged attention op", "vllm_metal/ops/__init__.py", "paged_attention"),
    ("    reshape_and_cache op", "vllm_metal/ops/__init__.py", "reshape_and_cache"),
    ("  to_torch (logits to torch)", "vllm_metal/backends/mlx/runner/tensors.py", "to_torch"),
    ("runner.sample_tokens", "vllm_metal/backends/mlx/runner/model_runner.py", "sample_tokens"),
    ("  vLLM Sampler", "v1/sample/sampler.py", "forward"),
    ("output processing (detokenize)", "v1/engine/output_processor.py", "process_outputs"),
)


def _inclusive_times(root: Any) -> dict[tuple[str, str], float]:
    """Inclusive seconds per (file, function), not double-counting recursive frames."""
    totals: dict[tuple[str, str], float] = {}

    def walk(frame: Any, on_path: frozenset) -> None:
        key = (frame.file_path or "", frame.function or "")
        if key not in on_path:
            totals[key] = totals.get(key, 0.0) + frame.time
            on_path = on_path | {key}
        for child in frame.children:
            walk(child, on_path)

    walk(root, frozenset())
    return totals


def _phase_table(totals: dict[tuple[str, str], float], steps: int) -> list[dict[str, Any]]:
    rows = []
    for label, suffix, function in PHASES:
        seconds = sum(
            t for (path, fn), t in totals.items() if fn == function and path.endswith(suffix)
        )
        rows.append(
            {"phase": label, "seconds": seconds, "ms_per_step": 1e3 * seconds / max(1, steps)}
        )
    return rows


def profile(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from pyinstrument import Profiler
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=max(args.batch_sizes),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        seed=0,
    )
    results: dict[str, Any] = {"model": args.model, "workloads": []}
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": p} for p in make_prompts(batch, args.input_len, batch)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up at this batch size
        profiler = Profiler(interval=args.interval)
        start, cpu_start = time.perf_counter(), time.process_time()
        profiler.start()
        llm.generate(prompts, params, use_tqdm=False)
        profiler.stop()
        wall = time.perf_counter() - start
        # CPU seconds of all this process's threads: less sensitive than wall time to other
        # load on the machine, and it shows threads that spin while they wait.
        cpu = time.process_time() - cpu_start
        # One step per output token once all prompts are in (a prompt fits one chunk here).
        steps = args.output_len
        session = profiler.last_session
        root = session.root_frame() if session is not None else None
        totals = _inclusive_times(root) if root is not None else {}
        text = profiler.output_text(unicode=False, color=False, show_all=False)
        if args.text_dir:
            Path(args.text_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.text_dir) / f"profile-batch{batch}.txt").write_text(text)
        results["workloads"].append(
            {
                "batch": batch,
                "steps": steps,
                "wall_s": wall,
                "ms_per_step": 1e3 * wall / steps,
                "cpu_ms_per_step": 1e3 * cpu / steps,
                "phases": _phase_table(totals, steps),
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--interval", type=float, default=0.0005)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=64 * 2**20)
    p.add_argument("--text-dir", default=None, help="also write pyinstrument's text trees here")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    Path(args.json).write_text(json.dumps(profile(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
