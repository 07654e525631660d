"""The generating side of the side-by-side benchmarks (bench.moe, bench.gguf): one `vllm.LLM`
driven over pipes, as bench/pooling_worker.py drives one for embeddings.

The benchmark module starts itself with ``--engine JSON --inputs FILE --reply-fd N`` (the
`bench.pooling_worker.Worker` handle) and hands those arguments to :func:`worker`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _resident_bytes() -> int:
    """Resident memory of this process and its children (the engine core), idle after startup."""
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in (me, *me.children(recursive=True)))


def worker(args: argparse.Namespace) -> int:
    """One `vllm.LLM`; `{"op": "generate", "start", "n", "max_tokens"}` commands (JSON lines) on
    stdin, one JSON reply line each on --reply-fd; `{"op": "quit"}` ends it."""
    reply_file = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(obj: dict[str, Any]) -> None:
        reply_file.write(json.dumps(obj) + "\n")
        reply_file.flush()

    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.inputs).read_text())
    started = time.perf_counter()
    llm = LLM(**json.loads(args.engine))
    engine_start_s = time.perf_counter() - started
    from vllm.platforms import current_platform

    reply({"ready": True, "engine_start_s": round(engine_start_s, 2),
           "platform": type(current_platform).__name__,
           "idle_rss_bytes": _resident_bytes()})  # fmt: skip
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        batch = prompts[cmd["start"] : cmd["start"] + cmd["n"]]
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tpot, ttft = [], []
        for o in outs:
            m, n = o.metrics, len(o.outputs[0].token_ids)
            tpot.append((m.last_token_ts - m.first_token_ts) / max(1, n - 1) * 1e3)
            ttft.append(m.first_token_latency * 1e3)
        reply({
            "seconds": seconds,
            "tokens": [len(o.outputs[0].token_ids) for o in outs],
            "tpot_ms": tpot,
            "ttft_ms": ttft,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        })  # fmt: skip
    reply({"bye": True})
    return 0
