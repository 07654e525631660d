"""Proves that, off the Mac, importing vllm_metal puts MLX's CPU matmuls on MKL: libmlx's
`cblas_sgemm` binds to the `mkl` package's library (seen by the dynamic linker itself, through
LD_DEBUG=bindings, and by reading libmlx's GOT), the log line names it and its thread count,
VLLM_METAL_CPU_THREADS sets that count and a bad value is refused by name, results match numpy,
and every failure path (mlx.core imported first, MKL missing, a bad library) falls back to MLX's
own BLAS with a warning instead of breaking the import.

Each case runs in a fresh interpreter: the BLAS is chosen once per process, before mlx.core.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import textwrap

import pytest

from vllm_metal import envs
from vllm_metal.backends.mlx import blas

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="MKL is the CPU BLAS on Linux x86_64 only (macOS arm64 uses Accelerate)",
)

LOGGING = (
    "import logging; logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')"
)
MATMUL = "import mlx.core as mx; mx.eval(mx.ones((8, 16)) @ mx.ones((16, 4)))"
REPORT = textwrap.dedent(
    """
    import json
    from vllm_metal.backends.mlx import blas
    info = blas.setup_cpu_blas()
    print("RESULT=" + json.dumps({
        "name": info.name, "path": info.path, "threads": info.threads, "active": info.active,
        "note": info.note, "bound": blas.mlx_sgemm_provider(),
    }))
    """
)


def _env(**overrides: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_METAL_", "MKL_")) and k not in ("LD_PRELOAD", "LD_DEBUG")
    }
    env.update(overrides)
    return env


def _python(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _result(proc: subprocess.CompletedProcess) -> dict:
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    return json.loads(line.removeprefix("RESULT="))


def _mkl() -> str:
    path = blas.find_mkl()
    assert path is not None, "the `mkl` package is a Linux x86_64 dependency: it must be installed"
    return path


def _linker_binding(stderr: str, symbol: str) -> dict[str, str]:
    """{file: library} for each `symbol` binding the dynamic linker reported (LD_DEBUG=bindings)."""
    found = {}
    pattern = re.compile(rf"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `{symbol}'")
    for m in pattern.finditer(stderr):
        found[os.path.realpath(m.group(1))] = os.path.realpath(m.group(2))
    return found


def _libmlx(bindings: dict[str, str]) -> str:
    (lib,) = [lib for f, lib in bindings.items() if f.endswith("/libmlx.so")]
    return lib


def test_the_linker_binds_mlx_cblas_sgemm_to_mkl() -> None:
    proc = _python(f"import vllm_metal\n{MATMUL}", LD_DEBUG="bindings")
    assert os.path.samefile(_libmlx(_linker_binding(proc.stderr, "cblas_sgemm")), _mkl())


def test_reference_mode_leaves_mlx_on_its_bundled_blas() -> None:
    # The same observation tells the two apart: MLX's own libblas when asked for it.
    proc = _python(
        f"import vllm_metal\n{MATMUL}", LD_DEBUG="bindings", VLLM_METAL_CPU_BLAS="reference"
    )
    bound = _libmlx(_linker_binding(proc.stderr, "cblas_sgemm"))
    assert "mlx_cpu.libs" in bound and os.path.basename(bound).startswith("libblas")


def test_in_process_report_matches_the_linker() -> None:
    proc = _python(f"import vllm_metal\n{MATMUL}\n{REPORT}")
    result = _result(proc)
    assert result["active"] is True
    assert result["name"].startswith("Intel MKL") and "GNU OpenMP" in result["name"]
    assert os.path.samefile(result["path"], _mkl())
    assert os.path.samefile(result["bound"], _mkl())


def test_one_info_line_names_the_blas_and_its_threads() -> None:
    code = f"""{LOGGING}
import vllm_metal
from vllm_metal.backends.mlx import blas
blas.setup_cpu_blas(); blas.setup_cpu_blas()
vllm_metal.register()
"""
    proc = _python(code, VLLM_METAL_CPU_THREADS="1")
    lines = [ln for ln in proc.stderr.splitlines() if "CPU BLAS for MLX" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("INFO ")
    assert "Intel MKL" in lines[0] and "libmkl_rt" in lines[0] and "1 thread" in lines[0]


def test_the_line_waits_for_logging_and_comes_once_per_process() -> None:
    # vLLM configures its log handlers after the plugin is imported: the line must not be lost
    # then, nor repeated, and a forked child (a process of its own) says it once too.
    code = f"""import os, sys
import vllm_metal
from vllm_metal.backends.mlx import blas
print("before logging is set up", flush=True)
{LOGGING}
blas.report(); blas.report(); blas.setup_cpu_blas()
sys.stderr.flush()
pid = os.fork()
if pid == 0:
    blas.report(); blas.report(); sys.stderr.flush(); os._exit(0)
os.waitpid(pid, 0)
"""
    proc = _python(code, VLLM_METAL_CPU_THREADS="1")
    lines = [ln for ln in proc.stderr.splitlines() if "CPU BLAS for MLX" in ln]
    assert len(lines) == 2, proc.stderr[-3000:]
    assert all(ln.startswith("INFO ") and "Intel MKL" in ln for ln in lines)


def test_vllm_general_plugin_hook_reports_it() -> None:
    code = f"""import vllm_metal
{LOGGING}
from vllm_metal import envs
envs.register_with_vllm()"""
    proc = _python(code)
    assert sum("CPU BLAS for MLX" in ln for ln in proc.stderr.splitlines()) == 1, proc.stderr


def test_default_threads_follow_the_cpus_this_process_may_use() -> None:
    # taskset narrows the affinity mask: the BLAS must follow it, not os.cpu_count().
    proc = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", f"import vllm_metal\n{REPORT}"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0 and "taskset" in proc.stderr:
        pytest.skip(f"taskset unusable here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _result(proc)["threads"] == 1
    own = len(os.sched_getaffinity(0))
    assert _result(_python(f"import vllm_metal\n{REPORT}"))["threads"] == own


@pytest.mark.parametrize("threads", ["1", str(len(os.sched_getaffinity(0)))])
def test_thread_override_reaches_mkl(threads: str) -> None:
    code = f"""import vllm_metal, ctypes
from vllm_metal.backends.mlx import blas
info = blas.setup_cpu_blas()
print("MKL_MAX_THREADS=%d" % ctypes.CDLL(info.path).MKL_Get_Max_Threads())
{REPORT}"""
    proc = _python(code, VLLM_METAL_CPU_THREADS=threads)
    assert _result(proc)["threads"] == int(threads)
    assert f"MKL_MAX_THREADS={threads}" in proc.stdout


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_bad_thread_count_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("VLLM_METAL_CPU_THREADS", raw)
    with pytest.raises(ValueError, match="VLLM_METAL_CPU_THREADS") as info:
        envs.VLLM_METAL_CPU_THREADS  # noqa: B018
    assert repr(raw) in str(info.value)
    with pytest.raises(ValueError, match="VLLM_METAL_CPU_THREADS"):
        envs.validate()  # what MetalPlatform runs at startup
    # At import the plugin does not raise: it warns by name and uses the default.
    proc = _python(f"{LOGGING}\nimport vllm_metal\n{REPORT}", VLLM_METAL_CPU_THREADS=raw)
    assert "VLLM_METAL_CPU_THREADS" in proc.stderr
    assert _result(proc)["threads"] == len(os.sched_getaffinity(0))


def test_bad_blas_choice_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_METAL_CPU_BLAS", "openblas")
    with pytest.raises(ValueError, match="VLLM_METAL_CPU_BLAS"):
        envs.VLLM_METAL_CPU_BLAS  # noqa: B018
    for value, parsed in [
        ("", "auto"),
        (" Reference ", "reference"),
        ("/opt/lib/libblas.so", "/opt/lib/libblas.so"),
    ]:
        monkeypatch.setenv("VLLM_METAL_CPU_BLAS", value)
        assert envs.VLLM_METAL_CPU_BLAS == parsed


def test_matmuls_match_numpy() -> None:
    code = textwrap.dedent(
        """
        import vllm_metal
        import mlx.core as mx
        import numpy as np
        rng = np.random.default_rng(0)
        worst = 0.0
        for m, k, n in [(1, 1024, 3072), (8, 1024, 3072), (33, 257, 129), (128, 64, 512)]:
            a = rng.standard_normal((m, k), dtype=np.float32)
            b = rng.standard_normal((k, n), dtype=np.float32)
            want = a.astype(np.float64) @ b.astype(np.float64)
            # plain, and with transposed (non-contiguous) operands
            for got in (mx.array(a) @ mx.array(b), mx.array(a.T).T @ mx.array(b),
                        mx.array(a) @ mx.array(b.T).T):
                got = np.asarray(got)
                worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        # batched: [B, M, K] @ [B, K, N]
        a = rng.standard_normal((4, 16, 32), dtype=np.float32)
        b = rng.standard_normal((4, 32, 8), dtype=np.float32)
        got = np.asarray(mx.array(a) @ mx.array(b))
        worst = max(worst, float(np.abs(got - a.astype(np.float64) @ b).max()))
        print("WORST=%g" % worst)
        """
    )
    proc = _python(f"{code}\n{REPORT}")
    assert _result(proc)["active"] is True
    worst = float(re.search(r"WORST=(\S+)", proc.stdout).group(1))
    assert worst < 1e-4, worst


def test_torch_stays_right_beside_mkl() -> None:
    # MKL is in the global scope, so torch's own BLAS calls may bind to it too.
    code = """import vllm_metal, torch, numpy as np
a = torch.randn(65, 130, dtype=torch.float32); b = torch.randn(130, 70, dtype=torch.float32)
want = a.double().numpy() @ b.double().numpy()
print("ERR=%g" % float(np.abs((a @ b).numpy() - want).max()))"""
    proc = _python(code)
    assert float(re.search(r"ERR=(\S+)", proc.stdout).group(1)) < 1e-3


# After MLX's first matmul (its BLAS team started), a torch op large enough to go parallel, then
# the process's OS threads before and after it.
TORCH_BESIDE_MLX = """import os, vllm_metal, torch
from vllm_metal.backends.mlx.device import MLXBackend
{init}
import mlx.core as mx
mx.eval(mx.random.normal((256, 512)) @ mx.random.normal((512, 512)))
before = len(os.listdir("/proc/self/task"))
float(torch.ones(1 << 22).exp().sum())
print("THREADS=%d,%d,%d" % (before, len(os.listdir("/proc/self/task")), torch.get_num_threads()))"""


@pytest.mark.parametrize("init", [True, False], ids=["device-init", "no-init"])
def test_torch_starts_no_openmp_team_beside_mlx_blas(init: bool) -> None:
    # A second OpenMP team (torch's, on the main thread) slows every later BLAS call of MLX's
    # (`blas.leave_the_cores_to_mlx`); the device init keeps torch on the calling thread. The
    # run without it shows that the torch op does start a team here, so the check can fail.
    code = TORCH_BESIDE_MLX.format(init="MLXBackend().init_device()" if init else "")
    proc = _python(code, VLLM_METAL_CPU_THREADS="2")
    before, after, torch_threads = map(int, re.search(r"THREADS=(\S+)", proc.stdout)[1].split(","))
    if init:
        assert (after, torch_threads) == (before, 1)
    else:
        assert after > before and torch_threads > 1


def test_mlx_imported_first_is_reported_not_claimed() -> None:
    code = f"{LOGGING}\nimport mlx.core\nimport vllm_metal\n{MATMUL}\n{REPORT}"
    proc = _python(code)
    result = _result(proc)
    assert result["active"] is False and result["path"] is None
    assert "mlx_cpu.libs" in result["bound"]  # MLX really kept its bundled BLAS
    warning = [ln for ln in proc.stderr.splitlines() if "CPU BLAS for MLX" in ln]
    assert warning and warning[0].startswith("WARNING "), proc.stderr
    assert "imported before vllm_metal" in warning[0]


def test_a_blas_bound_before_the_plugin_is_reported_as_it_is() -> None:
    # LD_PRELOAD puts MKL in front before anything runs: MLX uses it even if mlx.core comes first.
    code = f"{LOGGING}\nimport mlx.core\nimport vllm_metal\n{MATMUL}\n{REPORT}"
    result = _result(_python(code, LD_PRELOAD=_mkl()))
    assert result["active"] is True and "bound before vllm_metal" in result["note"]
    assert os.path.samefile(result["bound"], _mkl())


def test_missing_mkl_falls_back_with_a_warning() -> None:
    code = f"""{LOGGING}
import importlib.metadata as md
real = md.distribution
def distribution(name):
    if name == "mkl":
        raise md.PackageNotFoundError(name)
    return real(name)
md.distribution = distribution
import vllm_metal
{MATMUL}
{REPORT}"""
    proc = _python(code)
    result = _result(proc)
    assert result["active"] is False and "mlx_cpu.libs" in result["bound"]
    assert (
        "WARNING" in proc.stderr
        and "`mkl` package (a dependency on Linux x86_64) is missing" in proc.stderr
    )


def test_unloadable_library_does_not_break_the_import(tmp_path) -> None:
    bogus = tmp_path / "libnotablas.so"
    bogus.write_bytes(b"not an ELF file")
    proc = _python(
        f"{LOGGING}\nimport vllm_metal\n{MATMUL}\n{REPORT}", VLLM_METAL_CPU_BLAS=str(bogus)
    )
    result = _result(proc)
    assert result["active"] is False and "mlx_cpu.libs" in result["bound"]
    assert "loading the optimized BLAS failed" in proc.stderr


def test_nothing_is_loaded_where_mlx_uses_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "uses_accelerate", lambda: True)
    monkeypatch.setattr(blas.ctypes, "CDLL", None)  # any attempt to load would raise
    result = blas._setup()
    assert result.name.startswith("Accelerate") and result.path is None


def test_the_mlx_backend_package_does_not_import_mlx_core() -> None:
    code = """import sys
import vllm_metal.backends.mlx, vllm_metal.backends.mlx.blas
assert "mlx.core" not in sys.modules, "mlx.core imported"
print("RESULT={}")"""
    _python(code)
