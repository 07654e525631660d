"""Compile Metal kernel sources with the host C++ compiler and run them on the MSL grid runner:
the cached build (source mapping and discovery: translate.py) and the dispatch API."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .translate import Instance, KernelDef, Param, discover, generate_shim, map_source

HERE = Path(__file__).resolve().parent
INCLUDE_DIR = HERE / "include"
RUNNER_SRC = HERE / "runtime" / "runner.cpp"
REPO_ROOT = HERE.parent.parent
# The mutation self-check (mutate.py) points the tests at mutated copies through this variable.
KERNEL_DIR = Path(os.environ.get("VLLM_METAL_MSL_KERNEL_DIR", REPO_ROOT / "metal_kernels"))
# Headers the kernels share with the C++ host (constants.h, common/fp8.h, ops/<op>/params.h), as
# for `metal -I`; mutate.py points at a mutated copy through the variable.
SHARED_INCLUDE_DIR = Path(os.environ.get("VLLM_METAL_MSL_SHARED_DIR", REPO_ROOT / "csrc"))

CXX = os.environ.get("CXX", "g++")
COMMON_FLAGS = ["-std=c++20", "-g1", "-fno-threadsafe-statics", "-Wno-attributes", "-w"]
# -fsanitize=thread only inserts __tsan_* calls before loads/stores; runner.cpp implements them.
KERNEL_FLAGS = [
    "-O1",
    "-fsanitize=thread",
    "--param=tsan-instrument-func-entry-exit=0",
    "-fno-exceptions",
    "-fno-rtti",
]
RUNNER_FLAGS = ["-O2"]
# Macros the Metal compiler predefines for the language level the kernels target (Metal 4).
PREDEFINED = ["-D__METAL_VERSION__=400", "-D__HAVE_TENSOR__=1"]
RUN_TIMEOUT_S = 300


class MslCompileError(RuntimeError):
    """The kernel source did not compile on the host."""


class MslRuntimeError(RuntimeError):
    """The grid runner stopped the kernel: out-of-bounds access, race, divergence, deadlock, ..."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


def cache_dir() -> Path:
    d = os.environ.get("VLLM_METAL_MSL_CACHE")
    path = Path(d) if d else Path(tempfile.gettempdir()) / f"vllm-metal-msl-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------------
# Build (cached by content hash)
# --------------------------------------------------------------------------------------------


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:24]


def _harness_files() -> list[Path]:
    sources = [RUNNER_SRC, Path(__file__), HERE / "translate.py"]
    return sorted(p for p in INCLUDE_DIR.rglob("*") if p.is_file()) + sources


def _compiler_id() -> bytes:
    return subprocess.run([CXX, "--version"], capture_output=True, check=True).stdout


def _run_cc(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise MslCompileError(f"{' '.join(cmd)}\n{r.stderr[-6000:]}")


def _runner_object() -> Path:
    key = _digest(
        *(p.read_bytes() for p in _harness_files()), _compiler_id(), " ".join(RUNNER_FLAGS).encode()
    )
    obj = cache_dir() / f"runner-{key}.o"
    if not obj.exists():
        tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
        _run_cc([CXX, *COMMON_FLAGS, *RUNNER_FLAGS, "-c", str(RUNNER_SRC), "-o", str(tmp)])
        os.replace(tmp, obj)
    return obj


@dataclass
class TgArray:
    """An in-body `threadgroup T name[N];` declaration of one kernel instance."""

    name: str
    size: int
    align: int
    file: str
    line: int


@dataclass
class InstanceLimits:
    """What the compiled program knows of one [[host_name]] instance before any dispatch."""

    max_threads: int | None  # [[max_total_threads_per_threadgroup]]
    static_threadgroup_bytes: int  # its arrays at natural alignment, rounded up to 16
    arrays: list[TgArray]


@dataclass
class Program:
    """One Metal source compiled for the host: its binary and its [[host_name]] instances."""

    source: Path
    binary: Path
    kernels: dict[str, KernelDef]
    instances: dict[str, Instance]

    @property
    def kernel_names(self) -> list[str]:
        return sorted(self.instances)

    @functools.cached_property
    def limits(self) -> tuple[dict[str, InstanceLimits], list[tuple[TgArray, str]]]:
        """Per instance: declared max threads and static threadgroup arrays (every array its
        instantiation declares, whether or not a dispatch reaches it); and the arrays declared
        outside every kernel instance, with their declaring function."""
        r = subprocess.run(
            [str(self.binary), "--describe"], capture_output=True, text=True, check=True
        )
        limits: dict[str, InstanceLimits] = {}
        orphans: list[tuple[TgArray, str]] = []
        for line in r.stdout.splitlines():
            kind, *f = line.split("\t")
            if kind == "kernel":
                limits[f[0]] = InstanceLimits(int(f[1]) or None, int(f[2]), [])
            elif kind == "tgvar":
                limits[f[0]].arrays.append(TgArray(f[3], int(f[1]), int(f[2]), f[5], int(f[4])))
            elif kind == "orphan":
                orphans.append((TgArray(f[2], int(f[0]), int(f[1]), f[4], int(f[3])), f[5]))
        return limits, orphans


def _dependencies(source: Path, inc_flags: list[str]) -> list[Path]:
    """Every file the source includes (its own headers and the shared ones), by the compiler."""
    r = subprocess.run(
        [CXX, "-MM", "-x", "c++", "-std=c++20", "-DMSL_PARSE_ONLY", *inc_flags, str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise MslCompileError(r.stderr[-6000:])
    names = r.stdout.replace("\\\n", " ").split(":", 1)[1].split()
    return sorted({Path(n).resolve() for n in names} - {source})


def compile_source(source: Path | str, extra_include: list[Path] | None = None) -> Program:
    """Compile a .metal file (unchanged) into a grid-runner binary, reusing a cached build."""
    source = Path(source).resolve()
    text = source.read_text()
    mapped = map_source(text, str(source))
    includes = [source.parent, SHARED_INCLUDE_DIR, *(extra_include or [])]
    inc_flags = [*PREDEFINED, f"-I{INCLUDE_DIR}", *(f"-I{p}" for p in includes)]
    key = _digest(
        mapped.encode(),
        *(p.read_bytes() for p in _dependencies(source, inc_flags)),
        *(p.read_bytes() for p in _harness_files()),
        _compiler_id(),
        " ".join(COMMON_FLAGS + KERNEL_FLAGS + PREDEFINED).encode(),
    )
    work = cache_dir() / f"{source.stem}-{key}"
    binary = work / "kernel"
    mapped_path = work / f"{source.stem}.mapped.metal"
    if not binary.exists():
        tmpdir = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=f".{source.stem}-"))
        tmp_mapped = tmpdir / mapped_path.name
        tmp_mapped.write_text(mapped)
        expanded = subprocess.run(
            [
                CXX,
                "-E",
                "-P",
                "-x",
                "c++",
                "-std=c++20",
                "-DMSL_PARSE_ONLY",
                *inc_flags,
                str(tmp_mapped),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if expanded.returncode != 0:
            raise MslCompileError(expanded.stderr[-6000:])
        kernels, instances = discover(expanded.stdout)
        if not instances:
            raise MslCompileError(f"{source}: no [[host_name]] kernel instances found")
        shim = tmpdir / "shim.cpp"
        work_tmp = tmpdir / "final"
        work_tmp.mkdir()
        shutil.copy(tmp_mapped, work_tmp / mapped_path.name)
        shim.write_text(generate_shim(work_tmp / mapped_path.name, kernels, instances))
        obj = tmpdir / "shim.o"
        _run_cc(
            [
                CXX,
                *COMMON_FLAGS,
                *KERNEL_FLAGS,
                *inc_flags,
                "-x",
                "c++",
                "-c",
                str(shim),
                "-o",
                str(obj),
            ]
        )
        _run_cc([CXX, "-no-pie", str(obj), str(_runner_object()), "-o", str(work_tmp / "kernel")])
        (work_tmp / "instances.txt").write_text(
            "".join(f"{i.host_name} {i.function} {i.template_args or ''}\n" for i in instances)
        )
        (work_tmp / "kernels.json").write_text(json.dumps([asdict(k) for k in kernels.values()]))
        try:
            os.replace(work_tmp, work)
        except OSError:
            pass  # another process built the same key first
        shutil.rmtree(tmpdir, ignore_errors=True)
    return _load_program(source, work)


def _load_program(source: Path, work: Path) -> Program:
    kernels: dict[str, KernelDef] = {}
    for k in json.loads((work / "kernels.json").read_text()):
        k["params"] = [Param(**p) for p in k["params"]]
        kernels[k["name"]] = KernelDef(**k)
    instances = {}
    for line in (work / "instances.txt").read_text().splitlines():
        host, fn, *targs = line.split(" ", 2)
        instances[host] = Instance(host, fn, targs[0] if targs and targs[0] else None)
    return Program(source, work / "kernel", kernels, instances)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

BufferArg = str | np.ndarray | tuple[str, int]


@dataclass
class Dispatch:
    """One dispatchThreadgroups call: kernel instance, grid of threadgroups, bindings."""

    kernel: str
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    # [[buffer(n)]]: a buffer name, (name, byte offset), or an array passed by value (setBytes)
    buffers: dict[int, BufferArg]
    threadgroup_memory: dict[int, int] = field(default_factory=dict)
    function_constants: dict[int, object] = field(default_factory=dict)


def _fc_bytes(v: object) -> bytes:
    if isinstance(v, (bool, np.bool_)):
        return np.array(v, dtype=np.bool_).tobytes()
    if isinstance(v, np.generic):
        return v.tobytes()
    if isinstance(v, int):
        return np.int32(v).tobytes()
    if isinstance(v, float):
        return np.float32(v).tobytes()
    raise TypeError(f"function constant of unsupported type {type(v)}")


def _symbolize(binary: Path, message: str) -> str:
    def sub(m: re.Match[str]) -> str:
        pc = int(m[1], 16) - 1
        r = subprocess.run(
            ["addr2line", "-e", str(binary), "-C", "-i", "-p", hex(pc)],
            capture_output=True,
            text=True,
            check=False,
        )
        where = (
            " <- ".join(x.strip() for x in r.stdout.strip().splitlines())
            if r.returncode == 0
            else "?"
        )
        return f"at {where}"

    return re.sub(r"pc=(0x[0-9a-fA-F]+)", sub, message)


def run(
    program: Program,
    buffers: dict[str, np.ndarray],
    dispatches: list[Dispatch],
    outputs: list[str],
) -> dict[str, np.ndarray]:
    """Run `dispatches` in order on the named buffers; return copies of the `outputs` buffers."""
    with tempfile.TemporaryDirectory(prefix="msl-run-") as td:
        tdp = Path(td)
        plan: list[str] = []
        meta: dict[str, np.ndarray] = {}

        def add_buffer(name: str, arr: np.ndarray, read_only: bool) -> None:
            arr = np.ascontiguousarray(arr)
            path = tdp / f"{name}.bin"
            arr.tofile(path)
            plan.append(f"buffer {name} {arr.nbytes} {path} {'ro' if read_only else 'rw'}")
            meta[name] = arr

        for name, arr in buffers.items():
            add_buffer(name, arr, False)
        for di, d in enumerate(dispatches):
            if d.kernel not in program.instances:
                raise KeyError(f"{d.kernel!r} is not a kernel instance of {program.source.name}")
            binds = []
            for idx, b in sorted(d.buffers.items()):
                if isinstance(b, np.ndarray):
                    name = f"_bytes_{di}_{idx}"
                    add_buffer(name, b, True)
                    binds.append(f"bind {idx} {name} 0")
                elif isinstance(b, tuple):
                    binds.append(f"bind {idx} {b[0]} {b[1]}")
                else:
                    binds.append(f"bind {idx} {b} 0")
            plan.append(
                f"dispatch {d.kernel} {' '.join(map(str, d.grid))} {' '.join(map(str, d.threads))}"
            )
            plan += binds
            plan += [f"tgmem {i} {n}" for i, n in sorted(d.threadgroup_memory.items())]
            plan += [
                f"fconst {i} {_fc_bytes(v).hex()}" for i, v in sorted(d.function_constants.items())
            ]
            plan.append("run")
        for name in outputs:
            plan.append(f"output {name} {tdp / (name + '.out')}")
        (tdp / "plan.txt").write_text("\n".join(plan) + "\n")
        r = subprocess.run(
            [str(program.binary), str(tdp / "plan.txt")],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        if r.returncode != 0:
            m = re.search(r"MSL-HARNESS ERROR \[([\w-]+)\]: (.*)", r.stderr, re.DOTALL)
            if m:
                raise MslRuntimeError(m[1], _symbolize(program.binary, m[2].strip()))
            raise MslRuntimeError("crash", f"runner exited with {r.returncode}: {r.stderr[-3000:]}")
        result = {}
        for name in outputs:
            ref = meta[name]
            result[name] = np.fromfile(tdp / (name + ".out"), dtype=ref.dtype).reshape(ref.shape)
        return result
