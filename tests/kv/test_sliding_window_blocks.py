"""Sliding-window layers get their own KV-cache group, so vLLM frees the blocks that leave the
window: a long request holds less KV memory than with every layer keeping the whole context, and
produces the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_a_long_request_holds_fewer_blocks_with_the_window_freed():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "sliding_window_blocks", "--prompt-len", "448"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    hybrid, single = json.loads(line.removeprefix("RESULT "))
    assert hybrid["kv_cache_groups"] == 2 and single["kv_cache_groups"] == 1
    # Full layer: 29 blocks for 456 tokens; sliding layer: the window's 3 blocks, not 29.
    assert hybrid["decode_kib"] < 0.7 * single["decode_kib"]
    assert hybrid["tokens"] == single["tokens"] and len(hybrid["tokens"]) == 8
