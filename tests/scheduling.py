"""How the suite is spread over pytest-xdist workers (`pytest -n 2`, what CI runs).

Most of an engine test's time is single-threaded Python (imports, engine start, scheduling a step of a
tiny model), so two workers on two cores finish the suite in a bit over half the time. Work units
keep expensive fixtures in one process: every test of one module runs on one worker (module-scoped
engines start once), and every `tests/serving` test runs on one worker (one `vllm serve` slot per
session, ordered by `tests/serving/conftest.py`); the benchmark suites' smoke tests are spread one
by one.
"""

from __future__ import annotations

import pytest

SERVING = "tests/serving"
# Modules whose tests are independent units (each starts its own processes), spread over both
# workers: one benchmark suite's --quick run a test.
PER_TEST = ("tests/bench/test_suites",)


def work_unit(nodeid: str) -> str:
    """The unit a test is scheduled with: the serving suite as a whole, a test of `PER_TEST` on
    its own, else its module."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(SERVING + "/"):
        return SERVING
    return nodeid.split("[", 1)[0] if path.startswith(PER_TEST) else path


def order_units(items: list[pytest.Item]) -> None:
    """Longest units first, so the short in-process ones fill the gaps at the end: the serving
    suite, then modules that start engines (`slow`), then the rest; collection order otherwise."""
    units: dict[str, int] = {}
    for item in items:
        unit = work_unit(item.nodeid)
        rank = 0 if unit == SERVING else 1 if item.get_closest_marker("slow") else 2
        units[unit] = min(units.get(unit, rank), rank)
    position = {unit: i for i, unit in enumerate(units)}
    items.sort(key=lambda item: (units[u := work_unit(item.nodeid)], position[u]))


def make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduler with `work_unit` as the scope and collection order kept."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # keep `order_units`' order
    return UnitScheduling(config, log)
