"""CPU use of a benchmark's engine processes: what keeps one backend's background work from
slowing the other's measurement when both run side by side."""

from __future__ import annotations

import time


def tree_cpu_seconds(pid: int) -> float:
    """CPU time used so far by a process and every process under it (e.g. its engine core)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def settle(pid: int, window: float = 0.1, busy: float = 0.02, limit: float = 5.0) -> float:
    """Wait until a process tree is idle (under `busy` CPU seconds in a `window`), at most `limit`
    seconds; return the wait. vLLM's CPU worker keeps a core busy for about a second after a call
    returns, which would slow the other backend's next call."""
    started = time.perf_counter()
    before = tree_cpu_seconds(pid)
    while time.perf_counter() - started < limit:
        time.sleep(window)
        now = tree_cpu_seconds(pid)
        if now - before < busy:
            break
        before = now
    return time.perf_counter() - started
