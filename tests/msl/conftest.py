"""The MSL harness needs GCC >= 12 on Linux x86-64 (fiber switch in x86-64 assembly, GCC's
-fsanitize=thread instrumentation hooks); elsewhere its tests are skipped with that reason."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from . import harness


def _unsupported_reason() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"MSL harness runs on Linux x86-64 only (this is {platform.system()} {platform.machine()})"
    if shutil.which(harness.CXX) is None:
        return f"MSL harness needs {harness.CXX} (GCC >= 12)"
    out = subprocess.run([harness.CXX, "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"\(GCC\).*?(\d+)\.\d+|g\+\+.*?(\d+)\.\d+\.\d+", out.stdout)
    if not m or int(m[1] or m[2]) < 12:
        return f"MSL harness needs GCC >= 12, found: {out.stdout.splitlines()[:1]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _unsupported_reason()
    if reason is None:
        return
    for item in items:
        if "msl" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
