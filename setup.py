"""Build script: packages vllm_metal and, when the toolchain is present, its native extension.

The extension (`vllm_metal._C`) is compiled by CMake against the installed MLX. Set
VLLM_METAL_SKIP_NATIVE=1 to install the pure-Python package only (the plugin then runs on the
pure-MLX reference ops and says so at startup). Either way the package carries csrc/constants.h,
from which Python reads the ops' shared constants when the extension is absent.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CONSTANTS_HEADER = ROOT / "csrc" / "constants.h"


class BuildPy(build_py):
    """Copies csrc/constants.h into the built package as vllm_metal/ops/constants.h (a copy made
    at build time, not a second source: vllm_metal/ops/_header.py reads the source file itself in a
    checkout)."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "vllm_metal" / "ops" / CONSTANTS_HEADER.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CONSTANTS_HEADER, target)


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        import mlx  # noqa: F401  (the build must see the MLX it will run against)
        import nanobind

        in_tree = self.inplace or getattr(self, "editable_mode", False)
        mlx_cmake = subprocess.check_output(
            [sys.executable, "-m", "mlx", "--cmake-dir"], text=True
        ).strip()
        cfg = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMLX_DIR={mlx_cmake}",
            f"-Dnanobind_DIR={nanobind.cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
            # An editable/in-place build is not next to site-packages/mlx: link MLX by path too.
            f"-DVM_ABSOLUTE_MLX_RPATH={'ON' if in_tree else 'OFF'}",
        ]
        subprocess.check_call(["cmake", ext.source_dir, *cfg], cwd=build_dir)
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_dir)
        if sys.platform == "darwin":  # metal_kernels/<op>/*.metal -> vllm_metal/lib/*.metallib
            import runpy

            build = runpy.run_path(str(ROOT / "build_metallib.py"))["build_metallib"]
            build(ROOT, out_dir / "lib")


ext_modules = []
if os.environ.get("VLLM_METAL_SKIP_NATIVE", "0") != "1" and (ROOT / "CMakeLists.txt").exists():
    ext_modules.append(CMakeExtension("vllm_metal._C", ROOT))

setup(ext_modules=ext_modules, cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy})
