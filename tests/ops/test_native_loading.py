"""A missing or mismatched native extension fails with a clear ImportError, and vllm_metal.ops then
falls back to the reference ops with exactly one warning (each case in a fresh interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from child_setups import BLOCK_EXTENSION, OTHER_MLX

# Runs in a child interpreter; prints one JSON line with what it saw.
PROBE = """
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)
{setup}
import mlx.core as mx
from vllm_metal import ops
q = mx.ones((1, 2, 64)); kc = mx.ones((1, 8, 1, 64))
out = ops.paged_attention(q, kc, kc, mx.zeros((1, 1), dtype=mx.int32), mx.array([1], dtype=mx.int32),
                          mx.array([0, 1], dtype=mx.int32), scale=0.125)
ops.paged_attention(q, kc, kc, mx.zeros((1, 1), dtype=mx.int32), mx.array([1], dtype=mx.int32),
                    mx.array([0, 1], dtype=mx.int32), scale=0.125)
warnings = [m for level, m in records if level == "WARNING" and "native ops" in m]
print(json.dumps(dict(backend=ops.backend(), reason=ops.native_unavailable_reason(),
                      warnings=warnings, out=float(out.sum()))))
"""


def probe(setup: str, **env: str) -> dict:
    code = PROBE.replace("{setup}", textwrap.dedent(setup))
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_missing_extension_falls_back_with_one_warning() -> None:
    seen = probe(BLOCK_EXTENSION)
    assert seen["backend"] == "reference"
    assert "not available" in seen["reason"] and "pip install" in seen["reason"]
    assert len(seen["warnings"]) == 1
    assert seen["out"] == pytest.approx(2 * 64)  # one key with value 1 everywhere


def test_extension_built_for_other_mlx_is_refused() -> None:
    seen = probe(OTHER_MLX)
    assert seen["backend"] == "reference"
    assert "built against MLX" in seen["reason"] and "0.31.1" in seen["reason"]
    assert len(seen["warnings"]) == 1


def test_native_module_import_error_is_explicit() -> None:
    code = OTHER_MLX + "\nfrom vllm_metal.ops import _native\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "built against MLX" in result.stderr


def test_working_extension_is_used_without_warning() -> None:
    from vllm_metal import ops

    if not ops.native_available():
        pytest.skip(f"native extension unavailable: {ops.native_unavailable_reason()}")
    seen = probe("")
    assert seen["backend"] == "native" and seen["reason"] is None and seen["warnings"] == []
    seen = probe("", VLLM_METAL_USE_REFERENCE_OPS="1")
    assert seen["backend"] == "reference" and seen["warnings"] == []
