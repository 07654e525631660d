"""Mutation self-check of the Metal host check: plants one misuse of the MLX / metal-cpp API at a
time in a copy of csrc/ and shows that check.py rejects each. Run: python -m tests.metal_host.mutate
[--only NAME] [--list].

Each mutation re-checks only the translation units that include the mutated file (found through
the quoted #include lines under csrc/), stopping at the first unit that fails. The unmutated sources
must pass `python -m tests.metal_host.check` first, or a "caught" proves nothing."""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.msl.mutate import apply  # plants one mutation in a copy

from . import check


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to csrc/
    pattern: str  # regex that must match exactly once (the original line(s))
    replacement: str


MUTATIONS = [
    Mutation(
        "encoder-method-misnamed",
        "ops/attention/metal.cpp",
        r"enc\.set_input_array\(query, PA_BUF_QUERY\);",
        "enc.set_input_buffer(query, PA_BUF_QUERY);",
    ),
    Mutation(
        "dispatch-with-ints",
        "ops/cache/metal.cpp",
        r"enc\.dispatch_threadgroups\(MTL::Size\(num_tokens, 1, 1\), MTL::Size\(launch\.threads, 1, 1\)\);",
        "enc.dispatch_threadgroups(num_tokens, launch.threads);",
    ),
    Mutation(
        "threadgroup-size-two-dims",
        "ops/attention/metal.cpp",
        r"MTL::Size\(l\.reduce_threads, 1, 1\)",
        "MTL::Size(l.reduce_threads, 1)",
    ),
    Mutation(
        "get-kernel-swapped-args",
        "common/metal_library.cpp",
        r"return d\.get_kernel\(name, kernel_library\(d\)\);",
        "return d.get_kernel(kernel_library(d), name);",
    ),
    Mutation(
        "device-from-stream",
        "ops/cache/metal.cpp",
        r"auto& d = mx::metal::device\(stream\(\)\.device\);",
        "auto& d = mx::metal::device(stream());",
    ),
    Mutation(
        "command-encoder-from-device",  # the pre-0.20 MLX spelling
        "ops/attention/metal.cpp",
        r"auto& enc = mx::metal::get_command_encoder\(stream\(\)\);",
        "auto& enc = d.get_command_encoder(stream().index);",
    ),
    Mutation(
        "encoder-used-as-pointer",  # older MLX forwarded -> to the MTL::ComputeCommandEncoder
        "ops/cache/metal.cpp",
        r"enc\.set_compute_pipeline_state\(metal::kernel\(d, launch\.kernel\)\);",
        "enc->setComputePipelineState(metal::kernel(d, launch.kernel));",
    ),
    Mutation(
        "add-temporary-pointer",
        "common/metal_library.cpp",
        r"enc\.add_temporary\(a\);",
        "enc.add_temporary(&a);",
    ),
    Mutation(
        "ns-string-encoding-misnamed",
        "common/metal_library.cpp",
        r"NS::UTF8StringEncoding",
        "NS::UTF8Encoding",
    ),
    Mutation(
        "new-function-from-char-pointer",
        "common/metal_library.cpp",
        r"newFunction\(fname\)",
        "newFunction(VM_KERNEL_NAME_NAX(f16, 128))",
    ),
    Mutation(
        "function-release-misspelt",
        "common/metal_library.cpp",
        r"f->release\(\);",
        "f->Release();",
    ),
    Mutation(
        "get-library-given-ns-string",
        "common/metal_library.cpp",
        r'return d\.get_library\("vllm_metal_kernels", path\);',
        'return d.get_library("vllm_metal_kernels", NS::String::string(path.c_str(), '
        "NS::UTF8StringEncoding));",
    ),
    Mutation(
        "architecture-gen-misnamed",
        "common/metal_library.cpp",
        r"d\.get_architecture\(\), d\.get_architecture_gen\(\)\)\)",
        "d.get_architecture(), d.get_architecture_generation()))",
    ),
    Mutation(
        "availability-without-wildcard",
        "common/metal_library.cpp",
        r"__builtin_available\(macOS 26\.2, iOS 26\.2, \*\)",
        "__builtin_available(macOS 26.2, iOS 26.2)",
    ),
    Mutation(
        "device-header-missing",
        "common/metal_library.h",
        r'#include "mlx/backend/metal/device\.h"\n',
        "",
    ),
    Mutation(
        "with-metal-branch-undeclared-name",  # shows the VLLM_METAL_WITH_METAL branch is parsed
        "bindings.cpp",
        r'm\.attr\("HAS_METAL"\) = true;',
        'm.attr("HAS_METAL") = vllm_metal::metal::supports_nax;',
    ),
]


@dataclass(frozen=True)
class Outcome:
    mutation: Mutation
    caught: bool
    detail: str
    seconds: float


def _includes(path: Path, src: Path) -> list[Path]:
    found = []
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.MULTILINE):
        for base in (path.parent, src):
            if (base / name).is_file():
                found.append((base / name).resolve())
                break
    return found


def affected_units(file: str, src: Path = check.CSRC) -> list[check.Unit]:
    """The checked units whose quoted-include closure holds csrc/<file>."""
    target = (src / file).resolve()
    chosen = []
    for unit in check.units():
        seen: set[Path] = set()
        todo = [(src / unit.path).resolve()]
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo += _includes(p, src)
        if target in seen:
            chosen.append(unit)
    return chosen


def run_one(mutation: Mutation, root: Path) -> Outcome:
    t0 = time.monotonic()
    units = affected_units(mutation.file)
    with tempfile.TemporaryDirectory(prefix=f"metal-host-mutant-{mutation.name}-") as td:
        src = Path(td) / "csrc"
        shutil.copytree(check.CSRC, src)
        apply(mutation, src)
        for unit in units:
            bad = check.check_unit(unit, root, src).failures
            if bad:
                return Outcome(mutation, True, str(bad[0]), time.monotonic() - t0)
    names = ", ".join(u.path for u in units) or "no unit includes it"
    return Outcome(mutation, False, f"compiles cleanly: {names}", time.monotonic() - t0)


def run_all(chosen: list[Mutation], root: Path, jobs: int = check.DEFAULT_JOBS) -> list[Outcome]:
    """Validates every target first (cheap), then checks the mutants in parallel."""
    with tempfile.TemporaryDirectory() as td:
        for m in chosen:
            shutil.copytree(check.CSRC, Path(td) / m.name)
            apply(m, Path(td) / m.name)
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(lambda m: run_one(m, root), chosen))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run only the named mutation(s)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--jobs", type=int, default=check.DEFAULT_JOBS)
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        raise SystemExit(f"unknown mutation in {args.only}")
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {m.file}")
        return 0
    outcomes = run_all(chosen, check.fetch_headers(), args.jobs)
    for o in outcomes:
        verdict = "CAUGHT" if o.caught else "MISSED"
        print(f"{verdict}  {o.mutation.name:34s} {o.seconds:5.1f}s  {o.detail[:160]}")
    missed = sum(not o.caught for o in outcomes)
    print(f"{len(chosen) - missed}/{len(chosen)} planted misuses caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
