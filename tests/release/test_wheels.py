"""The release path: a plugin wheel built from this checkout holds what a Mac user's install needs,
installs into a fresh venv on a machine with no compiler and runs its native op, and
``install.sh --stable`` installs it from a local folder standing in for the release.

"No compiler" is enforced with a PATH whose first directory shadows every compiler and build tool
(cc, c++, gcc, clang, cmake, make, ninja, xcrun, metal, ...) by a script that records its call and
fails: a test fails if anything tried to compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "release"))
import wheels

MLX_VERSION = "0.32.4"
TOOLS = (
    "cc",
    "c++",
    "gcc",
    "g++",
    "clang",
    "clang++",
    "ld",
    "cmake",
    "make",
    "ninja",
    "xcrun",
    "metal",
    "nvcc",
    "gcc-12",
    "g++-12",
    "x86_64-linux-gnu-gcc",
    "x86_64-linux-gnu-g++",
)


# Every test of the built wheel is in the `full` tier (the build alone takes a worker about two
# minutes); CI runs the installer's and the release workflow's checks, which need no wheel.
@pytest.fixture(scope="module")
def plugin_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin wheel as a release builds it (against the installed MLX and nanobind)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-w",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("vllm_metal-*.whl")
    return wheel


def no_compiler_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH cannot reach a compiler, and the file that records attempts."""
    trap_dir = tmp_path / "no-compilers"
    trap_dir.mkdir()
    log = tmp_path / "compiler-calls.log"
    for tool in TOOLS:
        script = trap_dir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\nexit 1\n')
        script.chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_METAL_", "VIRTUAL_ENV", "PYTHON"))
    }
    for var in ("CC", "CXX", "CMAKE_ARGS", "LDSHARED"):
        env.pop(var, None)
    env["PATH"] = f"{trap_dir}:{env['PATH']}"
    return env, log


def _compiler_calls(log: Path) -> str:
    return log.read_text() if log.exists() else ""


# --- what a wheel holds -------------------------------------------------------------------------


@pytest.mark.full
def test_built_wheel_is_a_complete_plugin_wheel(plugin_wheel: Path) -> None:
    from vllm_metal import __version__

    report = wheels.inspect(plugin_wheel)
    assert (report.name, report.version) == ("vllm_metal", __version__)
    assert wheels.problems(report, metal=False, nax=False, kernel_names=[]) == []
    # Off macOS there is no Metal library; the release check must say so rather than pass.
    from vllm_metal import _C

    names = list(_C.all_kernel_names())
    missing = wheels.problems(report, metal=True, nax=True, kernel_names=names)
    assert any("vllm_metal.metallib" in p for p in missing), missing


@pytest.mark.full
def test_wheel_check_names_what_is_missing(plugin_wheel: Path, tmp_path: Path) -> None:
    """A wheel without the extension or the entry point (e.g. built with VLLM_METAL_SKIP_NATIVE)."""
    doctored = tmp_path / plugin_wheel.name
    with zipfile.ZipFile(plugin_wheel) as src, zipfile.ZipFile(doctored, "w") as dst:
        for item in src.infolist():
            if "/_C." in item.filename or item.filename.endswith("entry_points.txt"):
                continue
            dst.writestr(item, src.read(item.filename))
    found = wheels.problems(wheels.inspect(doctored), metal=False, nax=False, kernel_names=[])
    assert any("no native extension" in p for p in found), found
    assert any("entry point" in p for p in found), found


@pytest.mark.full
def test_metallib_kernels_are_looked_up_by_name(plugin_wheel: Path, tmp_path: Path) -> None:
    """A metallib holding only some kernels is reported with the missing ones."""
    names = ["paged_attention_decode_f16_hd128", "nax_prefill_f16_hd128"]
    lib = tmp_path / plugin_wheel.name
    shutil.copy(plugin_wheel, lib)
    with zipfile.ZipFile(lib, "a") as zf:
        zf.writestr(wheels.METALLIB, b"MTLB\0" + names[0].encode() + b"\0junk")
    report = wheels.inspect(lib, names)
    assert report.metallib_functions == {names[0]}
    without_nax = wheels.problems(report, metal=True, nax=False, kernel_names=names)
    with_nax = wheels.problems(report, metal=True, nax=True, kernel_names=names)
    assert not any("kernels missing" in p for p in without_nax)
    assert any("kernels missing" in p and names[1] in p for p in with_nax), with_nax


@pytest.mark.full
def test_index_page_links_every_wheel_with_its_digest(plugin_wheel: Path, tmp_path: Path) -> None:
    folder = tmp_path / "release"
    folder.mkdir()
    shutil.copy(plugin_wheel, folder)
    page = wheels.index_html(folder, "https://example.invalid/releases/v1/")
    digest = wheels.sha256(plugin_wheel)
    href = f"https://example.invalid/releases/v1/{plugin_wheel.name}#sha256={digest}"
    assert f'href="{href}"' in page
    with pytest.raises(ValueError, match="no wheels"):
        wheels.index_html(tmp_path / "missing", "https://example.invalid")


# --- installing it --------------------------------------------------------------------------------


@pytest.mark.full
def test_wheel_installs_and_runs_without_a_compiler(plugin_wheel: Path, tmp_path: Path) -> None:
    """A fresh venv gets MLX (the wheel's runtime dependency for its extension) and the plugin
    wheel; the extension loads MLX from that venv and writes a KV cache through its op."""
    env, log = no_compiler_env(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=300)
    py = venv / "bin" / "python"
    cpu = [f"mlx-cpu=={MLX_VERSION}"] if sys.platform == "linux" else []
    proc = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "--no-deps",
            str(plugin_wheel),
            f"mlx=={MLX_VERSION}",
            *cpu,
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = """
import vllm_metal  # first: it sets up MLX's CPU BLAS before mlx.core loads
import mlx.core as mx
from vllm_metal import _C
print(_C.__file__)
print(_C.mlx_runtime_version(), mx.__version__)
# 3 tokens, 2 KV heads, head size 4, into a pool of 2 blocks of 4 slots.
key = mx.arange(24, dtype=mx.float32).reshape(3, 2, 4)
kc = mx.zeros((2, 4, 2, 4)); vc = mx.zeros((2, 4, 2, 4))
mx.eval(kc, vc)
k2, v2 = _C.reshape_and_cache(key, -key, kc, vc, mx.array([5, 0, 2], dtype=mx.int64))
mx.eval(k2, v2)
rows = k2.reshape(8, 2, 4)
assert mx.array_equal(rows[5], key[0]) and mx.array_equal(rows[0], key[1])
assert mx.array_equal(rows[2], key[2]) and mx.array_equal(v2.reshape(8, 2, 4)[2], -key[2])
assert float(mx.abs(rows[1]).sum()) == 0.0
print("op ok")
"""
    run = subprocess.run(
        [str(py), "-c", script],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith(str(venv)), lines  # the installed wheel, not this checkout
    runtime, imported = lines[1].split()
    assert runtime == imported == MLX_VERSION
    assert lines[-1] == "op ok"
    assert _compiler_calls(log) == ""


def _install_sh(
    tmp_path: Path, env: dict[str, str], *args: str, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "install.sh"), "--venv", str(tmp_path / "venv"), *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_stable_install_says_when_no_wheel_fits_this_machine(
    plugin_wheel: Path, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    release.mkdir()
    foreign = plugin_wheel.name.split("-")[:2] + ["cp39", "cp39", "macosx_14_0_arm64.whl"]
    shutil.copy(plugin_wheel, release / "-".join(foreign))
    env, log = no_compiler_env(tmp_path)
    proc = _install_sh(tmp_path, env, "--stable", "--wheels", str(release))
    assert proc.returncode != 0
    assert "no prebuilt vllm-metal==" in proc.stderr and "for this machine" in proc.stderr
    assert "-".join(foreign) in proc.stderr, proc.stderr  # what the release does offer
    assert "./install.sh" in proc.stderr
    assert _compiler_calls(log) == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["--wheels", "/nonexistent"], "only applies with --stable"),
        (["--stable", "--dev"], "pick one"),
        (["--stable", "--wheels", "/nonexistent/dir"], "no such folder"),
    ],
)
def test_stable_install_refuses_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    env, _ = no_compiler_env(tmp_path)
    proc = _install_sh(tmp_path, env, *args, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.full
def test_stable_install_from_a_local_release_folder(plugin_wheel: Path, tmp_path: Path) -> None:
    """The whole ``install.sh --stable`` (vLLM core from its wheel, the plugin from the folder),
    with no compiler reachable; install.sh's own checks then prove vLLM picks the plugin."""
    release = tmp_path / "release"
    release.mkdir()
    shutil.copy(plugin_wheel, release)
    env, log = no_compiler_env(tmp_path)
    proc = _install_sh(tmp_path, env, "--stable", "--wheels", str(release), timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "vLLM platform: MetalPlatform" in proc.stdout
    assert "native extension: vllm_metal._C loaded" in proc.stdout
    assert _compiler_calls(log) == ""
    py = tmp_path / "venv" / "bin" / "python"
    where = subprocess.run(
        [str(py), "-c", "import vllm_metal; print(vllm_metal.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    )
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout


# --- the release workflow -------------------------------------------------------------------------


def test_release_workflow_builds_checks_and_publishes_what_installers_read() -> None:
    import yaml

    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    jobs = flow["jobs"]
    assert set(jobs) == {"wheels", "test", "publish"}
    pythons = jobs["wheels"]["strategy"]["matrix"]["python"]
    assert pythons == jobs["test"]["strategy"]["matrix"]["python"]
    # Every supported Python from the package's floor up has wheels.
    import tomllib

    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert pythons[0] == floor.removeprefix(">=")
    steps = lambda job: "\n".join(s.get("run", "") for s in jobs[job]["steps"])
    assert 'release/wheels.py" check' in steps("wheels") and "--metal --nax" in steps("wheels")
    assert "VLLM_TARGET_DEVICE" in str(jobs["wheels"]["steps"])
    assert "./install.sh --stable --wheels dist" in steps("test")
    assert jobs["publish"]["needs"] == ["wheels", "test"]
    publish = steps("publish")
    assert "release/wheels.py index dist" in publish and "index.html" in publish
    # The index is published where install.sh looks for it.
    install = (ROOT / "install.sh").read_text()
    assert (
        'RELEASE_INDEX="https://github.com/vllm-project/vllm-metal/releases/download/'
        'v$PLUGIN_VERSION/index.html"' in install
    )
    assert "releases/download/$GITHUB_REF_NAME" in publish
    # The commands the workflow runs exist with those options.
    with pytest.raises(SystemExit) as done:
        wheels.main(["index", "--help"])
    assert done.value.code == 0
