"""docs/architecture.md stays true to the tree: every source file of the package and the native
layer appears in one of its tree diagrams, and every path a diagram names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
ROOTS = ("vllm_metal/", "csrc/", "metal_kernels/")
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".metal"}
OPTIONAL = {"__init__.py"}


def _tree_paths() -> set[str]:
    """Paths named by the code blocks of the doc that are trees rooted at a source directory."""
    paths: set[str] = set()
    for block in re.findall(r"```\n(.*?)```", DOC.read_text(), flags=re.DOTALL):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or lines[0].strip() not in ROOTS and not lines[0].startswith(ROOTS):
            continue
        stack: list[tuple[int, str]] = [(-1, lines[0].split()[0].rstrip("/"))]
        for line in lines[1:]:
            indent = len(line) - len(line.lstrip())
            name = line.split()[0]
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = f"{stack[-1][1]}/{name.rstrip('/')}"
            paths.add(path)
            if name.endswith("/"):
                stack.append((indent, path))
        paths.add(stack[0][1] if stack else lines[0].rstrip("/"))
    return paths


def _source_files() -> set[str]:
    files = set()
    for root in ROOTS:
        for path in (ROOT / root).rglob("*"):
            if (
                path.is_file()
                and path.suffix in SOURCE_SUFFIXES
                and "__pycache__" not in path.parts
                and path.name not in OPTIONAL
            ):
                files.add(str(path.relative_to(ROOT)))
    return files


def test_every_source_file_is_in_the_architecture_tree():
    named = _tree_paths()
    missing = sorted(f for f in _source_files() if f not in named)
    assert not missing, f"docs/architecture.md does not show: {missing}"


def test_every_path_the_tree_names_exists():
    stale = sorted(p for p in _tree_paths() if not (ROOT / p).exists())
    assert not stale, f"docs/architecture.md names paths that do not exist: {stale}"
