"""Puts MLX's CPU matrix products on an optimized BLAS on hosts without Metal.

MLX's Linux wheel (``mlx-cpu``) links the reference netlib BLAS it bundles
(``mlx_cpu.libs/libblas-*.so``): float32 GEMMs run at about 4 GFLOP/s, 20-35x slower than an
optimized BLAS on the same cores. ``libmlx.so`` takes ``cblas_sgemm`` (and the other BLAS/LAPACK
names) from the dynamic linker's *global* scope before its own dependencies, so a library that
exports the standard names and is loaded with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported
receives those calls. Python opens extension modules with ``RTLD_NOW``: libmlx binds its BLAS
symbols once, when ``mlx.core`` is imported, so loading a BLAS afterwards changes nothing (and
:func:`setup_cpu_blas` then says so instead of claiming success).

The library is Intel MKL from the ``mkl`` wheel (a Linux x86_64 dependency of the plugin; why MKL
and not OpenBLAS: docs/installation.md), run on GNU OpenMP, the OpenMP runtime torch already brings
into the process, so torch's and MKL's threads come from one runtime; where the model runs on
MLX's CPU device, torch's host work stays on one thread (:func:`leave_the_cores_to_mlx`). On
macOS arm64 MLX uses Accelerate and nothing here runs.

Who calls it: ``vllm_metal/__init__.py`` at import. vLLM imports the plugin (its
``vllm.platform_plugins`` entry point) in every process it starts before anything touches MLX, so
the engine core and every worker get the library. Code that drives MLX directly in the same process
(mlx-lm in the benchmark harness, a notebook) gets the same BLAS by importing ``vllm_metal`` before
``mlx`` or ``mlx_lm``::

    import vllm_metal  # noqa: F401  (sets up the CPU BLAS)
    import mlx_lm

Settings (docs/configuration.md): ``VLLM_METAL_CPU_BLAS`` (``auto``, ``reference`` or a library
path) and ``VLLM_METAL_CPU_THREADS`` (BLAS threads; default: the CPUs this process may run on).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from vllm_metal._logging import init_logger

logger = init_logger(__name__)

MKL_DISTRIBUTION = "mkl"
MKL_LIBRARY = "libmkl_rt.so"  # versioned: libmkl_rt.so.2 in MKL 2025
# mkl_service.h: MKL_THREADING_INTEL, _SEQUENTIAL, _PGI, _GNU, _TBB.
_MKL_THREADING_SEQUENTIAL = 1
_MKL_THREADING_GNU = 3


@dataclass(frozen=True)
class CpuBlas:
    """What :func:`setup_cpu_blas` did."""

    name: str  # e.g. "Intel MKL 2026.0.2 (GNU OpenMP)", or "MLX's bundled reference BLAS"
    path: str | None  # the library now in the global scope, None if none was loaded
    threads: int | None  # BLAS threads set, None if not set
    active: bool  # True when MLX's cblas_sgemm will bind to `path`
    note: str = ""  # why it is not active, or anything unusual
    warn: bool = False  # logged as a warning: the optimized BLAS was wanted but is not in use

    def describe(self) -> str:
        parts = [self.name]
        if self.path:
            parts.append(f"from {self.path}")
        if self.threads is not None:
            parts.append(f"{self.threads} thread{'s' if self.threads != 1 else ''}")
        text = ", ".join(parts)
        return f"{text} ({self.note})" if self.note else text


_lock = threading.Lock()
_result: CpuBlas | None = None
_reported_pid: int | None = None


def uses_accelerate() -> bool:
    """True on macOS arm64, where MLX runs on Metal and its CPU ops on Accelerate."""
    return sys.platform == "darwin" and platform.machine() == "arm64"


def setup_cpu_blas() -> CpuBlas:
    """Load the optimized BLAS for MLX once per process; never raises.

    Must run before ``mlx.core`` is first imported (``import vllm_metal`` does it). Later calls
    return the first call's result.
    """
    global _result
    with _lock:
        if _result is not None:
            report()
            return _result
        try:
            result = _setup()
        except Exception as exc:  # noqa: BLE001 - a BLAS problem must never stop the import
            result = CpuBlas(
                "MLX's bundled reference BLAS",
                None,
                None,
                False,
                f"loading the optimized BLAS failed: {exc}",
                warn=True,
            )
        _result = result
        report()
        return result


def report() -> None:
    """Log the line naming the CPU BLAS, once per process, as soon as logging is configured.

    vLLM attaches its log handlers late (when it builds an engine, or at the start of an engine
    process), after the plugin is imported; an INFO line logged before then would be dropped, so
    it waits for the next call. Warnings go out at once (Python prints them even unconfigured).
    """
    global _reported_pid
    result = _result
    if result is None or _reported_pid == os.getpid() or uses_accelerate():
        return
    if result.warn:
        logger.warning("CPU BLAS for MLX: %s", result.describe())
    elif logger.hasHandlers():
        logger.info("CPU BLAS for MLX: %s", result.describe())
    else:
        return
    _reported_pid = os.getpid()


def leave_the_cores_to_mlx() -> None:
    """In the process that runs the model on MLX's CPU device: torch's own work there (vLLM's
    host samplers, the rejection sampler, grammar masks) runs on the calling thread alone, where
    an optimized BLAS with more than one thread is in use.

    The BLAS runs MLX's matmuls on GNU OpenMP, the runtime of torch's parallel ops too. A torch
    op that goes parallel on a thread other than MLX's starts a second OpenMP team; from then on
    libgomp manages more threads than there are CPUs, stops spinning between parallel regions,
    and each of MLX's BLAS calls waits for its workers to wake. Measured on 2 cores: one
    rejection-sampler call made every later decode step of a Qwen3.5 target about 8% slower,
    for the life of the process (docs/benchmarks/README.md, *MTP*). A team once started stays,
    so this must run before torch's first parallel op: at device init.
    """
    result = _result
    if result is None or not result.active or (result.threads or 1) <= 1:
        return
    import torch

    torch.set_num_threads(1)


def cpu_threads() -> int:
    """BLAS threads: VLLM_METAL_CPU_THREADS, else the CPUs this process may run on."""
    from vllm_metal import envs

    value = envs.VLLM_METAL_CPU_THREADS
    if value != "auto":
        return int(value)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _setup() -> CpuBlas:
    if uses_accelerate():
        return CpuBlas("Accelerate (macOS)", None, None, True)
    from vllm_metal import envs

    try:
        choice = envs.VLLM_METAL_CPU_BLAS
    except ValueError as exc:
        return CpuBlas("MLX's bundled reference BLAS", None, None, False, f"{exc}", warn=True)
    if choice == "reference":
        return CpuBlas(
            "MLX's bundled reference BLAS", None, None, False, "VLLM_METAL_CPU_BLAS=reference"
        )

    if "mlx.core" in sys.modules:
        # libmlx has bound its BLAS symbols already; loading a library now would not reach MLX.
        bound = mlx_sgemm_provider()
        if bound is not None and not _library_label(bound).startswith("MLX's"):
            # Something put an optimized BLAS in front before (e.g. LD_PRELOAD): MLX uses it.
            return CpuBlas(_library_label(bound), bound, None, True, "bound before vllm_metal")
        return CpuBlas(
            _library_label(bound) if bound else "unknown",
            None,
            None,
            False,
            "mlx.core was imported before vllm_metal, so MLX keeps the BLAS it bound then"
            f" ({bound or 'not found'}); import vllm_metal first",
            warn=True,
        )

    try:
        threads = cpu_threads()
        threads_note = ""
    except ValueError as exc:
        threads = max(1, len(os.sched_getaffinity(0)))
        threads_note = f"{exc}; using {threads}"
        logger.warning("%s", threads_note)

    if choice == "auto":
        path = find_mkl()
        if path is None:
            if platform.machine() == "x86_64":
                why = f"the `{MKL_DISTRIBUTION}` package (a dependency on Linux x86_64) is missing"
            else:
                why = f"there is no MKL for {platform.machine()}"
            return CpuBlas(
                "MLX's bundled reference BLAS",
                None,
                None,
                False,
                f"{why}; float32 matmuls run on the slow reference BLAS",
                warn=True,
            )
    else:
        path = choice

    # Before the BLAS: MKL's GNU threading layer takes its GOMP_* symbols from the global scope.
    gnu_openmp = os.environ.get("MKL_THREADING_LAYER", "gnu").lower() == "gnu" and (
        _load_gnu_openmp()
    )
    lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    if _symbol(lib, "MKL_Set_Threading_Layer") is not None:
        name, threads = _configure_mkl(lib, threads, gnu_openmp)
    else:
        name, threads = _configure_other(lib, path, threads)

    provider = global_provider("cblas_sgemm")
    same = provider is not None and os.path.samefile(provider, path)
    note = threads_note
    if not same:
        note = f"cblas_sgemm resolves to {provider or 'nothing'} first, which MLX will use"
    return CpuBlas(name, path, threads, same, note, warn=not same)


def find_mkl() -> str | None:
    """Path of libmkl_rt from the installed `mkl` distribution, or None."""
    try:
        dist = importlib.metadata.distribution(MKL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name.startswith(MKL_LIBRARY + "."):
            path = Path(dist.locate_file(f)).resolve()
            if path.is_file():
                return str(path)
    return None


def _symbol(lib: ctypes.CDLL, name: str):
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


def _configure_mkl(lib: ctypes.CDLL, threads: int, gnu_openmp: bool) -> tuple[str, int]:
    # The threading layer must be chosen before any other MKL call: the first call loads the
    # default one (Intel OpenMP, a second OpenMP runtime beside torch's GNU one).
    if "MKL_THREADING_LAYER" in os.environ:
        layer = os.environ["MKL_THREADING_LAYER"].lower()
    elif gnu_openmp:
        lib.MKL_Set_Threading_Layer(_MKL_THREADING_GNU)
        layer = "gnu"
    else:
        lib.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL)
        layer = "sequential"
    lib.MKL_Set_Num_Threads(1 if layer == "sequential" else threads)
    threads = int(lib.MKL_Get_Max_Threads())
    lib.MKL_Get_Version_String.argtypes = [ctypes.c_char_p, ctypes.c_int]
    buf = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buf, len(buf))
    version = buf.value.decode(errors="replace").strip()
    # "Intel(R) oneAPI Math Kernel Library Version 2025.3.1-Product Build ..." -> "2025.3.1"
    short = version.split("Version", 1)[-1].split("-", 1)[0].strip() if version else "?"
    label = {"gnu": "GNU OpenMP", "sequential": "sequential", "intel": "Intel OpenMP"}
    return f"Intel MKL {short} ({label.get(layer, layer)})", threads


def _configure_other(lib: ctypes.CDLL, path: str, threads: int) -> tuple[str, int | None]:
    name = _library_label(path)
    get_config = _symbol(lib, "openblas_get_config")
    if get_config is not None:
        get_config.restype = ctypes.c_char_p
        name = (get_config() or b"OpenBLAS").decode(errors="replace").split(" ")[:2]
        name = " ".join(name)
    for setter, getter in [
        ("openblas_set_num_threads", "openblas_get_num_threads"),
        ("bli_thread_set_num_threads", "bli_thread_get_num_threads"),
    ]:
        set_fn, get_fn = _symbol(lib, setter), _symbol(lib, getter)
        if set_fn is not None:
            set_fn(threads)
            return name, int(get_fn()) if get_fn is not None else threads
    return name, None


def _load_gnu_openmp() -> bool:
    """Put libgomp into the global scope (MKL's GNU layer takes its GOMP_* symbols from there).

    torch's bundled copy is preferred: torch later links the already loaded copy by its soname,
    so the process ends up with a single GNU OpenMP runtime either way.
    """
    candidates = []
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates.append(str(Path(location) / "lib" / "libgomp.so.1"))
    try:
        ctypes.CDLL("libgomp.so.1", mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        return True  # already loaded (e.g. torch was imported first)
    except OSError:
        pass
    for candidate in [*candidates, "libgomp.so.1"]:
        if "/" in candidate and not os.path.isfile(candidate):
            continue
        try:
            ctypes.CDLL(candidate, mode=os.RTLD_GLOBAL)
            return True
        except OSError:
            continue
    return False


def _library_label(path: str) -> str:
    base = os.path.basename(path)
    if base.startswith("libblas") and "mlx_cpu.libs" in path:
        return "MLX's bundled reference BLAS"
    return base


# --- which library a symbol resolves to ---------------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _library_of(address: int) -> str | None:
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not address or not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return None
    return os.path.realpath(info.dli_fname.decode()) if info.dli_fname else None


def global_provider(symbol: str) -> str | None:
    """The library that `symbol` resolves to in the global scope (what libmlx will bind), or None."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
    except AttributeError:
        return None
    return _library_of(address)


def _libmlx_path() -> str | None:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "lib" / "libmlx.so"
        if path.is_file():
            return str(path)
    return None


def _got_offsets(path: str, symbol: str) -> list[int]:
    """Offsets (from the load base) of the GOT slots through which `path` calls `symbol`."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return []  # only 64-bit little-endian ELF
        (shoff,) = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]

        def read(index: int) -> bytes:
            sh = sections[index]
            f.seek(sh[4])
            return f.read(sh[5])

        offsets = []
        for sh in sections:
            if sh[1] != 4:  # SHT_RELA
                continue
            symtab_index = sh[6]
            if sections[symtab_index][1] != 11:  # relocations against .dynsym only
                continue
            symtab = read(symtab_index)
            strtab = read(sections[symtab_index][6])
            relocs = read(sections.index(sh))
            for i in range(0, len(relocs), 24):
                r_offset, r_info, _ = struct.unpack_from("<QQq", relocs, i)
                if r_info & 0xFFFFFFFF not in (6, 7):  # R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
                    continue
                (st_name,) = struct.unpack_from("<I", symtab, (r_info >> 32) * 24)
                end = strtab.index(b"\0", st_name)
                if strtab[st_name:end] == symbol.encode():
                    offsets.append(r_offset)
        return offsets


def mlx_sgemm_provider() -> str | None:
    """The library libmlx's `cblas_sgemm` calls go to, read from libmlx's GOT, or None.

    Needs libmlx to be loaded (``import mlx.core``); None when it is not, or off x86_64 Linux.
    """
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return None
    path = _libmlx_path()
    if path is None:
        return None
    try:
        handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None  # not loaded
    # glibc's dlopen handle is the library's `struct link_map`, whose first field is the load bias.
    base = ctypes.c_size_t.from_address(handle._handle).value
    for offset in _got_offsets(path, "cblas_sgemm"):
        target = ctypes.c_void_p.from_address(base + offset).value
        provider = _library_of(target or 0)
        if provider is not None:
            return provider
    return None
