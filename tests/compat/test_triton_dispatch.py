"""The rejection sampler's kernel overrides register after numba has loaded llvmlite
(`compat.triton_dispatch`), where vLLM's own `register_kernels` raises: when vLLM's scan stops
raising, the patch can go."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import vllm_metal
import vllm.v1.spec_decode.ngram_proposer  # numba, and with it llvmlite's ffi.lib
from vllm.triton_utils import dispatcher
from vllm_metal.backends.mlx.runner.spec_decode import kernels

kernels.register_rejection_kernels()
name = next(iter(kernels._OVERRIDES))
assert dispatcher._registry[name][1] is kernels._OVERRIDES[name], "not routed"
try:
    dispatcher.register_kernels({name: kernels._OVERRIDES[name]})
except AttributeError:
    print("vLLM's scan raises")
else:
    print("vLLM's scan passes")
"""


def test_overrides_register_after_numba_where_vllms_own_call_raises():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "vLLM's scan raises", proc.stdout
