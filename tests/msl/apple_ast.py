"""The C++-AST half of the Apple-rules lint (apple_rules.py). libclang parses the mapped source the
harness compiles (same stand-in headers, same macros); only what is located in kernel code counts:
the .metal file, the files of its kernel tree (metal_kernels/, or a fixture's own directory) and
the shared headers of csrc/ that Metal compiles with it. The stand-in headers and the system headers
are not checked."""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import clang.cindex as ci

from . import harness
from .translate import _matching, map_source

CK = ci.CursorKind
TK = ci.TypeKind

SIMD_WIDTH = 32


def _kinds(names: str) -> set[ci.CursorKind]:
    return {getattr(CK, n) for n in names.split()}


FUNCTION_KINDS = _kinds(
    "FUNCTION_DECL FUNCTION_TEMPLATE CXX_METHOD CONSTRUCTOR DESTRUCTOR CONVERSION_FUNCTION"
)
RECORD_KINDS = _kinds(
    "STRUCT_DECL CLASS_DECL UNION_DECL CLASS_TEMPLATE CLASS_TEMPLATE_PARTIAL_SPECIALIZATION"
)
CASTS = _kinds(
    "CSTYLE_CAST_EXPR CXX_FUNCTIONAL_CAST_EXPR CXX_STATIC_CAST_EXPR CXX_REINTERPRET_CAST_EXPR "
    "CXX_CONST_CAST_EXPR"
)
# Kinds reported by their mere presence.
FORBIDDEN = {
    CK.CXX_THROW_EXPR: ("exceptions", "throw expression"),
    CK.CXX_TRY_STMT: ("exceptions", "try block"),
    CK.CXX_CATCH_STMT: ("exceptions", "catch handler"),
    CK.CXX_NEW_EXPR: ("dynamic-allocation", "new expression"),
    CK.CXX_DELETE_EXPR: ("dynamic-allocation", "delete expression"),
    CK.CXX_TYPEID_EXPR: ("rtti", "typeid"),
    CK.CXX_DYNAMIC_CAST_EXPR: ("rtti", "dynamic_cast"),
    CK.GOTO_STMT: ("goto", "goto statement"),
    CK.INDIRECT_GOTO_STMT: ("goto", "computed goto"),
}
ALLOCATORS = {"malloc", "calloc", "realloc", "free", "aligned_alloc", "posix_memalign"}
# Simdgroup-scope functions of the Metal library (collectives, simdgroup barriers and matrices).
SIMDGROUP_CALL = re.compile(r"^(simd_|simdgroup_|quad_)")
# Lane/mask/delta argument: its position and the group width it must stay below.
_SHUFFLES = "shuffle shuffle_xor shuffle_down shuffle_up shuffle_rotate_down shuffle_rotate_up"
LANE_ARGUMENTS = {
    **{f"simd_{f}": (1, SIMD_WIDTH) for f in [*_SHUFFLES.split(), "broadcast"]},
    **{f"simd_shuffle_and_fill_{d}": (2, SIMD_WIDTH) for d in ("down", "up")},
    **{f"quad_{f}": (1, 4) for f in ("shuffle", "shuffle_xor", "broadcast")},
}
# A named constant that states the SIMD width (VM_SIMD_WIDTH, kSimdSize, WARP_SIZE, ...).
SIMD_WIDTH_NAME = re.compile(
    r"(?i)((simd(group)?|warp|wave)_?(width|size|lanes)|threads_per_simd(group)?|execution_width)$"
)


@dataclass(frozen=True, order=True)
class Report:
    """One violation: where, which rule, in which kernel/function, and what."""

    file: str
    line: int
    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.where}: {self.message}"


def display_path(path: str | Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(harness.REPO_ROOT)) if p.is_relative_to(harness.REPO_ROOT) else str(p)


@dataclass
class _Function:
    name: str
    file: str
    line: int
    calls: list[tuple[object, int]] = field(default_factory=list)  # (definition key | name, line)
    simdgroup_calls: set[str] = field(default_factory=set)


@dataclass
class AstResult:
    reports: list[Report]
    # kernel-code function name -> whether it (or what it calls) uses simdgroup functions
    uses_simdgroup: dict[str, bool]


@functools.cache
def _gcc_include() -> str:
    r = subprocess.run(
        [harness.CXX, "-print-file-name=include"], capture_output=True, text=True, check=True
    )
    return r.stdout.strip()


def _for_clang(text: str) -> str:
    """Blank (keeping lines and columns) the attribute lists of explicit instantiations, which g++
    accepts with a warning and clang rejects."""
    out = list(text)

    def blank(start: int, end: int) -> None:
        for i in range(start, end):
            if out[i] != "\n":
                out[i] = " "

    for m in re.finditer(r"\[\[\s*host_name\s*\(", text):
        blank(m.start(), text.index("]]", _matching(text, m.end() - 1, "(", ")")) + 2)
    text = "".join(out)
    for m in re.finditer(r"\btemplate(\s*)\[\[\s*kernel\s*\]\]", text):
        blank(m.start(1), m.end())
    return "".join(out)


def kernel_roots(source: Path) -> tuple[Path, ...]:
    root = harness.KERNEL_DIR if source.is_relative_to(harness.KERNEL_DIR) else source.parent
    return (root.resolve(), harness.SHARED_INCLUDE_DIR.resolve())


def _int_literal(c: ci.Cursor) -> int | None:
    """Value of an integer literal, seen through implicit conversions, parentheses and casts."""
    while c.kind != CK.INTEGER_LITERAL:
        inner = [x for x in c.get_children() if x.kind != CK.TYPE_REF]
        if c.kind not in CASTS | {CK.UNEXPOSED_EXPR, CK.PAREN_EXPR} or len(inner) != 1:
            return None
        c = inner[0]
    tokens = [t.spelling for t in c.get_tokens()]
    return _int_token(tokens[0]) if tokens else None


def _int_token(spelling: str) -> int | None:
    try:
        return int(spelling.rstrip("uUlL"), 0)
    except ValueError:
        return None


def _kind(t: ci.Type) -> ci.TypeKind | None:
    """t.kind, or None for kinds these Python bindings do not name (e.g. _Float16, our half)."""
    try:
        return t.kind
    except ValueError:
        return None


def _through(t: ci.Type) -> ci.Type:
    """The type behind references and arrays."""
    while True:
        if _kind(t) in (TK.LVALUEREFERENCE, TK.RVALUEREFERENCE):
            t = t.get_pointee()
        elif _kind(t) in (TK.CONSTANTARRAY, TK.INCOMPLETEARRAY, TK.VARIABLEARRAY):
            t = t.element_type
        else:
            return t


def _is_function_pointer(t: ci.Type) -> bool:
    t = _through(t.get_canonical())
    if _kind(t) == TK.MEMBERPOINTER:
        return True
    while _kind(t) == TK.POINTER:
        t = t.get_pointee()
        if _kind(t) in (TK.FUNCTIONPROTO, TK.FUNCTIONNOPROTO):
            return True
    return False


def _mentions_double(t: ci.Type) -> bool:
    return bool(re.search(r"\bdouble\b", t.get_canonical().spelling))


def _deduced(t: ci.Type) -> bool:
    while _kind(t) in (TK.LVALUEREFERENCE, TK.RVALUEREFERENCE, TK.POINTER):
        t = t.get_pointee()
    return _kind(t) == TK.AUTO


class _Checker:
    def __init__(self, source: Path) -> None:
        self.source = source
        self.roots = kernel_roots(source)
        self.reports: set[Report] = set()
        self.functions: dict[tuple, _Function] = {}
        self._kernel_file: dict[str, bool] = {}

    # -- helpers ---------------------------------------------------------------------------
    def in_kernel_code(self, c: ci.Cursor) -> bool:
        name = c.location.file.name if c.location.file else None
        if name not in self._kernel_file:
            p = Path(name or "/").resolve()
            self._kernel_file[name] = name is not None and any(
                p == self.source or p.is_relative_to(r) for r in self.roots
            )
        return self._kernel_file[name]

    def report(self, c: ci.Cursor, rule: str, fn: _Function | None, message: str) -> None:
        where = fn.name if fn else "program scope"
        self.reports.add(
            Report(display_path(c.location.file.name), c.location.line, rule, where, message)
        )

    @staticmethod
    def key(c: ci.Cursor) -> tuple:
        d = c.get_definition() or c
        return (str(d.location.file), d.location.line, d.location.column, d.spelling)

    @staticmethod
    def qualified(c: ci.Cursor) -> str:
        parent = c.semantic_parent
        if parent is not None and parent.kind in RECORD_KINDS:
            return f"{parent.spelling}::{c.spelling}"
        return c.spelling

    # -- traversal -------------------------------------------------------------------------
    def visit(self, c: ci.Cursor, fn: _Function | None, callee_position: bool = False) -> None:
        k = c.kind
        if k in FUNCTION_KINDS and c.is_definition():
            fn = _Function(self.qualified(c), display_path(c.location.file.name), c.location.line)
            self.functions[self.key(c)] = fn
            self.check_function(c, fn)
        elif k in FORBIDDEN:
            rule, what = FORBIDDEN[k]
            self.report(c, rule, fn, what)
        elif k == CK.VAR_DECL:
            self.check_variable(c, fn)
        elif k in (CK.PARM_DECL, CK.FIELD_DECL):
            self.check_declared_type(c, c.type, fn)
        elif k in (CK.TYPEDEF_DECL, CK.TYPE_ALIAS_DECL):
            self.check_declared_type(c, c.underlying_typedef_type, fn)
        elif k in CASTS and _mentions_double(c.type):
            self.report(c, "double", fn, f"cast to {c.type.spelling}")
        elif k == CK.CXX_BASE_SPECIFIER and any(t.spelling == "virtual" for t in c.get_tokens()):
            self.report(c, "virtual-function", fn, f"virtual base {c.type.spelling}")
        elif k == CK.MACRO_DEFINITION:
            self.check_simd_constant(c, [t.spelling for t in c.get_tokens()][1:], fn)
        elif k == CK.CALL_EXPR and fn is not None:
            self.check_call(c, fn)
        taken = None if callee_position else _function_address_taken(c)
        if taken:
            self.report(c, "function-pointer", fn, f"address of function {taken} taken")
        called = c.referenced if k == CK.CALL_EXPR else None
        for i, child in enumerate(c.get_children()):
            # libclang lists an operator call's operands in source order, around the callee
            ref = child.referenced if called is not None else None
            callee = k == CK.CALL_EXPR and (i == 0 or (ref is not None and ref == called))
            self.visit(child, fn, callee_position=callee)

    # -- rules -----------------------------------------------------------------------------
    def check_function(self, c: ci.Cursor, fn: _Function) -> None:
        if c.kind in (CK.CXX_METHOD, CK.DESTRUCTOR) and c.is_virtual_method():
            self.report(c, "virtual-function", fn, "virtual member function")
        if c.kind != CK.FUNCTION_TEMPLATE and _mentions_double(c.result_type):
            self.report(c, "double", fn, f"returns {c.result_type.spelling}")

    def check_declared_type(self, c: ci.Cursor, t: ci.Type, fn: _Function | None) -> None:
        what = f"{c.spelling or 'unnamed'} of type {t.spelling}"
        if _is_function_pointer(t):
            self.report(c, "function-pointer", fn, what)
        if not _deduced(t) and _mentions_double(t):
            self.report(c, "double", fn, what)

    def check_variable(self, c: ci.Cursor, fn: _Function | None) -> None:
        t = c.type
        self.check_declared_type(c, t, fn)
        if _kind(t) == TK.VARIABLEARRAY:
            self.report(c, "variable-length-array", fn, f"{c.spelling} of type {t.spelling}")
        if c.tls_kind != ci.TLSKind.NONE:
            self.report(c, "thread-local", fn, f"thread_local variable {c.spelling}")
            return
        parent = c.semantic_parent.kind
        program_scope = parent in (CK.TRANSLATION_UNIT, CK.NAMESPACE) or parent in RECORD_KINDS
        static_local = parent in FUNCTION_KINDS and c.storage_class == ci.StorageClass.STATIC
        writable = not _through(t).is_const_qualified()
        # `constant T x [[function_constant(n)]]` is mapped to a msl::FunctionConstant object.
        function_constant = "msl::FunctionConstant<" in t.get_canonical().spelling
        if (program_scope or static_local) and writable and not function_constant:
            scope = "function-scope static" if static_local else "program-scope variable"
            name = self.qualified(c)
            self.report(
                c, "writable-global", fn, f"{scope} {name} is not in the constant address space"
            )
        self.check_simd_constant(c, None, fn)

    def check_simd_constant(self, c: ci.Cursor, macro_body: list[str] | None, fn) -> None:
        """A macro or variable named like a SIMD width (VM_SIMD_WIDTH, kWarpSize, ...)."""
        if not SIMD_WIDTH_NAME.search(c.spelling):
            return
        if macro_body is not None:
            value = _int_token(macro_body[0]) if len(macro_body) == 1 else None
        else:
            inits = [x for x in c.get_children() if x.kind != CK.TYPE_REF]
            value = _int_literal(inits[-1]) if inits else None
        if value is not None and value != SIMD_WIDTH:
            self.report(
                c, "simd-width", fn, f"{c.spelling} = {value}: Apple GPUs run {SIMD_WIDTH} lanes"
            )

    def check_call(self, c: ci.Cursor, fn: _Function) -> None:
        ref = c.referenced
        children = list(c.get_children())
        if ref is not None and ref.kind in FUNCTION_KINDS:
            name, target = ref.spelling, (self.key(ref) if self.in_kernel_code(ref) else None)
        else:  # a dependent call in a template: by name
            name = _dependent_callee(children)
            if name is None:
                return
            target = name
        fn.calls.append((target, c.location.line))
        library = not isinstance(target, tuple)
        if library and name in ALLOCATORS:
            self.report(c, "dynamic-allocation", fn, f"call to {name}")
        if library and SIMDGROUP_CALL.match(name):
            fn.simdgroup_calls.add(name)
        if library and name in LANE_ARGUMENTS:
            pos, width = LANE_ARGUMENTS[name]
            args = list(c.get_arguments()) or children[1:]
            lane = _int_literal(args[pos]) if len(args) > pos else None
            if lane is not None and lane >= width:
                what = f"{name} lane argument {lane} assumes more than {width} lanes"
                self.report(c, "simd-width", fn, what)

    # -- call graph ------------------------------------------------------------------------
    def edges(self) -> dict[tuple, list[tuple[tuple, int]]]:
        """Calls between kernel-code functions; a dependent call goes to every function of its
        name (an over-approximation among overloads)."""
        by_name: dict[str, list[tuple]] = {}
        for key in self.functions:
            by_name.setdefault(key[3], []).append(key)
        return {
            key: [
                (t, line)
                for target, line in f.calls
                for t in ([target] if isinstance(target, tuple) else by_name.get(target or "", []))
                if t in self.functions
            ]
            for key, f in self.functions.items()
        }

    def check_recursion(self, edges: dict[tuple, list[tuple[tuple, int]]]) -> None:
        for key, f in self.functions.items():
            back = [(t, line) for t, line in edges[key] if key in _reachable(edges, t)]
            if back:
                t, line = min(back, key=lambda e: e[1])
                via = "itself" if t == key else f"{self.functions[t].name}, which calls it back"
                self.reports.add(Report(f.file, line, "recursion", f.name, f"calls {via}"))

    def uses_simdgroup(self, edges: dict[tuple, list[tuple[tuple, int]]]) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for key, f in self.functions.items():
            found = any(self.functions[k].simdgroup_calls for k in _reachable(edges, key) | {key})
            out[f.name] = out.get(f.name, False) or found
        return out


def _reachable(edges: dict[tuple, list[tuple[tuple, int]]], start: tuple) -> set[tuple]:
    """Functions reachable from start (start itself only through a cycle)."""
    seen: set[tuple] = set()
    stack = [start]
    while stack:
        for t, _ in edges[stack.pop()]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return seen


def _function_address_taken(c: ci.Cursor) -> str | None:
    """The function a pointer (or member-function pointer) is formed of here, if any; the caller
    excludes the callee position of calls."""
    if c.kind not in (CK.UNEXPOSED_EXPR, CK.UNARY_OPERATOR) or not _is_function_pointer(c.type):
        return None
    for x in c.get_children():
        ref = x.referenced if x.kind == CK.DECL_REF_EXPR else None
        if ref is not None and ref.kind in FUNCTION_KINDS:
            return ref.spelling
    return None


def _dependent_callee(children: list[ci.Cursor]) -> str | None:
    """Name a dependent call resolves by (None for an overloaded operator's call)."""
    for ch in children:
        if ch.kind == CK.DECL_REF_EXPR and not ch.spelling:
            over = [x.spelling for x in ch.get_children() if x.kind == CK.OVERLOADED_DECL_REF]
            if over and over[0].startswith("operator"):
                return None
    for x in children[0].walk_preorder() if children else []:
        if x.kind in (CK.OVERLOADED_DECL_REF, CK.MEMBER_REF_EXPR, CK.DECL_REF_EXPR) and x.spelling:
            return x.spelling
    return None


def analyse(source: Path) -> AstResult:
    source = Path(source).resolve()
    return _analyse(str(source), source.read_text())


@functools.lru_cache(maxsize=64)
def _analyse(path: str, text: str) -> AstResult:
    source = Path(path)
    mapped = _for_clang(map_source(text, path).split("\n", 1)[1])  # drop #line: real lines
    includes = [harness.INCLUDE_DIR, source.parent, harness.SHARED_INCLUDE_DIR]
    args = ["-x", "c++", "-std=c++20", *harness.PREDEFINED, *(f"-I{p}" for p in includes)]
    args += ["-isystem", _gcc_include()]  # stddef.h & co. (libclang ships no resource headers)
    tu = ci.Index.create().parse(
        path,
        args=args,
        unsaved_files=[(path, mapped)],
        options=ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD,
    )
    checker = _Checker(source)
    for d in tu.diagnostics:
        if d.severity >= ci.Diagnostic.Error:
            file = d.location.file.name if d.location.file else path
            checker.reports.add(
                Report(display_path(file), d.location.line, "parse", "", d.spelling)
            )
    for c in tu.cursor.get_children():
        if checker.in_kernel_code(c):
            checker.visit(c, None)
    edges = checker.edges()
    checker.check_recursion(edges)
    return AstResult(sorted(checker.reports), checker.uses_simdgroup(edges))
