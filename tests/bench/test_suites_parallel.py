"""Proves the parallelism suite runs end to end (`python -m bench.run parallel --quick`): a
data-parallel and a pipeline-parallel `vllm serve` side by side give the same greedy tokens and
write their figures, tables and plot; with `--peers` one process beside them, the same tokens and
every ratio. Both in the full tier (CI's budget: `test_data_parallel.py` and
`test_pipeline_parallel.py` run the two layouts in CI).
"""

from __future__ import annotations

from pathlib import Path

import pytest

NOT_MEASURED = "not measured"
HEADINGS = ("## Ratios (same run)", "## Agreement", "## Cases", "## Servers")


def _phases(data: dict, phases: dict[str, list[str]]) -> None:
    """The run's phases and their servers are `phases`; every case ran its rounds with positive
    figures; every server of a phase gave the greedy tokens of the first, request by request."""
    from bench.suites.parallel import STREAMS

    settings = data["settings"]
    assert {label: p["servers"] for label, p in data["phases"].items()} == phases
    requests = sum(n * settings[f"c{n}_rounds"] for n in STREAMS)
    for label, phase in data["phases"].items():
        names = phase["servers"]
        assert set(phase["cases"]) == {f"c{n}_{name}" for n in STREAMS for name in names}
        for key, case in phase["cases"].items():
            # TPOT may be 0 on the tiny model: a busy API server can stream all 8 at once.
            assert case["median_tpot_ms"] >= 0 and case["median_ttft_ms"] > 0, (label, key)
            assert case["output_tok_s"] > 0, (label, key)
            assert case["rounds"] == settings[f"c{case['streams']}_rounds"], (label, key)
        check = phase["agreement"]
        assert check["reference"] == names[0] and sorted(check["servers"]) == sorted(names[1:])
        assert check["requests"] == requests
        # The tiny model has no near-ties: every request's tokens are identical.
        for name, s in check["servers"].items():
            assert s["identical"] == requests, (label, name, s)
            assert s["common_prefix_tokens"] == [settings["output_len"]] * requests
        assert check["passed"], (label, check)
    for name in {n for p in phases.values() for n in p}:
        server = data["servers"][name]
        assert server["platform"] == "MetalPlatform", name
        assert server["resident_bytes"] > 0, name
    assert data["summary"]["agreement_passed"]


@pytest.mark.slow
@pytest.mark.full
def test_parallel_quick(run_suite) -> None:
    run = run_suite("parallel")
    data = run.results()
    _phases(data, {"dp2+pp2": ["dp2", "pp2"]})
    # Two replicas and two stages did start: vLLM's logs name the DP ranks and PP stages.
    dp_log = Path(data["servers"]["dp2"]["log"]).read_text()
    assert "EngineCore_DP1" in dp_log, dp_log[-3000:]
    pp_log = Path(data["servers"]["pp2"]["log"]).read_text()
    assert "world_size=2 rank=1" in pp_log, pp_log[-3000:]
    assert all(v is None for v in data["summary"]["ratios"].values())
    text = run.report("parallel", HEADINGS)
    assert "Quick run" in text and NOT_MEASURED in text


@pytest.mark.slow
@pytest.mark.full
def test_parallel_with_peers(run_suite) -> None:
    run = run_suite("parallel", peers=True)
    data = run.results()
    _phases(data, {"dp2": ["one", "dp2"], "pp2": ["one", "pp2"]})
    ratios = data["summary"]["ratios"]
    for name in ("dp2", "pp2"):
        for metric in ("output_tok_s_c8", "tpot_c8"):
            assert ratios[f"{name}_vs_one_{metric}"] > 0, (name, metric)
    assert ratios["dp2_1thread_vs_one_output_tok_s_c8"] is None  # not in --quick --peers
    assert data["summary"]["pp2_added_tpot_ms_c1"] is not None
    run.report("parallel", HEADINGS)
