"""vLLM's Triton-kernel overrides (`vllm.triton_utils.dispatcher.register_kernels`) with the
modules its reference scan cannot read left out of that scan.

`register_kernels` rebinds every reference to an overridden kernel: it walks the attributes of
every loaded module and reads each one's instance dict (`vars(value).get("kernel")`). An object
whose `__dict__` is answered by its `__getattr__` breaks the walk: llvmlite's `binding.ffi.lib`,
loaded with numba (vLLM's n-gram proposer, librosa), hands back a function wrapper, and the
registration raises AttributeError. Such modules hold no vLLM kernel, so they are taken out of
`sys.modules` for the call and put back after it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


def _unscannable(module: ModuleType) -> bool:
    """Whether the scan's read of some attribute of `module` (`vars(value).get`) would raise."""
    for value in list((getattr(module, "__dict__", None) or {}).values()):
        try:
            if hasattr(value, "__dict__"):
                vars(value).get  # noqa: B018 (the scan's read)
        except (TypeError, AttributeError):
            return True
    return False


def register_kernels(overrides: Mapping[str, Callable[..., Any]]) -> None:
    from vllm.triton_utils import dispatcher

    hidden = {name: m for name, m in list(sys.modules.items()) if _unscannable(m)}
    for name in hidden:
        del sys.modules[name]
    try:
        dispatcher.register_kernels(overrides)
    finally:
        sys.modules.update(hidden)
