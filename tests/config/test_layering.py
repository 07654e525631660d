"""Proves data flows downward around the control plane: nothing below `vllm_metal.config` (kv/,
models/, backends/, ops/) imports it; config reads model kinds from models, never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_metal"
BELOW = ("kv", "models", "backends", "ops")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder", BELOW)
def test_no_module_below_config_imports_it(folder: str) -> None:
    upward = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in _imports(path) if name.startswith("vllm_metal.config")
        )
        for path in (PACKAGE / folder).rglob("*.py")
    }
    assert not {path: names for path, names in upward.items() if names}


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from vllm_metal import config\nfrom vllm_metal.config.table import x\n")
    assert {"vllm_metal.config", "vllm_metal.config.table"} <= _imports(module)
