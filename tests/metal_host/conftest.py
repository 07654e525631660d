"""The metal_host check parses with libclang and borrows GCC's builtin headers, on Linux (a Mac
compiles these sources for real); elsewhere, or without either tool, its tests are skipped."""

from __future__ import annotations

import platform

import pytest

from . import check


def _unsupported_reason() -> str | None:
    if platform.system() != "Linux":
        return f"the metal_host check runs on Linux (this is {platform.system()})"
    try:
        check.require_tools()
    except check.SetupError as e:
        return str(e)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _unsupported_reason()
    if reason is None:
        return
    for item in items:
        if "metal_host" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
