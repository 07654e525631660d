"""Compiles the extension's macOS translation units, the Metal host code included, against the
headers of MLX's macOS arm64 wheel, with libclang, on Linux. Run: python -m tests.metal_host.check.

Checked: every source file that CMakeLists.txt compiles into ``_C`` on a macOS build of MLX with
Metal (the ``nanobind_add_module(_C ...)`` list, the ``if(VM_WITH_METAL)`` sources with their
``VLLM_METAL_WITH_METAL`` definition, and the baseline ``cpu_kernel.cpp`` object) parses and
type-checks against the ``mlx/include`` tree of ``mlx-metal==<installed mlx version>`` (MLX's own
headers and its metal-cpp), with the defines MLX's ``MLXConfig.cmake`` gives its users. A wrong MLX
or metal-cpp method name, argument type or overload, a missing include, any clang error or fatal
error, and any warning of ``-Wall -Wextra`` located in our own sources (but for the few listed in
TOLERATED_WARNINGS) fail.

Not checked: linking (that libmlx.dylib and the Metal framework export what the headers declare),
anything at run time (Objective-C messaging, the .metallib contents, kernel names), and what differs
between the x86-64 Linux target parsed here and arm64 macOS: the predefined macros (``__x86_64__``
and ``__linux__`` instead of ``__aarch64__``/``__APPLE__``, so ``#if`` branches on them take the
Linux side), ``int64_t`` being ``long`` rather than ``long long``, MLX's ``float16_t`` being its
struct rather than ``__fp16``, and libstdc++ standing in for libc++. The Apple SDK headers that
metal-cpp includes are replaced by minimal stand-ins (``sdk/``); their declarations are not checked.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CSRC = REPO / "csrc"
CMAKELISTS = REPO / "CMakeLists.txt"
SDK = HERE / "sdk"

CACHE_ENV = "VLLM_METAL_HOST_CACHE"
WHEEL_ENV = "VLLM_METAL_MLX_METAL_WHEEL"
WHEEL_PLATFORM = "macosx_14_0_arm64"
MLX_CONFIG = "mlx/share/cmake/MLX/MLXConfig.cmake"
# The extension's flags (CMakeLists.txt: CMAKE_CXX_STANDARD 20 with CMake's default extensions,
# VM_WARNINGS). Blocks are on by default in Apple's clang; metal-cpp declares block types.
BASE_FLAGS = ["-x", "c++", "-std=gnu++20", "-fblocks", "-Wall", "-Wextra", "-Wno-unused-parameter"]
# Parsing one unit takes 1-3 s; libclang releases the GIL, so threads parse in parallel.
DEFAULT_JOBS = min(4, os.cpu_count() or 1)


class SetupError(RuntimeError):
    """The check cannot run: no wheel, no libclang, no compiler builtin headers."""


@dataclass(frozen=True)
class Unit:
    """One translation unit: a source path relative to csrc/ and its extra -D definitions."""

    path: str
    defines: tuple[str, ...] = ()


def units(cmake: Path = CMAKELISTS) -> list[Unit]:
    """The translation units of ``_C`` as a macOS build with Metal compiles them, read from
    CMakeLists.txt so that a source added there is checked without touching this file."""
    text = cmake.read_text()

    def sources(block: str) -> list[str]:
        return re.findall(r"\$\{VM_SRC\}/(\S+?\.cpp)\b", block)

    module = re.search(r"nanobind_add_module\(\s*_C\b(.*?)\)", text, re.DOTALL)
    metal = re.search(r"\nif\(VM_WITH_METAL\)\n(.*?)\n(?:else|endif)\(", text, re.DOTALL)
    kernel = re.search(r"add_library\(vm_kernel_\$\{name\} OBJECT (.*?)\)", text)
    if not (module and metal and kernel and "vm_kernel_variant(generic)" in text):
        raise SetupError(f"{cmake}: the _C target's layout changed; update units() in {__file__}")
    common = []
    nb_domain = re.search(r"\bNB_DOMAIN\s+(\w+)", module[1])
    if nb_domain:
        common.append(f"NB_DOMAIN={nb_domain[1]}")
    metal_defs = re.findall(r"target_compile_definitions\(_C PRIVATE ([^)]*)\)", metal[1])
    common += [d for group in metal_defs for d in group.split()]
    if "VLLM_METAL_WITH_METAL" not in common:
        raise SetupError(f"{cmake}: if(VM_WITH_METAL) no longer defines VLLM_METAL_WITH_METAL")
    found = [Unit(p, tuple(common)) for p in sources(module[1]) + sources(metal[1])]
    # The CPU kernel is its own object library; arm64 builds only the baseline variant, which
    # sees csrc/ and VM_ISA, not MLX.
    found += [Unit(p, ("VM_ISA=generic",)) for p in sources(kernel[1])]
    return found


def mlx_version() -> str:
    """The installed MLX, whose headers the check must use (the plugin pins one version)."""
    try:
        return importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError as e:
        raise SetupError("mlx is not installed, so its version (and wheel) is unknown") from e


def cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"vllm-metal-host-{os.getuid()}"
    return Path(os.environ.get(CACHE_ENV) or default)


def _wheel_version(wheel: Path) -> str:
    m = re.match(r"mlx_metal-([^-]+)-", wheel.name)
    if not m:
        raise SetupError(f"{wheel} is not named like an mlx-metal wheel (mlx_metal-<version>-...)")
    return m[1]


def _download_wheel(version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"mlx-metal=={version}", "--no-deps"]
    cmd += ["--only-binary=:all:", "--platform", WHEEL_PLATFORM, "--python-version"]
    cmd += [f"{sys.version_info[0]}.{sys.version_info[1]}", "--disable-pip-version-check"]
    r = subprocess.run(cmd + ["-d", str(dest)], capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("mlx_metal-*.whl"))
    if r.returncode != 0 or not wheels:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-4:])
        raise SetupError(
            f"could not download mlx-metal=={version} ({WHEEL_PLATFORM}) with pip "
            f"(exit {r.returncode}):\n{tail}\nWithout network access, fetch that wheel elsewhere "
            f"and set {WHEEL_ENV}=/path/to/mlx_metal-{version}-py3-none-macosx_*_arm64.whl"
        )
    return wheels[0]


def _extract(wheel: Path, dest: Path) -> None:
    """Unpacks only the headers and the CMake config (not the 40 MB of libraries)."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.startswith("mlx/include/") or n == MLX_CONFIG]
        if MLX_CONFIG not in members or not any(
            n.startswith("mlx/include/mlx/backend/metal/") for n in members
        ):
            raise SetupError(f"{wheel} lacks {MLX_CONFIG} or the mlx/backend/metal headers")
        for name in members:
            zf.extract(name, dest)


def fetch_headers() -> Path:
    """Directory holding ``mlx/include`` of the mlx-metal wheel for the installed MLX: taken from
    the cache, else from ``$VLLM_METAL_MLX_METAL_WHEEL``, else downloaded with pip."""
    version = mlx_version()
    root = cache_dir() / f"mlx-metal-{version}"
    if (root / ".complete").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".fetch-") as td:
        local = os.environ.get(WHEEL_ENV)
        if local:
            wheel = Path(local)
            if not wheel.is_file():
                raise SetupError(f"{WHEEL_ENV}={local}: no such file")
        else:
            wheel = _download_wheel(version, Path(td) / "download")
        if _wheel_version(wheel) != version:
            raise SetupError(f"{wheel.name} is not for the installed mlx {version} ({WHEEL_ENV})")
        staged = Path(td) / "tree"
        _extract(wheel, staged)
        (staged / ".complete").write_text(wheel.name + "\n")
        try:
            staged.rename(root)
        except OSError:  # another process filled the cache first
            if not (root / ".complete").is_file():
                raise
    return root


def mlx_cxx_flags(root: Path) -> list[str]:
    """The flags MLXConfig.cmake adds to MLX_CXX_FLAGS in its enabled (``if (ON)``) sections."""
    flags: list[str] = []
    enabled = False
    for line in (root / MLX_CONFIG).read_text().splitlines():
        cond = re.match(r"\s*if\s*\((.*)\)\s*$", line)
        if cond:
            enabled = cond[1].strip() == "ON"
        m = re.match(r"\s*set\(MLX_CXX_FLAGS \$\{MLX_CXX_FLAGS\} (.*)\)", line)
        if m and enabled:
            flags += m[1].split()
    return flags


def require_tools() -> None:
    """Raises SetupError unless libclang and the compiler builtin headers are at hand."""
    try:
        import clang.cindex as ci
    except ImportError as e:
        raise SetupError("the check needs libclang (pyproject's test extras)") from e
    try:
        ci.conf.lib  # loads libclang once, before any parsing thread does  # noqa: B018
    except ci.LibclangError as e:
        raise SetupError(f"libclang does not load: {e}") from e
    _compiler_builtin_headers()


@functools.cache
def _compiler_builtin_headers() -> Path:
    """The libclang wheel carries no resource headers (stddef.h, stdarg.h ...); GCC's serve."""
    try:
        out = subprocess.run(
            ["g++", "-print-file-name=include"], capture_output=True, text=True, check=False
        )
    except OSError as e:
        raise SetupError("the check needs g++ for the compiler builtin headers") from e
    path = Path(out.stdout.strip())
    if not (path / "stddef.h").is_file():
        raise SetupError(f"g++ -print-file-name=include gave {path!s}, which has no stddef.h")
    return path


def compile_args(unit: Unit, root: Path, src: Path = CSRC) -> list[str]:
    """Include order as CMake's: csrc, MLX_INCLUDE_DIRS, then nanobind and Python, and last
    (as system headers) the Apple SDK stand-ins and the compiler's builtin headers."""
    import nanobind

    include = root / "mlx" / "include"
    args = BASE_FLAGS + [f"-I{src}", f"-I{include}", f"-I{include / 'metal_cpp'}"]
    args += [f"-I{nanobind.include_dir()}", f"-I{sysconfig.get_paths()['include']}"]
    args += ["-isystem", str(SDK), "-isystem", str(_compiler_builtin_headers())]
    if (root / MLX_CONFIG).is_file():
        args += mlx_cxx_flags(root)
    return args + [f"-D{d}" for d in unit.defines]


_SEVERITY = {2: "warning", 3: "error", 4: "fatal"}
# Warnings of our sources that GCC gives the Linux build as well, and that are deliberate.
TOLERATED_WARNINGS = {
    "-Wmissing-field-initializers": "designated initializers of the kernel argument structs "
    "leave the per-launch fields to be set later (value-initialized meanwhile)",
}


@dataclass(frozen=True)
class Diagnostic:
    file: str  # csrc/..., mlx/include/..., tests/metal_host/sdk/... or absolute
    line: int
    severity: str  # "warning", "error", "fatal"
    message: str
    option: str = ""  # the -W flag of a warning

    def __str__(self) -> str:
        flag = f" [{self.option}]" if self.option else ""
        return f"{self.file}:{self.line}: {self.severity}: {self.message}{flag}"


@dataclass
class UnitResult:
    unit: Unit
    diagnostics: list[Diagnostic] = field(default_factory=list)
    includes: set[str] = field(default_factory=set)  # every file the unit opened, absolute
    seconds: float = 0.0

    @property
    def failures(self) -> list[Diagnostic]:
        """Errors anywhere; warnings only where they are ours to fix (csrc/) and not tolerated."""
        return [
            d
            for d in self.diagnostics
            if d.severity != "warning"
            or (d.file.startswith("csrc/") and d.option not in TOLERATED_WARNINGS)
        ]


def _display(path: str, root: Path, src: Path) -> str:
    p = Path(path).resolve()
    for base, shown in ((src, "csrc"), (root, ""), (SDK, "tests/metal_host/sdk")):
        if p.is_relative_to(base.resolve()):
            rel = p.relative_to(base.resolve()).as_posix()
            return f"{shown}/{rel}" if shown else rel
    return str(p)


def check_unit(unit: Unit, root: Path, src: Path = CSRC) -> UnitResult:
    require_tools()
    import clang.cindex as ci

    t0 = time.monotonic()
    tu = ci.Index.create().parse(str(src / unit.path), args=compile_args(unit, root, src))
    result = UnitResult(unit)
    for d in tu.diagnostics:
        if d.severity < 2:
            continue
        loc = d.location
        file = _display(loc.file.name, root, src) if loc.file else "<command line>"
        severity = _SEVERITY[min(d.severity, 4)]
        result.diagnostics.append(Diagnostic(file, loc.line, severity, d.spelling, d.option))
    result.includes = {str(Path(inc.include.name).resolve()) for inc in tu.get_includes()}
    result.seconds = time.monotonic() - t0
    return result


def check(
    selected: list[Unit] | None = None,
    root: Path | None = None,
    src: Path = CSRC,
    jobs: int = DEFAULT_JOBS,
) -> list[UnitResult]:
    """Parses the units (all of CMakeLists.txt's by default) against the wheel's headers."""
    root = root if root is not None else fetch_headers()
    chosen = selected if selected is not None else units()
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(lambda u: check_unit(u, root, src), chosen))


def failures(results: list[UnitResult]) -> list[str]:
    """Readable ``file:line: severity: message`` lines of everything that fails the check."""
    return [f"{d}  [in {r.unit.path}]" for r in results for d in r.failures]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unit", action="append", help="check only this csrc/-relative source")
    ap.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    ap.add_argument("--warnings", action="store_true", help="also list MLX header warnings")
    args = ap.parse_args(argv)
    chosen = units()
    if args.unit:
        chosen = [u for u in chosen if u.path in args.unit]
        if len(chosen) != len(args.unit):
            known = ", ".join(u.path for u in units())
            raise SystemExit(f"not a checked unit among {args.unit}; the units are: {known}")
    t0 = time.monotonic()
    root = fetch_headers()
    print(f"MLX headers: {root} (mlx-metal {mlx_version()})")
    results = check(chosen, root, jobs=args.jobs)
    for r in results:
        shown = r.diagnostics if args.warnings else r.failures
        print(f"{'FAIL' if r.failures else 'ok  '}  {r.unit.path:32s} {r.seconds:5.1f}s")
        for d in shown:
            print(f"      {d}")
    bad = sum(bool(r.failures) for r in results)
    print(f"{len(results) - bad}/{len(results)} units compile ({time.monotonic() - t0:.1f}s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
