"""How `vllm serve` stops: the engine core exits on its own, and the API server's exit frees what
native extensions own.

- vLLM's default `--shutdown-timeout 0` means "abort in-flight requests at once", and its process
  manager then force-kills the engine core without waiting for it to tear down (ROCm alone gets a
  cleanup window, `get_engine_process_shutdown_timeout`). Killing the engine core mid-teardown
  skips the worker's shutdown (KV-offload transfer threads, the model and pool buffers). The
  same window is given here: the engine core still aborts requests at once, and the manager waits
  up to `TEARDOWN_GRACE_S` for it to exit (it takes about a second) before killing it.
- vLLM's API server freezes the garbage collector's heap after startup (`freeze_gc_heap`) and
  never unfreezes it, so objects in reference cycles survive the interpreter's last collection;
  nanobind extensions (triton's on Linux, MLX's and this plugin's) then print "leaked instances,
  types, functions" at exit. Unfreezing at exit lets the final collection free them.
"""

from __future__ import annotations

import atexit
import gc

# Seconds the engine-core process manager waits for the engine core to exit after SIGTERM when
# `--shutdown-timeout` is 0 (vLLM's default).
TEARDOWN_GRACE_S = 10.0

_INSTALLED = "__vllm_metal_teardown_grace__"


def install() -> None:
    """Give the engine core its teardown window and unfreeze the GC heap at exit (idempotent)."""
    import vllm.v1.engine.utils as engine_utils

    current = engine_utils.get_engine_process_shutdown_timeout
    if getattr(current, _INSTALLED, False):
        return

    def get_engine_process_shutdown_timeout(
        request_timeout: float | None, process_timeout: float | None
    ) -> float | None:
        chosen = current(request_timeout, process_timeout)
        if request_timeout == 0 and chosen == 0:
            return TEARDOWN_GRACE_S
        return chosen

    setattr(get_engine_process_shutdown_timeout, _INSTALLED, True)
    get_engine_process_shutdown_timeout.__wrapped__ = current  # type: ignore[attr-defined]
    engine_utils.get_engine_process_shutdown_timeout = get_engine_process_shutdown_timeout
    atexit.register(gc.unfreeze)
