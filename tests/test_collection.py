"""Proves pytest can collect every test module in one run: modules in folders without an
`__init__.py` are imported under their file name alone (pytest's default import mode), so two
such files with one name collide and the second fails to collect ("import file mismatch") —
in a whole-tree run only, never when one folder runs alone."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_modules_outside_packages_have_distinct_names():
    by_name: dict[str, list[Path]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            by_name[path.name].append(path.relative_to(TESTS))
    clashes = {name: sorted(map(str, paths)) for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, clashes
