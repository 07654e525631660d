"""The Metal host code (and every other unit of the macOS extension) compiles against the headers of
MLX's macOS wheel; planted API misuses are caught; the Apple SDK stand-ins are only what is needed.
See check.py for what the check covers and what it does not."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

from . import check, mutate

pytestmark = pytest.mark.metal_host

# Platform conditionals in the files our units reach, and why the Linux parse is faithful enough.
# A new one (a new MLX, or new code of ours) fails test_platform_conditionals_reviewed until added.
REVIEWED_GATES = {
    "metal_cpp/Foundation/NSObject.hpp": (
        {"__x86_64__", "__i386__", "__arm64__", "__arm__"},
        "objc_msgSend variant per architecture; the x86-64 one is parsed, as macOS x86-64 has it",
    ),
    "metal_cpp/Metal/MTLDevice.hpp": ({"TARGET_OS_OSX"}, "1 from the stand-in, as on macOS"),
    "mlx/api.h": ({"_WIN32"}, "not Windows, as on macOS"),
    "mlx/io/load.h": ({"_WIN32"}, "not Windows, as on macOS"),
    "mlx/types/half_types.h": (
        {"__ARM_FEATURE_FP16_SCALAR_ARITHMETIC", "__ARM_FEATURE_BF16"},
        "arm64 makes float16_t __fp16, here MLX's struct: our sources must not name the types",
    ),
    "csrc/common/thread_pool.cpp": ({"__linux__"}, "the Linux-only extra is parsed too"),
    "csrc/ops/attention/cpu_isa.cpp": ({"__x86_64__"}, "also needs VLLM_METAL_X86_VARIANTS: off"),
    "csrc/ops/attention/cpu_kernel.h": ({"__x86_64__"}, "x86-only declarations, parsed in excess"),
    "csrc/ops/attention/cpu_simd.h": ({"__x86_64__"}, "also needs AVX flags: generic path"),
}
_GATE_LINE = re.compile(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b.*$", re.MULTILINE)
_PLATFORM_MACRO = re.compile(
    r"\b(__APPLE__|__MACH__|__aarch64__|__arm64__|__arm__|__ARM_\w+|TARGET_OS_\w+|__x86_64__"
    r"|__i386__|__linux__|_WIN32)\b"
)


@pytest.fixture(scope="module")
def root() -> Path:
    return check.fetch_headers()


@pytest.fixture(scope="module")
def results(root: Path) -> list[check.UnitResult]:
    return check.check(root=root)


@pytest.fixture(scope="module")
def outcomes(root: Path, results: list[check.UnitResult]) -> dict[str, mutate.Outcome]:
    if check.failures(results):  # a mutant of failing sources would be "caught" for nothing
        pytest.fail("the unmutated sources fail the check (see test_sources_compile)")
    return {o.mutation.name: o for o in mutate.run_all(mutate.MUTATIONS, root)}


def test_units_follow_cmakelists() -> None:
    found = {u.path: u for u in check.units()}
    metal = ["common/metal_library.cpp", "ops/attention/metal.cpp", "ops/cache/metal.cpp"]
    for path in metal + ["bindings.cpp"]:
        assert "VLLM_METAL_WITH_METAL" in found[path].defines, path
    assert found["ops/attention/cpu_kernel.cpp"].defines == ("VM_ISA=generic",)
    # Every source of csrc/ is checked, except the stand-in body that only non-Metal builds use.
    sources = {p.relative_to(check.CSRC).as_posix() for p in check.CSRC.rglob("*.cpp")}
    assert sources - set(found) == {"ops/no_metal.cpp"}
    assert set(found) <= sources


def test_sources_compile(results: list[check.UnitResult]) -> None:
    failed = check.failures(results)
    assert not failed, "the macOS build would fail:\n" + "\n".join(failed)


@pytest.mark.parametrize("name", [m.name for m in mutate.MUTATIONS])
def test_planted_misuse_caught(outcomes: dict[str, mutate.Outcome], name: str) -> None:
    o = outcomes[name]
    assert o.caught, f"{name} ({o.mutation.file}) was not caught: {o.detail}"


def test_stand_ins_are_all_used(results: list[check.UnitResult]) -> None:
    reached = set().union(*(r.includes for r in results))
    stand_ins = sorted(p for p in check.SDK.rglob("*") if p.is_file())
    assert stand_ins
    unused = [
        p.relative_to(check.SDK).as_posix() for p in stand_ins if str(p.resolve()) not in reached
    ]
    assert not unused, f"stand-ins no unit includes (delete them): {unused}"
    for p in stand_ins:
        assert p.read_text().startswith("// Stand-in for Apple's <"), f"{p}: say what it stands for"


def test_stand_ins_shadow_no_wheel_header(root: Path) -> None:
    include = root / "mlx" / "include"
    for p in check.SDK.rglob("*.h"):
        rel = p.relative_to(check.SDK)
        for base in (include, include / "metal_cpp"):
            assert not (base / rel).exists(), f"{rel} stands in for a header the wheel has"


def test_missing_wheel_headers_fail_loudly(tmp_path: Path) -> None:
    unit = next(u for u in check.units() if u.path == "common/metal_library.cpp")
    bad = check.check_unit(unit, tmp_path).failures
    assert any(d.severity == "fatal" and "file not found" in d.message for d in bad), bad


def test_platform_conditionals_reviewed(root: Path, results: list[check.UnitResult]) -> None:
    bases = [(root / "mlx" / "include", ""), (check.CSRC, "csrc/")]
    found: dict[str, set[str]] = {}
    for path in set().union(*(r.includes for r in results)) | {
        str((check.CSRC / r.unit.path).resolve()) for r in results
    }:
        p = Path(path)
        for base, prefix in bases:
            if p.is_relative_to(base.resolve()):
                text = p.read_text(errors="replace")
                names = {
                    n for line in _GATE_LINE.findall(text) for n in _PLATFORM_MACRO.findall(line)
                }
                if names:
                    found[prefix + p.relative_to(base.resolve()).as_posix()] = names
    assert found == {k: v[0] for k, v in REVIEWED_GATES.items()}
    # MLX's float16_t/bfloat16_t are other types on arm64 (see REVIEWED_GATES): keep them out.
    for src in check.CSRC.rglob("*"):
        if src.suffix in (".h", ".cpp"):
            assert not re.search(r"\bb?float16_t\b", src.read_text()), src


def _fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("mlx/include/mlx/backend/metal/device.h", "#pragma once\n")
        zf.writestr(check.MLX_CONFIG, "if (ON)\n    set(MLX_CXX_FLAGS ${MLX_CXX_FLAGS} -D_X_)\n")
        zf.writestr("mlx/lib/libmlx.dylib", "binary")
    return path


def test_local_wheel_gives_headers_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version = check.mlx_version()
    monkeypatch.setenv(check.CACHE_ENV, str(tmp_path / "cache"))
    wrong = _fake_wheel(tmp_path / "mlx_metal-0.0.1-py3-none-macosx_14_0_arm64.whl")
    monkeypatch.setenv(check.WHEEL_ENV, str(wrong))
    with pytest.raises(check.SetupError, match="not for the installed mlx"):
        check.fetch_headers()
    wheel = _fake_wheel(tmp_path / f"mlx_metal-{version}-py3-none-macosx_14_0_arm64.whl")
    monkeypatch.setenv(check.WHEEL_ENV, str(wheel))
    got = check.fetch_headers()
    assert got == tmp_path / "cache" / f"mlx-metal-{version}"
    assert (got / "mlx/include/mlx/backend/metal/device.h").is_file()
    assert not (got / "mlx/lib").exists()
    assert check.mlx_cxx_flags(got) == ["-D_X_"]


def test_download_failure_names_the_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(check.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(check.WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # fails at once, as without network
    with pytest.raises(check.SetupError, match=check.WHEEL_ENV):
        check.fetch_headers()
