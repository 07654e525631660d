"""Apple's Metal rules that g++ does not enforce, checked statically over the .metal sources.

    python -m tests.msl.apple_rules [FILE.metal ...] [--no-build]

(default: every .metal file under metal_kernels/; exit status 1 if anything is reported.)

Three sources of facts:
- the macro-expanded source (g++ -E, the stand-in headers reduced to nothing, as the harness's
  discovery reads it): argument tables, declared [[max_total_threads_per_threadgroup]], the
  template arguments of [[host_name]] instances;
- the C++ AST of the mapped source (apple_ast.py, libclang): language restrictions, SIMD-width
  assumptions, which kernels use simdgroup functions;
- the harness build of the source (--describe of its runner binary): the static threadgroup arrays
  of every kernel instance, dispatched by a test or not.
The runner enforces the dispatch-time side (threads per threadgroup, whole simdgroups, 32 KiB in
all): see docs/metal-verification.md.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import functools
import operator
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import apple_ast, harness
from .apple_ast import Report, display_path
from .translate import _ATTR, _KERNEL_FN, KernelDef, _matching, discover

THREADGROUP_MEMORY = 32768  # bytes per threadgroup on Apple GPUs
MAX_THREADS = 1024  # a compute pipeline's maxTotalThreadsPerThreadgroup is at most this
SIMD_WIDTH = apple_ast.SIMD_WIDTH
# Argument tables: highest index per parameter attribute (Apple-silicon tables: 31 buffers,
# 31 threadgroup-memory slots, 128 textures, 16 samplers); function constants: indices < 65536.
ARGUMENT_TABLES = {
    "buffer": 30,
    "threadgroup": 30,
    "msl_threadgroup": 30,
    "texture": 127,
    "sampler": 15,
}
FUNCTION_CONSTANT_INDICES = 65536

RULES = {
    "threadgroup-memory": "a kernel instance's static threadgroup arrays take at most 32 KiB",
    "threads-per-threadgroup": "[[max_total_threads_per_threadgroup(N)]] with 1 <= N <= 1024",
    "simd-width": "no SIMD width other than 32 assumed (width constants, lane arguments)",
    "argument-index": "[[buffer/threadgroup(n)]] n <= 30, texture <= 127, sampler <= 15, "
    "[[function_constant(n)]] n < 65536",
    "argument-duplicate": "no two parameters of a kernel on the same index of one table",
    "recursion": "no direct or mutual recursion among kernel-code functions",
    "exceptions": "no throw, try or catch",
    "virtual-function": "no virtual member functions or virtual bases",
    "function-pointer": "no function or member-function pointers, no taking a function's address",
    "double": "no double (or long double) type; unsuffixed literals are accepted (float in Metal)",
    "dynamic-allocation": "no new, delete, malloc, free",
    "writable-global": "program-scope and function-scope static variables are constant",
    "variable-length-array": "no variable-length arrays",
    "thread-local": "no thread_local",
    "rtti": "no typeid or dynamic_cast",
    "goto": "no goto",
    "parse": "the lint could read the source (libclang / preprocessing errors)",
    "compile": "the harness could build the source (needed for threadgroup-memory)",
}


@dataclass
class InstanceFacts:
    """What the host planners' launches of one [[host_name]] instance must respect."""

    function: str  # the kernel function it instantiates
    max_threads: int  # min(1024, its [[max_total_threads_per_threadgroup]])
    uses_simdgroup: bool  # calls simd_*/simdgroup_*/quad_* functions (itself or via callees)


@dataclass
class _Kernel:
    """A kernel definition as the macro-expanded source shows it."""

    file: str
    line: int
    declares_max: bool  # has [[max_total_threads_per_threadgroup(N)]]
    max_threads: int | None  # N if it is a literal expression (else it depends on the instance)


# --------------------------------------------------------------------------------------------
# Macro-expanded source
# --------------------------------------------------------------------------------------------


class _Expanded:
    """`g++ -E` output of a .metal file with its line markers blanked, and the origin
    (file, line) of every offset."""

    def __init__(self, source: Path) -> None:
        cmd = [
            harness.CXX,
            "-E",
            "-x",
            "c++",
            "-std=c++20",
            "-DMSL_PARSE_ONLY",
            *harness.PREDEFINED,
            f"-I{harness.INCLUDE_DIR}",
            f"-I{source.parent}",
            f"-I{harness.SHARED_INCLUDE_DIR}",
            str(source),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise ValueError(r.stderr[-3000:])
        lines, self.starts, self.origins = [], [], []
        offset, file, line = 0, str(source), 1
        for text in r.stdout.split("\n"):
            marker = re.match(r'# (\d+) "([^"]*)"', text)
            self.starts.append(offset)
            self.origins.append((file, line))
            if marker:
                file, line = marker[2], int(marker[1])
                text = " " * len(text)
            else:
                line += 1
            lines.append(text)
            offset += len(text) + 1
        self.text = "\n".join(lines)

    def origin(self, offset: int) -> tuple[str, int]:
        file, line = self.origins[bisect.bisect_right(self.starts, offset) - 1]
        return display_path(file), line


_INDEX_ATTR = re.compile(r"\[\[\s*(\w+)\s*\(([^()\]]*)\)\s*\]\]")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.USub: operator.neg,
}


def _int_expr(expr: str) -> int | None:
    """Value of an integer constant expression of literals (as macros expand to), else None."""

    def ev(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.operand))
        raise ValueError(expr)

    expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b", r"\1", expr).replace("/", "//")
    try:
        return ev(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def _parameters(text: str, kernel_offset: int) -> list[tuple[int, str]]:
    """(offset, text) of each parameter of the kernel defined at kernel_offset."""
    open_at = _KERNEL_FN.match(text, kernel_offset).end() - 1
    close_at = _matching(text, open_at, "(", ")") - 1
    out, depth, start = [], 0, open_at + 1
    for i in range(open_at + 1, close_at + 1):
        c = text[i]
        if c in "(<[{":
            depth += 1
        elif c in ")>]}" and i < close_at:
            depth -= 1
        if (c == "," and depth == 0) or i == close_at:
            raw = text[start:i]
            out.append((start + len(raw) - len(raw.lstrip()), raw.strip()))
            start = i + 1
    return [p for p in out if p[1]]


def _check_arguments(text: str, k: KernelDef, report: Callable[..., None]) -> None:
    """Argument-table indices of one kernel's parameters: in range, and one parameter per index."""
    slots: dict[tuple[str, int], list[str]] = {}
    for offset, param in _parameters(text, k.offset):
        name = re.search(r"(\w+)\s*$", _ATTR.sub(" ", param))
        for attr, value in _INDEX_ATTR.findall(param):
            index = _int_expr(value)
            if attr not in ARGUMENT_TABLES or index is None:
                continue
            table = attr.removeprefix("msl_")
            if not 0 <= index <= ARGUMENT_TABLES[attr]:
                report(
                    offset,
                    "argument-index",
                    k.name,
                    f"[[{table}({index})]] beyond the table's {ARGUMENT_TABLES[attr] + 1} slots",
                )
            slots.setdefault((table, index), []).append(name[1] if name else param)
            dup = slots[(table, index)]
            if len(dup) > 1:
                report(
                    offset,
                    "argument-duplicate",
                    k.name,
                    f"[[{table}({index})]] bound to both {dup[0]} and {dup[-1]}",
                )


def _text_rules(exp: _Expanded) -> tuple[list[Report], dict, dict]:
    reports: list[Report] = []

    def report(offset: int, rule: str, where: str, message: str) -> None:
        reports.append(Report(*exp.origin(offset), rule, where, message))

    kernels, instances = discover(exp.text)
    info: dict[str, _Kernel] = {}
    for k in kernels.values():
        n = _int_expr(k.max_threads) if k.max_threads is not None else None
        info[k.name] = _Kernel(*exp.origin(k.offset), k.max_threads is not None, n)
        if n is not None and not 1 <= n <= MAX_THREADS:
            report(
                k.offset,
                "threads-per-threadgroup",
                k.name,
                f"[[max_total_threads_per_threadgroup({k.max_threads})]] is not in 1..1024",
            )
        _check_arguments(exp.text, k, report)
    for m in re.finditer(r"\[\[\s*function_constant\s*\(([^()\]]*)\)\s*\]\]", exp.text):
        index = _int_expr(m[1])
        if index is not None and not 0 <= index < FUNCTION_CONSTANT_INDICES:
            report(
                m.start(),
                "argument-index",
                "program scope",
                f"[[function_constant({index})]] not below {FUNCTION_CONSTANT_INDICES}",
            )
    for inst in instances:
        if inst.template_args and re.search(r"\bdouble\b", inst.template_args):
            report(
                inst.offset, "double", inst.host_name, f"instantiated with <{inst.template_args}>"
            )
    return reports, info, {i.host_name: i.function for i in instances}


@functools.lru_cache(maxsize=64)
def _text_pass(path: str, text: str) -> tuple[list[Report], dict, dict]:
    try:
        return _text_rules(_Expanded(Path(path)))
    except ValueError as e:
        return [Report(display_path(path), 1, "parse", "", str(e).strip()[-2000:])], {}, {}


# --------------------------------------------------------------------------------------------
# Per-instance facts of the harness build
# --------------------------------------------------------------------------------------------


def build_reports(source: Path) -> list[Report]:
    """Every [[host_name]] instance's static threadgroup arrays against 32 KiB, and its
    [[max_total_threads_per_threadgroup]] where that depends on the template arguments."""
    try:
        limits, orphans = harness.compile_source(source).limits
    except harness.MslCompileError as e:
        return [Report(display_path(source), 1, "compile", "", str(e).strip()[-2000:])]
    _, kernels, instances = _text_pass(str(source), source.read_text())
    reports = []
    for host, lim in sorted(limits.items()):
        k = kernels.get(instances.get(host, ""))
        dependent = k is not None and k.declares_max and k.max_threads is None
        if dependent and lim.max_threads is not None and lim.max_threads > MAX_THREADS:
            reports.append(
                Report(
                    k.file,
                    k.line,
                    "threads-per-threadgroup",
                    host,
                    f"[[max_total_threads_per_threadgroup]] is {lim.max_threads} (> 1024)",
                )
            )
    for host, lim in sorted(limits.items()):
        if lim.static_threadgroup_bytes > THREADGROUP_MEMORY:
            first = min(lim.arrays, key=lambda a: a.line)
            arrays = ", ".join(f"{a.name} {a.size}" for a in lim.arrays)
            reports.append(
                Report(
                    display_path(first.file),
                    first.line,
                    "threadgroup-memory",
                    host,
                    f"static threadgroup arrays take {lim.static_threadgroup_bytes} bytes "
                    f"(> {THREADGROUP_MEMORY}): {arrays}",
                )
            )
    for a, function in orphans:
        reports.append(
            Report(
                display_path(a.file),
                a.line,
                "threadgroup-memory",
                function.split("(")[0],
                f"threadgroup array {a.name} declared outside a kernel function: no kernel "
                "instance's total includes it (declare threadgroup arrays in the kernel body)",
            )
        )
    return reports


# --------------------------------------------------------------------------------------------
# API and CLI
# --------------------------------------------------------------------------------------------


def lint(source: Path | str, *, build: bool = True) -> list[Report]:
    """Every Apple rule over one .metal file (build=False: without the harness build, so without
    the threadgroup-memory rule)."""
    source = Path(source).resolve()
    text = source.read_text()
    reports = set(_text_pass(str(source), text)[0]) | set(apple_ast.analyse(source).reports)
    if build:
        reports |= set(build_reports(source))
    return sorted(reports)


def facts(source: Path | str) -> dict[str, InstanceFacts]:
    """Per [[host_name]] instance: the thread limit and simdgroup use its launches must respect
    (builds the source through the harness only for a template-dependent declared maximum)."""
    source = Path(source).resolve()
    _, kernels, instances = _text_pass(str(source), source.read_text())
    simd = apple_ast.analyse(source).uses_simdgroup
    out = {}
    for host, fn in instances.items():
        k = kernels[fn]
        n = k.max_threads
        if k.declares_max and n is None:
            n = harness.compile_source(source).limits[0][host].max_threads
        out[host] = InstanceFacts(fn, min(MAX_THREADS, n or MAX_THREADS), simd.get(fn, False))
    return out


def kernel_sources(root: Path | None = None) -> list[Path]:
    return sorted((root or harness.KERNEL_DIR).rglob("*.metal"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.msl.apple_rules", description=__doc__)
    ap.add_argument("files", nargs="*", type=Path, help="default: metal_kernels/**/*.metal")
    ap.add_argument("--no-build", action="store_true", help="skip the threadgroup-memory rule")
    ap.add_argument("--rules", action="store_true", help="list the rules and exit")
    args = ap.parse_args(argv)
    if args.rules:
        for name, text in RULES.items():
            print(f"{name:24} {text}")
        return 0
    files = args.files or kernel_sources()
    reports = [r for f in files for r in lint(f, build=not args.no_build)]
    for r in reports:
        print(r)
    print(f"{len(files)} file(s), {len(reports)} violation(s) of Apple's rules", file=sys.stderr)
    return 1 if reports else 0


if __name__ == "__main__":
    sys.exit(main())
