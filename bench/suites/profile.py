"""Where a decode step's time goes in the plugin: pyinstrument over an in-process vLLM engine.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so one sampling profiler
sees the scheduler, the model runner, MLX evaluation and vLLM's output processing together. The
engine is stepped by hand and the profiler runs only once every prompt is in and decoding, so
the figures are decode steps, not prefill.

MLX's own calls (nanobind functions) are invisible to the profiler: the time the runner spends
waiting in ``mx.async_eval`` shows as ``execute_model``'s self time, and the wait for the logits
as ``to_torch``. Those two are "device" time; the rest of the runner's inclusive time is its
Python work per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.single_stream import make_prompts

_RUNNER = "vllm_metal/backends/mlx/runner/"

# (label, [(file suffix, function), ...], self_only): the step phases reported, matched on
# pyinstrument frames. A phase's time is the inclusive time (children included) of its matching
# frames, each call path counted once (a match inside a match is not added again), or the
# frames' own time when self_only.
Match = tuple[tuple[str, str], ...]
_EXECUTE = ((_RUNNER + "model_runner.py", "execute_model"),)
_SAMPLE = ((_RUNNER + "sample.py", "sample_step"),)
PHASES: tuple[tuple[str, Match, bool], ...] = (
    ("engine step (total)", (("v1/engine/core.py", "step"),
                             ("v1/engine/core.py", "step_with_batch_queue")), False),
    ("scheduler.schedule", (("v1/core/sched/scheduler.py", "schedule"),), False),
    ("scheduler.update_from_output", (("v1/core/sched/scheduler.py", "update_from_output"),),
     False),
    ("runner (execute_model + sampling)", _EXECUTE + _SAMPLE, False),
    ("  execute_model", _EXECUTE, False),
    ("    wait in mx.async_eval (device)", ((_RUNNER + "sample.py", "finish_step"),), True),
    ("    RequestStates.update", ((_RUNNER + "request_state.py", "update"),), False),
    ("      InputBatch.refresh_metadata", (("v1/worker/gpu_input_batch.py", "refresh_metadata"),),
     False),
    ("      InputBatch.condense", (("v1/worker/gpu_input_batch.py", "condense"),), False),
    ("    pack_batch", ((_RUNNER + "batch.py", "pack_batch"),), False),
    ("    forward (graph build)", ((_RUNNER + "forward.py", "hidden_states"),
                                   (_RUNNER + "forward.py", "logits_of")), False),
    ("      paged attention op", (("vllm_metal/ops/attention/__init__.py", "paged_attention"),),
     False),
    ("      reshape_and_cache op", (("vllm_metal/ops/cache/__init__.py", "reshape_and_cache"),),
     False),
    ("  sample_step", _SAMPLE, False),
    ("    to_torch (wait for logits)", ((_RUNNER + "tensors.py", "to_torch"),), False),
    ("    vLLM Sampler", (("v1/sample/sampler.py", "forward"),), False),
    ("    record_sampled", ((_RUNNER + "request_state.py", "record_sampled"),), False),
    ("output processing (detokenize)", (("v1/engine/output_processor.py", "process_outputs"),),
     False),
)  # fmt: skip
DEVICE_PHASES = ("wait in mx.async_eval (device)", "to_torch (wait for logits)")


def _matches(frame: Any, match: Match) -> bool:
    path, fn = frame.file_path or "", frame.function or ""
    return any(fn == f and path.endswith(suffix) for suffix, f in match)


def _phase_seconds(root: Any, match: Match, self_only: bool) -> float:
    total = 0.0
    stack = [(root, False)]
    while stack:
        frame, inside = stack.pop()
        hit = _matches(frame, match)
        if hit and self_only:
            total += frame.total_self_time
        elif hit and not inside:
            total += frame.time
        stack.extend((child, inside or hit) for child in frame.children)
    return total


def _phase_table(root: Any, steps: int) -> list[dict[str, Any]]:
    rows = []
    for label, match, self_only in PHASES:
        seconds = _phase_seconds(root, match, self_only) if root is not None else 0.0
        rows.append(
            {"phase": label, "seconds": seconds, "ms_per_step": 1e3 * seconds / max(1, steps)}
        )
    by = {r["phase"].strip(): r["ms_per_step"] for r in rows}
    device = sum(by[name] for name in DEVICE_PHASES)
    runner = by["runner (execute_model + sampling)"]
    rows.append({"phase": "runner Python work (runner minus device waits)", "seconds": None,
                 "ms_per_step": max(0.0, runner - device)})  # fmt: skip
    rows.append({"phase": "device waits (MLX evaluation)", "seconds": None, "ms_per_step": device})
    return rows


def _drive(engine: Any, batch: int, params: Any, prompts: list[list[int]], profiler: Any) -> dict:
    """Add `batch` requests, step until each has two tokens (prefill done), then profile the
    remaining decode steps."""
    produced: dict[str, int] = {}

    def pump() -> None:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)

    ids = [f"r{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while min(produced.get(r, 0) for r in ids) < 2:
        pump()
    first = min(produced[r] for r in ids)
    if profiler is not None:
        profiler.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    calls = 0
    while engine.has_unfinished_requests():
        pump()
        calls += 1
    wall = time.perf_counter() - start
    # CPU seconds of all this process's threads: less sensitive than wall time to other load on
    # the machine, and it shows threads that spin while they wait.
    cpu = time.process_time() - cpu_start
    if profiler is not None:
        profiler.stop()
    return {"steps": params.max_tokens - first, "engine_steps": calls, "wall": wall, "cpu": cpu}


def profile(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from pyinstrument import Profiler
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(2048, max(args.batch_sizes) * args.input_len),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        seed=0,
    )
    engine = llm.llm_engine
    from vllm_metal.backends.mlx import blas

    results: dict[str, Any] = {
        "model": args.model,
        "cpu_blas": blas.setup_cpu_blas().describe(),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "workloads": [],
    }
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.input_len, batch)
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        warm = SamplingParams(max_tokens=min(8, args.output_len), ignore_eos=True, temperature=0.0)
        _drive(engine, batch, warm, prompts, None)  # warm-up at this batch size
        # Once without the profiler (the true step time), once with it (where the time goes;
        # the profiler's own cost inflates the Python parts).
        plain = _drive(engine, batch, params, prompts, None)
        profiler = Profiler(interval=args.interval)
        run = _drive(engine, batch, params, prompts, profiler)
        steps = run["steps"]
        session = profiler.last_session
        root = session.root_frame() if session is not None else None
        if args.text_dir:
            text = profiler.output_text(unicode=False, color=False, show_all=False)
            Path(args.text_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.text_dir) / f"profile-batch{batch}.txt").write_text(text)
        results["workloads"].append(
            {
                "batch": batch,
                "steps": steps,
                "engine_steps": run["engine_steps"],
                "wall_s": run["wall"],
                "ms_per_step": 1e3 * run["wall"] / max(1, steps),
                "cpu_ms_per_step": 1e3 * run["cpu"] / max(1, steps),
                "unprofiled_ms_per_step": 1e3 * plain["wall"] / max(1, plain["steps"]),
                "unprofiled_cpu_ms_per_step": 1e3 * plain["cpu"] / max(1, plain["steps"]),
                "phases": _phase_table(root, steps),
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny model, written)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (16 with --quick)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="default 1 32 (1 8 with --quick)")  # fmt: skip
    p.add_argument("--interval", type=float, default=0.0005)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=64 * 2**20)
    p.add_argument("--text-dir", default=None, help="also write pyinstrument's text trees here")
    p.add_argument("--quick", action="store_true", help="shorter runs, smaller batch")
    p.add_argument("--peers", action="store_true", help="the same run: one engine, no peers")
    p.add_argument("--out", default=None, help="write profile.json here")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "vllm-metal-bench"))
    p.add_argument("--json", default=None, help="write the result here (a stage of the main run)")
    args = p.parse_args(argv)
    if args.output_len is None:
        args.output_len = 16 if args.quick else 64
    if args.batch_sizes is None:
        args.batch_sizes = [1, 8] if args.quick else [1, 32]
    if args.model is None:
        from bench.harness.checkpoints import write_model

        args.model = str(write_model(Path(args.work_dir) / "models", "tiny", args.dtype))
    data = {"model": args.model, "batch_sizes": args.batch_sizes, "results": profile(args)}
    if args.json:
        Path(args.json).write_text(json.dumps(data["results"], indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.json").write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
