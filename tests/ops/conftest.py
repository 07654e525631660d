"""Fixtures of the ops tests: the native extension (required unless built with SKIP_NATIVE).

The native module is used directly, so VLLM_METAL_USE_REFERENCE_OPS cannot turn a native-vs-
reference comparison into a reference-vs-reference one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def native() -> Iterator[ModuleType]:
    from vllm_metal import ops

    if not ops.native_available():
        if os.environ.get("VLLM_METAL_SKIP_NATIVE") == "1":
            pytest.skip("package installed without the native extension (VLLM_METAL_SKIP_NATIVE=1)")
        pytest.fail(f"native extension unavailable: {ops.native_unavailable_reason()}")
    from vllm_metal.ops import _native

    yield _native
    _native.set_cpu_isa("auto")
    _native.set_num_threads(0)
