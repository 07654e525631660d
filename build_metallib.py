"""Compiles metal_kernels/<op>/*.metal into the vllm_metal.metallib shipped in the macOS wheel.

Used by setup.py on macOS (``xcrun -sdk macosx metal``); the NAX kernels need Metal 4 and are
left out, with a warning, when the SDK or compiler cannot build them. The sources include the
headers they share with the C++ host from csrc/ (constants.h, ops/<op>/params.h).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Metal 3.1 is the first version with bfloat; the NAX file needs Metal 4 tensors (macOS 26.2 SDK).
BASE_FLAGS = ["-std=metal3.1", "-O3", "-fno-fast-math", "-Wall"]
NAX_FLAGS = ["-std=metal4.0", "-O3", "-fno-fast-math", "-Wall", "-mmacosx-version-min=26.2"]
NAX_SOURCES = {"attention/nax.metal"}


def _metal(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["xcrun", "-sdk", "macosx", *args], capture_output=True, text=True, check=False
    )


def build_metallib(root: Path, out_dir: Path, name: str = "vllm_metal.metallib") -> Path | None:
    """Compile every kernel source below ``root/metal_kernels`` and link ``out_dir/name``.

    Returns the library path, or None off macOS. Raises RuntimeError when a required (non-NAX)
    source fails to compile, with the compiler's message.
    """
    if sys.platform != "darwin":
        return None
    src_dir = root / "metal_kernels"
    include_dir = root / "csrc"
    air_dir = root / "build" / "metallib"
    air_dir.mkdir(parents=True, exist_ok=True)
    airs: list[str] = []
    for src in sorted(src_dir.rglob("*.metal")):
        rel = src.relative_to(src_dir).as_posix()
        air = air_dir / (rel.removesuffix(".metal").replace("/", "_") + ".air")
        optional = rel in NAX_SOURCES
        flags = NAX_FLAGS if optional else BASE_FLAGS
        result = _metal(["metal", *flags, "-I", str(include_dir), "-c", str(src), "-o", str(air)])
        if result.returncode != 0:
            if optional:
                print(f"build_metallib: skipping {rel} (needs Metal 4):\n{result.stderr}")
                continue
            raise RuntimeError(f"compiling {rel} failed:\n{result.stderr}")
        airs.append(str(air))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / name
    result = _metal(["metallib", *airs, "-o", str(out)])
    if result.returncode != 0:
        raise RuntimeError(f"linking {out.name} failed:\n{result.stderr}")
    return out


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    print(build_metallib(here, here / "vllm_metal" / "lib"))
