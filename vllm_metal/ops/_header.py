"""Reader of csrc/constants.h, the one statement of the constants the native ops share.

Used when vllm_metal._C is not built, and by the loader for the ops ABI it expects. Wheels carry
the header as vllm_metal/ops/constants.h (setup.py copies it there); a source checkout reads it in
place. The result has the keys and value shapes of ``_C.CONSTANTS``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

HEADER_NAME = "constants.h"
_CANDIDATES = (
    Path(__file__).with_name(HEADER_NAME),
    Path(__file__).resolve().parents[2] / "csrc" / HEADER_NAME,
)

_NUMBER = re.compile(r"#define\s+(VM_\w+)\s+(-?\d+)\s*(?://.*)?$")
_LIST = re.compile(r"#define\s+(VM_\w+)\(X,\s*\.\.\.\)\s+(.*)$")
_CALL = re.compile(r"(\w+)\(([^()]*)\)")


def header_path() -> Path:
    for path in _CANDIDATES:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"vllm-metal's {HEADER_NAME} is missing (looked at {', '.join(map(str, _CANDIDATES))}); "
        "reinstall the package"
    )


def _field(token: str) -> int | str:
    return int(token) if re.fullmatch(r"-?\d+", token) else token


def _expand(name: str, bodies: dict[str, str], seen: tuple[str, ...] = ()) -> list[object]:
    if name in seen:
        raise ValueError(f"{HEADER_NAME}: list {name} refers to itself")
    entries: list[object] = []
    for callee, args in _CALL.findall(bodies[name]):
        if callee != "X":
            entries += _expand(callee, bodies, (*seen, name))
            continue
        fields = [a.strip() for a in args.split(",")]
        if fields and fields[-1] == "__VA_ARGS__":
            fields.pop()
        values = tuple(_field(f) for f in fields)
        entries.append(values[0] if len(values) == 1 else values)
    return entries


def parse(text: str) -> dict[str, object]:
    """The integer macros and X-macro lists of the header, named without ``VM_``; helpers (names
    ending in ``_``) are followed through but not returned."""
    lines = text.replace("\\\n", " ").splitlines()
    found: dict[str, object] = {}
    bodies: dict[str, str] = {}
    for line in lines:
        if m := _NUMBER.match(line):
            found[m[1]] = int(m[2])
        elif m := _LIST.match(line):
            bodies[m[1]] = m[2].split("//")[0]
    for name in bodies:
        found[name] = tuple(_expand(name, bodies))
    return {k.removeprefix("VM_"): v for k, v in found.items() if not k.endswith("_")}


@functools.cache
def header_constants() -> dict[str, object]:
    return parse(header_path().read_text())
