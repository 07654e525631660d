"""The syntactic half of the MSL harness: map Metal source text to host C++, discover kernels and
their [[host_name]] instances in the preprocessed text, and generate the shim that calls them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# --------------------------------------------------------------------------------------------
# Source mapping: mechanical, line-preserving rewrites of MSL syntax that C++ cannot express.
# --------------------------------------------------------------------------------------------

# `[[threadgroup(n)]]` on a parameter: the `threadgroup` macro would rewrite the attribute name.
_TG_ATTR = re.compile(r"\[\[\s*threadgroup\s*\(")
# `threadgroup T name[N]...;` declares storage shared by the threadgroup (not a pointer/reference).
# It becomes a tg_var call whose last argument, a lambda naming the declaration, has a closure type
# unique to each kernel instantiation: msl.h registers sizeof(T) per instance at program start
# from it (the runner's static threadgroup-memory accounting), whether the declaration runs or not.
_TG_DECL = re.compile(
    r"^(?P<indent>\s*)threadgroup\s+(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\];]+\]\s*)*);",
    re.MULTILINE,
)
# `constant T name [[function_constant(n)]];`
_FC_DECL = re.compile(
    r"^(?P<indent>\s*)constant\s+(?P<type>[\w:<>, ]+?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"\[\[\s*function_constant\s*\(\s*(?P<index>\w+)\s*\)\s*\]\]\s*;",
    re.MULTILINE,
)


def map_source(text: str, origin: str) -> str:
    """Return `text` with the harness's documented syntax mapping applied, line numbers intact."""
    text = _TG_ATTR.sub("[[msl_threadgroup(", text)

    def tg_decl(m: re.Match[str]) -> str:
        t = m["type"].strip()
        dims = re.sub(r"\s+", "", m["dims"])
        return (
            f"{m['indent']}auto& {m['name']} = ::msl::tg_var<{t}{dims}>(__COUNTER__, "
            f'[] {{ return ::msl::rt::TgDecl{{"{m["name"]}", __FILE__, __LINE__}}; }});'
        )

    text = _TG_DECL.sub(tg_decl, text)
    text = _FC_DECL.sub(
        lambda m: (
            f"{m['indent']}static ::msl::FunctionConstant<{m['type'].strip()}, {m['index']}> "
            f"{m['name']};"
        ),
        text,
    )
    return f'#line 1 "{origin}"\n' + text


# --------------------------------------------------------------------------------------------
# Kernel discovery on the preprocessed source
# --------------------------------------------------------------------------------------------

_POSITION_ATTRS = {
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "threads_per_simdgroup",
    "thread_execution_width",
    "dispatch_threads_per_threadgroup",
    "quadgroup_index_in_threadgroup",
    "thread_index_in_quadgroup",
    "quadgroups_per_threadgroup",
    "grid_origin",
}


@dataclass
class Param:
    name: str
    attr: str  # buffer | msl_threadgroup | a position attribute
    index: int | None
    is_pointer: bool


@dataclass
class KernelDef:
    name: str
    params: list[Param]
    # [[max_total_threads_per_threadgroup(N)]]: the expression N as written (macro-expanded)
    max_threads: str | None = None
    offset: int = 0  # of the definition in the text discover() read
    template_params: str | None = None  # "typename T, int B" of a kernel template


@dataclass
class Instance:
    host_name: str
    function: str
    template_args: str | None  # None for a non-template kernel
    offset: int = 0  # of the [[host_name]] (or the kernel definition) in the text discover() read


def _matching(text: str, start: int, open_c: str, close_c: str) -> int:
    """Index just past the bracket matching text[start] (which is open_c)."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == open_c:
            depth += 1
        elif c == close_c:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced {open_c}{close_c} at offset {start}")


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for c in s:
        if c in "(<[{":
            depth += 1
        elif c in ")>]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


_ATTR = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]")
_MAX_THREADS = re.compile(r"\[\[\s*max_total_threads_per_threadgroup\s*\((.*?)\)\s*\]\]")
_KERNEL_FN = re.compile(r"(?:\[\[\s*kernel\s*\]\]|\bkernel)\s+void\s+([A-Za-z_]\w*)\s*\(")
# The name may be adjacent literals ("a" "b"), as a name macro's stringized pieces expand to.
_HOST_NAME = re.compile(r"\[\[\s*host_name\s*\(\s*((?:\"[^\"]*\"\s*)+)\)\s*\]\]")


def _host_name(literals: str) -> str:
    return "".join(re.findall(r'"([^"]*)"', literals))


def _parse_params(plist: str, fn: str) -> list[Param]:
    params = []
    for raw in _split_top(plist):
        attrs = _ATTR.findall(raw)
        decl = _ATTR.sub(" ", raw).strip()
        m = re.search(r"([A-Za-z_]\w*)\s*$", decl)
        if not m or not attrs:
            raise ValueError(f"kernel {fn}: cannot read parameter {raw.strip()!r}")
        attr, idx = attrs[0]
        params.append(
            Param(
                name=m[1],
                attr=attr,
                index=int(idx) if idx else None,
                is_pointer="*" in decl[: m.start()],
            )
        )
    return params


def discover(expanded: str) -> tuple[dict[str, KernelDef], list[Instance]]:
    """Kernel definitions and [[host_name]] instances in macro-expanded MSL text."""
    kernels: dict[str, KernelDef] = {}
    instances: list[Instance] = []
    for m in _KERNEL_FN.finditer(expanded):
        open_at = m.end() - 1
        close_at = _matching(expanded, open_at, "(", ")")
        rest = expanded[close_at:].lstrip()
        if not rest.startswith("{"):
            continue  # an explicit instantiation, handled below
        name = m[1]
        # Declaration head: text since the end of the previous declaration.
        head_start = max(expanded.rfind(";", 0, m.start()), expanded.rfind("}", 0, m.start()))
        head = expanded[head_start + 1 : m.start()]
        max_threads = _MAX_THREADS.search(head)
        template = re.search(r"\btemplate\s*<", head)
        kernels[name] = KernelDef(
            name,
            _parse_params(expanded[open_at + 1 : close_at - 1], name),
            max_threads[1].strip() if max_threads else None,
            m.start(),
            head[template.end() : _matching(head, template.end() - 1, "<", ">") - 1].strip()
            if template
            else None,
        )
        if not template:
            hn = _HOST_NAME.search(head)
            instances.append(Instance(_host_name(hn[1]) if hn else name, name, None, m.start()))
    for m in _HOST_NAME.finditer(expanded):
        before = expanded[max(0, m.start() - 40) : m.start()]
        if not re.search(r"\btemplate\s*$", before):
            continue
        end = m.end()
        depth = 0
        while end < len(expanded):
            c = expanded[end]
            if c in "(<[{":
                depth += 1
            elif c in ")>]}":
                depth -= 1
            elif c == ";" and depth == 0:
                break
            end += 1
        stmt = expanded[m.end() : end]
        found = None
        for k in kernels:
            for km in re.finditer(rf"\b{re.escape(k)}\s*<", stmt):
                lt = km.end() - 1
                gt = _matching(stmt, lt, "<", ">")
                found = (k, stmt[lt + 1 : gt - 1].strip())
        host_name = _host_name(m[1])
        if found is None:
            raise ValueError(
                f"host_name {host_name!r}: no kernel template instantiated in {stmt!r}"
            )
        instances.append(Instance(host_name, found[0], found[1], m.start()))
    names = [i.host_name for i in instances]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate host names: {sorted(dup)}")
    return kernels, instances


def _arg(p: Param) -> str:
    if p.attr not in _POSITION_ATTRS and p.attr not in ("buffer", "msl_threadgroup"):
        raise ValueError(f"parameter {p.name}: unsupported parameter attribute [[{p.attr}]]")
    if p.attr == "buffer":
        cls = "BufferPtr" if p.is_pointer else "BufferRef"
        return f'::msl::{cls}{{::msl::rt::bound_pointer(0, {p.index}, "{p.name}")}}'
    if p.attr == "msl_threadgroup":
        return f'::msl::BufferPtr{{::msl::rt::bound_pointer(1, {p.index}, "{p.name}")}}'
    return f"::msl::position_arg(::msl::rt::Pos::{p.attr})"


def generate_shim(
    mapped_path: Path, kernels: dict[str, KernelDef], instances: list[Instance]
) -> str:
    lines = [
        "// Generated by tests/msl/harness.py: one entry per [[host_name]] instance.",
        f'#include "{mapped_path}"',
        "namespace msl_shim {",
    ]
    table = []
    for k in kernels.values():
        if k.max_threads and k.template_params is not None:  # may depend on template arguments
            lines.append(
                f"template <{k.template_params}> constexpr unsigned max_threads_{k.name}() "
                f"{{ return static_cast<unsigned>({k.max_threads}); }}"
            )
    for i, inst in enumerate(instances):
        k = kernels[inst.function]
        callee = inst.function + (
            f"<{inst.template_args}>" if inst.template_args is not None else ""
        )
        args = ", ".join(_arg(p) for p in k.params)
        lines.append(f"void k{i}() {{ ::{callee}({args}); }}")
        max_threads = "0"
        if k.max_threads:
            max_threads = (
                f"msl_shim::max_threads_{k.name}<{inst.template_args}>()"
                if inst.template_args is not None
                else f"static_cast<unsigned>({k.max_threads})"
            )
        table.append(
            f'  {{"{inst.host_name}", &msl_shim::k{i}, ::msl::function_name<&::{callee}>(), '
            f"{max_threads}}},"
        )
    lines += [
        "}  // namespace msl_shim",
        'extern "C" {',
        "struct msl_kernel_entry {",
        "  const char* name;",
        "  void (*fn)();",
        "  const char* function;  // the instantiated kernel, as msl::function_name spells it",
        "  unsigned max_threads;  // [[max_total_threads_per_threadgroup]], 0 if not declared",
        "};",
        "extern const msl_kernel_entry msl_kernels[];",
        "const msl_kernel_entry msl_kernels[] = {",
        *table,
        "  {nullptr, nullptr, nullptr, 0},",
        "};",
        "}",
    ]
    return "\n".join(lines) + "\n"
