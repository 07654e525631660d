"""The shared constants are stated once, in csrc/constants.h: _C exports exactly what the header
says, Python reads them from _C (or from the header when _C is absent), and product code does not
restate them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from child_setups import BLOCK_EXTENSION

from vllm_metal import ops
from vllm_metal.ops import _header

REPO = Path(__file__).resolve().parents[2]

REPORT = """
from vllm_metal import ops
from vllm_metal.ops import _constants
print(json.dumps(dict(
    backend=ops.backend(), head_sizes=ops.HEAD_SIZES, multiple=ops.BLOCK_SIZE_MULTIPLE,
    dtypes=[str(d) for d in ops.FLOAT_DTYPES], constants=_constants.CONSTANTS)))
"""


def run_python(code: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", "import json, sys\n" + code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_METAL_USE_REFERENCE_OPS": "0"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def as_json(value: object) -> object:
    return json.loads(json.dumps(value))


@pytest.fixture(scope="module")
def native_C():
    if not ops.native_available():
        pytest.skip(f"native extension unavailable: {ops.native_unavailable_reason()}")
    from vllm_metal import _C

    return _C


def test_C_exports_exactly_the_header(native_C) -> None:
    assert dict(native_C.CONSTANTS) == _header.parse(_header.header_path().read_text())
    assert native_C.OPS_ABI == native_C.CONSTANTS["OPS_ABI"]


def test_python_reads_the_constants_from_C(native_C) -> None:
    # Change _C's values before vllm_metal.ops is imported: the public constants follow them.
    patch = """
        import mlx.core
        from vllm_metal import _C
        _C.CONSTANTS["HEAD_SIZES"] = (64, 4242)
        _C.CONSTANTS["BLOCK_SIZE_MULTIPLE"] = 24
        _C.CONSTANTS["FLOAT_DTYPES"] = (("f32", "float", "float32", 4),)
    """
    seen = run_python(textwrap.dedent(patch) + REPORT)
    assert seen["backend"] == "native"
    assert seen["head_sizes"] == [64, 4242]
    assert seen["multiple"] == 24
    assert seen["dtypes"] == ["mlx.core.float32"]


def test_without_C_python_reads_the_header() -> None:
    seen = run_python(BLOCK_EXTENSION + REPORT)
    header = _header.header_constants()
    assert seen["backend"] == "reference"
    assert seen["constants"] == as_json(header)
    assert seen["head_sizes"] == list(header["HEAD_SIZES"]) == list(ops.HEAD_SIZES)
    assert seen["multiple"] == header["BLOCK_SIZE_MULTIPLE"] == ops.BLOCK_SIZE_MULTIPLE
    assert seen["dtypes"] == [str(d) for d in ops.FLOAT_DTYPES]


def test_loader_expects_the_abi_of_its_own_sources(native_C) -> None:
    from vllm_metal.ops import _native

    assert _native.OPS_ABI == _header.header_constants()["OPS_ABI"] == native_C.OPS_ABI


def test_parser_follows_nested_lists_and_skips_helpers() -> None:
    text = """
    #define VM_A 3  // comment
    #define VM_HIDDEN_ 9
    #define VM_ONE_(X, ...) X(one, 1, __VA_ARGS__)
    #define VM_PAIRS(X, ...) VM_ONE_(X, __VA_ARGS__) \\
      X(two, 2, __VA_ARGS__)
    #define VM_INTS(X, ...) X(8, __VA_ARGS__) X(16, __VA_ARGS__)
    #define VM_NAME(DT, D) "k_" #DT "_" #D
    #define VM_INSTANCES(X) VM_PAIRS(VM_CB_, X)
    """
    text = "\n".join(line.strip() for line in text.splitlines())
    assert _header.parse(text) == {
        "A": 3,
        "PAIRS": (("one", 1), ("two", 2)),
        "INTS": (8, 16),
    }


def test_product_code_does_not_restate_the_constants() -> None:
    # Spot checks: the head-size list and two distinctive numbers appear only in constants.h.
    header = _header.header_constants()
    head_sizes = r"\D{1,3}".join(map(str, header["HEAD_SIZES"][:3]))
    patterns = [
        re.compile(rf"\b{head_sizes}\b"),
        re.compile(rf"\b{header['THREADGROUP_MEMORY_BYTES']}\b"),
        re.compile(rf"\b{header['DECODE_SPLIT_OUT_KEYS']}\b"),
    ]
    roots = [REPO / "csrc", REPO / "metal_kernels", REPO / "vllm_metal" / "ops"]
    hits = sorted(
        f"{path.relative_to(REPO)}: {pattern.pattern}"
        for root in roots
        for path in root.rglob("*")
        if path.suffix in {".h", ".cpp", ".metal", ".py"} and path.name != _header.HEADER_NAME
        for pattern in patterns
        if pattern.search(path.read_text())
    )
    assert hits == []
    assert all(p.search(_header.header_path().read_text()) for p in patterns[1:])
