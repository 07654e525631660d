"""Patch of `torch.accelerator` where torch has no accelerator (either backend off the Mac).

vLLM's teardown calls `torch.accelerator.empty_cache()` on every non-CPU platform (its V1 runner
also `synchronize()`); torch raises there when it has no accelerator, so they become no-ops.
"""

from __future__ import annotations

import torch

NO_OPS = ("empty_cache", "empty_host_cache", "synchronize")


def tolerate_missing_accelerator() -> None:
    accel = getattr(torch, "accelerator", None)
    if accel is None or accel.is_available():
        return
    for name in NO_OPS:
        if hasattr(accel, name):
            setattr(accel, name, lambda: None)
