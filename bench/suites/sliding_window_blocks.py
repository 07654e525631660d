"""KV blocks a sliding-window model holds for one long request, with vLLM's hybrid KV manager
(sliding-window layers in their own group, blocks outside the window freed) and without it
(every layer keeps blocks for the whole context), side by side on one tiny Gemma 3.

Run: python -m bench.run sliding_window_blocks [--prompt-len 448] [--window 32] [--out DIR]
(the model is tiny, so --quick changes nothing; it prints the two rows as `RESULT [...]`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

KV_BYTES = 32 * 2**20


def blocks_held(
    model: Path, prompt_len: int, hybrid: bool, chunk: int, max_tokens: int = 8
) -> dict:
    """KV memory one request holds at its peak and while it decodes (bytes of used blocks)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler lives in this process
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=prompt_len + max_tokens + 16,
        kv_cache_memory_bytes=KV_BYTES,
        enable_prefix_caching=False,
        max_num_batched_tokens=chunk,
        disable_hybrid_kv_cache_manager=not hybrid,
        seed=0,
    )
    engine = llm.llm_engine
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1  # the null block is never handed out
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": list(range(20, 20 + prompt_len))}, params)
    used, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
        if engine.has_unfinished_requests():
            used.append(total - pool.get_num_free_blocks())
    groups = len(engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups)
    block_bytes = KV_BYTES // pool.num_gpu_blocks
    del llm
    return {
        "hybrid_kv_manager": hybrid,
        "kv_cache_groups": groups,
        "peak_kib": max(used) * block_bytes // 1024,
        "decode_kib": used[-1] * block_bytes // 1024,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run sliding_window_blocks",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=448)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens")
    parser.add_argument("--quick", action="store_true", help="the same run (the model is tiny)")
    parser.add_argument("--peers", action="store_true", help="no peers here: the same run")
    parser.add_argument("--out", type=Path, default=None, help="write sliding_window_blocks.json")
    parser.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from vllm_metal.testing.tiny_models import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "gemma3", "gemma3", sliding_window=args.window)
        rows = [blocks_held(model, args.prompt_len, hybrid, args.chunk) for hybrid in (True, False)]
    print("RESULT " + json.dumps(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"settings": {"prompt_len": args.prompt_len, "window": args.window,
                             "chunk": args.chunk}, "rows": rows}  # fmt: skip
        (args.out / "sliding_window_blocks.json").write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
