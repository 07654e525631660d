"""Prebuilt wheels: what a release wheel must contain, and the index that installers read.

A release publishes, per supported Python, a macOS arm64 wheel of the plugin (the native extension
and ``vllm_metal.metallib`` inside) and of vLLM itself (built from vLLM's source release for the
CPU, since vLLM publishes no macOS wheels), plus ``index.html``: one link per wheel with its
SHA-256, which ``pip install --find-links`` reads and verifies. ``install.sh --stable`` and the
Homebrew formula install from that index, so a Mac user never needs a compiler.

    python release/wheels.py check dist/vllm_metal-*.whl --metal --nax
    python release/wheels.py index dist --base-url URL > dist/index.html

``check`` exits non-zero naming what a wheel lacks; ``index`` lists every ``*.whl`` of a folder.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "vllm_metal"
METALLIB = f"{PACKAGE}/lib/vllm_metal.metallib"
# The header the pure-Python fallback reads the ops' constants from (setup.py copies it in).
CONSTANTS = f"{PACKAGE}/ops/constants.h"


@dataclass
class WheelReport:
    """What one wheel file holds, read from its name and its zip directory."""

    path: Path
    name: str
    version: str
    tags: list[str]
    extension: str | None = None  # the _C module's path inside the wheel
    has_constants: bool = False
    metallib_functions: set[str] = field(default_factory=set)  # kernel names found in it
    has_metallib: bool = False
    entry_point: bool = False  # vllm.platform_plugins declares the plugin


def parse_wheel_name(path: Path) -> tuple[str, str, list[str]]:
    """(distribution, version, [python-abi-platform tags]) from a wheel's file name (PEP 427)."""
    parts = path.name.removesuffix(".whl").split("-")
    if len(parts) not in (5, 6) or not path.name.endswith(".whl"):
        raise ValueError(f"{path.name}: not a wheel file name (name-version-python-abi-platform)")
    name, version = parts[0], parts[1]
    py, abi, plat = parts[-3:]
    tags = [f"{p}-{a}-{t}" for p in py.split(".") for a in abi.split(".") for t in plat.split(".")]
    return name, version, tags


def inspect(path: Path, kernel_names: list[str] = ()) -> WheelReport:
    """Reads a plugin wheel's directory; ``kernel_names`` are looked up in its Metal library."""
    name, version, tags = parse_wheel_name(path)
    report = WheelReport(path=path, name=name, version=version, tags=tags)
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        for member in names:
            base = member.rsplit("/", 1)[-1]
            if member.startswith(f"{PACKAGE}/_C.") and base.endswith((".so", ".pyd")):
                report.extension = member
        report.has_constants = CONSTANTS in names
        if METALLIB in names:
            report.has_metallib = True
            blob = zf.read(METALLIB)
            # A metallib stores each function's name as a NUL-terminated string.
            report.metallib_functions = {k for k in kernel_names if k.encode() + b"\0" in blob}
        for member in names:
            if member.endswith(".dist-info/entry_points.txt"):
                text = zf.read(member).decode()
                report.entry_point = (
                    "[vllm.platform_plugins]" in text and f"{PACKAGE}:register" in (text)
                )
    return report


def problems(report: WheelReport, *, metal: bool, nax: bool, kernel_names: list[str]) -> list[str]:
    """What keeps this wheel from being a working release wheel; empty when it is one."""
    out = []
    if report.name != PACKAGE:
        out.append(f"distribution is {report.name!r}, not {PACKAGE!r}")
    if report.extension is None:
        out.append(f"no native extension ({PACKAGE}/_C.*.so): the wheel was built without CMake")
    if not report.has_constants:
        out.append(f"no {CONSTANTS}")
    if not report.entry_point:
        out.append("no vllm.platform_plugins entry point: vLLM would not find the plugin")
    if any(t.endswith("-any") for t in report.tags):
        out.append(f"platform-independent tags {report.tags}: a wheel with _C must be tagged")
    if metal:
        if not report.has_metallib:
            out.append(f"no {METALLIB}: the Metal kernels were not compiled into the wheel")
        required = [k for k in kernel_names if nax or "nax" not in k]
        missing = sorted(set(required) - report.metallib_functions)
        if report.has_metallib and missing:
            out.append(f"{len(missing)} kernels missing from the metallib, e.g. {missing[:3]}")
        if not any(t.endswith("arm64") for t in report.tags):
            out.append(f"tags {report.tags} are not macOS arm64")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def index_html(folder: Path, base_url: str) -> str:
    """A find-links page: every wheel of ``folder`` as ``base_url/<file>#sha256=<digest>``."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise ValueError(f"{folder}: no wheels to index")
    base = base_url.rstrip("/")
    lines = ["<!DOCTYPE html>", "<html><body>"]
    for w in wheels:
        href = html.escape(f"{base}/{w.name}#sha256={sha256(w)}", quote=True)
        lines.append(f'<a href="{href}">{html.escape(w.name)}</a><br>')
    lines.append("</body></html>")
    return "\n".join(lines) + "\n"


def _kernel_names() -> list[str]:
    from vllm_metal import _C  # the build environment's extension, built from the same sources

    return list(_C.all_kernel_names())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    check = sub.add_parser("check", help="check plugin wheels for a release")
    check.add_argument("wheels", nargs="+", type=Path)
    check.add_argument("--metal", action="store_true", help="require the Metal library (macOS)")
    check.add_argument("--nax", action="store_true", help="require the NAX (Metal 4) kernels too")
    index = sub.add_parser("index", help="print the find-links page of a folder of wheels")
    index.add_argument("folder", type=Path)
    index.add_argument("--base-url", required=True, help="where the wheels will be downloadable")
    args = parser.parse_args(argv)

    if args.cmd == "index":
        sys.stdout.write(index_html(args.folder, args.base_url))
        return 0
    names = _kernel_names() if args.metal else []
    failed = False
    for path in args.wheels:
        report = inspect(path, names)
        found = problems(report, metal=args.metal, nax=args.nax, kernel_names=names)
        for p in found:
            print(f"{path.name}: {p}", file=sys.stderr)
        if not found:
            kernels = f", {len(report.metallib_functions)} Metal kernels" if args.metal else ""
            print(f"{path.name}: ok ({report.extension}{kernels})")
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
