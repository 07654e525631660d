"""Proves the main run, the kernel and profile suites and the decode-round suites run end to end
(`python -m bench.run SUITE --quick`, engines for real on tiny models) and write their results:
one `slow` test per suite on its own engine, and a `full` test per suite with peers
(`--quick --peers`) for what only a comparison shows: the backends agree, every case ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_MEASURED = "not measured"


def assert_round_cases(data: dict, cases: list[dict]) -> None:
    """A decode-round suite's results hold every case, each with positive rates over the
    rounds its settings asked for."""
    assert set(data["cases"]) == {c["name"] for c in cases}
    for name, case in data["cases"].items():
        assert case["decode_tok_s"] > 0 and case["output_tok_s"] > 0, name
        assert case["rounds"] == data["settings"][f"c{case['streams']}_rounds"], name


def test_every_suite_has_its_quick_test() -> None:
    """Every suite `bench.run` lists is run in CI by a `test_<suite>_quick` of the
    `test_suites*.py` modules."""
    from bench.run import SUITES

    here = Path(__file__).parent
    text = "".join(p.read_text() for p in sorted(here.glob("test_suites*.py")))
    for suite in SUITES:
        assert f"def test_{suite.name}_quick(run_suite)" in text, suite.name


@pytest.mark.slow
def test_quick_all_records_every_suite(tmp_path: Path) -> None:
    """`--quick --all` (here on the one suite that starts no engine) records each suite's status
    and says how many passed."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.run", "--quick", "--all", "--suites", "blas_matmul",
           "--out", str(out), "--work-dir", str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    record = json.loads((out / "quick-all.json").read_text())
    assert set(record["suites"]) == {"blas_matmul"}
    assert record["suites"]["blas_matmul"]["status"] == "ok", proc.stderr[-2000:]
    assert proc.returncode == 0 and "1/1 suites ok" in proc.stderr


@pytest.mark.slow
def test_attention_quick(run_suite) -> None:
    run = run_suite("attention")
    data = run.results("attention_decode")
    checked = [cell for cell in data["cells"] if "max_abs_diff" in cell]
    assert checked, "no cell was checked against the baselines"
    for cell in data["cells"]:
        assert cell["native_ms"] > 0, cell
    for cell in checked:
        assert cell["speedup"] > 0 and cell["max_abs_diff"] < 1e-3, cell
    run.report("attention_decode")


@pytest.mark.slow
def test_profile_quick(run_suite) -> None:
    data = run_suite("profile").results()
    workloads = data["results"]["workloads"]
    assert [r["batch"] for r in workloads] == data["batch_sizes"]
    for r in workloads:
        assert r["steps"] > 0 and r["unprofiled_ms_per_step"] > 0, r
        assert r["phases"] and all(p["ms_per_step"] >= 0 for p in r["phases"]), r


@pytest.mark.slow
def test_sliding_window_blocks_quick(run_suite) -> None:
    hybrid, single = run_suite("sliding_window_blocks").results()["rows"]
    assert hybrid["kv_cache_groups"] == 2 and single["kv_cache_groups"] == 1
    assert 0 < hybrid["decode_kib"] < single["decode_kib"]
    assert hybrid["tokens"] == single["tokens"]


@pytest.mark.slow
def test_blas_matmul_quick(run_suite) -> None:
    data = run_suite("blas_matmul").results()
    assert "reference" in data["results"]
    for label, r in data["results"].items():
        assert all(ms > 0 for ms in r["ms"].values()), label


# ------------------------------------------------------------------------ decode-round suites


@pytest.mark.slow
@pytest.mark.full
def test_moe_quick(run_suite) -> None:
    from bench.suites.moe import STREAMS, cases

    run = run_suite("moe")
    data = run.results()
    assert_round_cases(data, [c for c in cases() if c["backend"] == "plugin"])
    assert set(data["workers"]) == {"plugin"}
    assert data["workers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["summary"]["ratios"] == {f"c{n}_plugin_vs_cpu": None for n in STREAMS}
    assert set(data["summary"][f"c{max(STREAMS)}_vs_c1"]) == {"plugin"}
    assert data["agreement"] is None and data["summary"]["agreement_passed"] is None
    model = data["model"]
    assert model["architecture"] == "Qwen3MoeForCausalLM"
    assert model["active_parameters_per_token"] < model["num_parameters"]
    text = run.report("moe", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases",
                              "## Workers"))  # fmt: skip
    assert "Measured on" in text and "Quick run" in text and NOT_MEASURED in text.lower()


@pytest.mark.slow
@pytest.mark.full
def test_moe_with_peers(run_suite) -> None:
    from bench.suites.moe import BACKENDS, STREAMS, cases

    run = run_suite("moe", peers=True)
    data = run.results()
    assert_round_cases(data, cases())
    assert data["workers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["workers"]["cpu"]["platform"] == "CpuPlatform"
    assert set(data["summary"]["ratios"]) == {f"c{n}_plugin_vs_cpu" for n in STREAMS}
    assert all(r > 0 for r in data["summary"]["ratios"].values())
    assert set(data["summary"][f"c{max(STREAMS)}_vs_c1"]) == set(BACKENDS)
    check = data["agreement"]
    assert check["passed"] and check["requests"] == max(STREAMS)
    assert check["distinct_continuations"] > 1
    text = run.report("moe", ("## Plugin / vLLM CPU (same run)", "## Agreement"))
    assert "Measured on" in text and "Quick run" in text and NOT_MEASURED not in text


@pytest.mark.slow
@pytest.mark.full
def test_hybrid_quick(run_suite) -> None:
    run = run_suite("hybrid")
    data = run.results()
    assert set(data["families"]) == {"deepseek_v3"}
    f = data["families"]["deepseek_v3"]
    assert {c["backend"] for c in f["cases"].values()} == {"plugin"}
    for name, case in f["cases"].items():
        assert case["decode_tok_s"] > 0 and case["output_tok_s"] > 0, name
    assert f["workers"]["plugin"]["platform"] == "MetalPlatform"
    (idle,) = f["idle_memory"]
    assert idle["backend"] == "plugin" and idle["idle_rss_bytes"] > 0
    assert data["summary"]["deepseek_v3"]["ratios"] == {"c1_plugin_vs_cpu": None,
                                                       "c16_plugin_vs_cpu": None}  # fmt: skip
    assert NOT_MEASURED in run.report("hybrid").lower()


@pytest.mark.slow
@pytest.mark.full
def test_hybrid_with_peers(run_suite) -> None:
    from bench.suites.hybrid import BACKENDS, FAMILIES

    run = run_suite("hybrid", peers=True)
    data = run.results()
    assert set(data["families"]) == set(FAMILIES)
    for family, f in data["families"].items():
        assert {c["backend"] for c in f["cases"].values()} == set(BACKENDS[family]), family
        for name, case in f["cases"].items():
            assert case["decode_tok_s"] > 0 and case["output_tok_s"] > 0, (family, name)
        assert f["workers"]["plugin"]["platform"] == "MetalPlatform", family
    assert len(data["families"]["deepseek_v3"]["idle_memory"]) == 2  # two KV cache sizes
    run.report("hybrid")


@pytest.mark.slow
@pytest.mark.full
def test_torch_backend_quick(run_suite) -> None:
    from bench.suites.torch_backend import STREAMS, cases

    run = run_suite("torch_backend")
    data = run.results("torch-backend")
    assert_round_cases(data, [c for c in cases() if c["backend"] == "torch"])
    assert {be: w["platform"] for be, w in data["workers"].items()} == {"torch": "MetalPlatform"}
    assert all(v is None for v in data["summary"]["ratios"].values())
    assert data["summary"]["failed"] == [] and data["summary"]["concurrency_ok"]
    assert data["engine"]["max_num_seqs"] == max(STREAMS)
    assert data["agreement"]["engines"] == ["torch"] and data["agreement"]["pairs"] == {}
    text = run.report("torch-backend", ("## Decode throughput (same run)", "## Agreement",
                                        "## Cases", "## Engines"))  # fmt: skip
    assert "Measured on" in text and "Quick run" in text and NOT_MEASURED in text.lower()


@pytest.mark.slow
@pytest.mark.full
def test_torch_backend_with_peers(run_suite) -> None:
    from bench.suites.torch_backend import BACKENDS, STREAMS, cases

    run = run_suite("torch_backend", peers=True)
    data = run.results("torch-backend")
    assert_round_cases(data, cases())
    platforms = {be: w["platform"] for be, w in data["workers"].items()}
    assert platforms == {"torch": "MetalPlatform", "cpu": "CpuPlatform", "mlx": "MetalPlatform"}
    assert all(v is not None for v in data["summary"]["ratios"].values())
    assert data["summary"]["failed"] == [] and data["summary"]["concurrency_ok"]
    a = data["agreement"]
    assert a["engines"] == list(BACKENDS) and a["requests"] == max(STREAMS)
    for pair, check in a["pairs"].items():
        assert check["passed"], pair
    assert min(a["distinct_continuations"].values()) > 1
    text = run.report("torch-backend", ("## Decode throughput (same run)", "## Agreement"))
    assert "Measured on" in text and "Quick run" in text


@pytest.mark.slow
@pytest.mark.full
def test_gguf_quick(run_suite) -> None:
    run = run_suite("gguf")
    data = run.results()
    assert set(data["engine"]) == set(data["layers"]) == {"gguf_q4_0"}
    assert data["engine"]["gguf_q4_0"]["decode_tok_s"] > 0
    assert data["layers"]["gguf_q4_0"]["decode_tok_s"] > 0
    assert data["layers"]["gguf_q4_0"]["quantized_layers"] > 0
    assert data["summary"]["engine_vs_mlx_q4_g64"] == {"gguf_q4_0": None}
    assert NOT_MEASURED in run.report().lower()


@pytest.mark.slow
@pytest.mark.full
def test_gguf_with_peers(run_suite) -> None:
    from bench.suites.gguf import CASES

    run = run_suite("gguf", peers=True)
    data = run.results()
    assert set(data["engine"]) == set(CASES) and set(data["layers"]) == set(CASES)
    for case in CASES:
        assert data["engine"][case]["decode_tok_s"] > 0, case
        assert data["layers"][case]["decode_tok_s"] > 0, case
    assert data["summary"]["engine_vs_mlx_q4_g64"]["mlx_q4_g64"] == 1.0
    run.report()


@pytest.mark.slow
def test_gpu_proxy_quick(run_suite) -> None:
    """The GPU-proxy suite runs the plugin with its step phases and a profile (here on MLX's CPU
    device: the harness, not the proxy) and reports ratios with the proxy's caveat."""
    run = run_suite("gpu_proxy")
    data = run.results("gpu_proxy")
    plugin = data["engines"]["plugin"]
    assert plugin["status"] == "ok" and data["summary"]["failed"] == []
    assert list(plugin["cases"]) == [str(n) for n in data["settings"]["streams"]]
    for case in plugin["cases"].values():
        assert case["decode_tok_s"] > 0 and case["phases"]["steps"] > 0
        assert case["phases"]["step_ms"] >= case["phases"]["graph_build_ms"] > 0
        # Its decode steps are told apart by kind: under async scheduling each takes the
        # tokens of the step before on the device (built one ahead).
        kinds = case["phases"]["kinds"]
        assert kinds and all(k["steps"] > 0 and k["ms"] > 0 for k in kinds.values()), kinds
        assert any(kind.startswith("decode, carried in") for kind in kinds), kinds
    assert "execute_model" in plugin["profiles"]["1"]  # the profile is of the engine's steps
    attention = data["attention"]
    assert attention["status"] == "ok", attention
    for case in attention["cases"].values():
        assert case["paged_ms"] > 0 and case["contiguous_ms"] > 0
    text = run.report(
        "gpu_proxy",
        ("## Decode tok/s (same run)", "## A plugin step", "## A decode step's attention alone"),
    )
    assert "say nothing about the plugin's speed on an Apple GPU" in text  # CPU here


@pytest.mark.slow
@pytest.mark.full
def test_gpu_proxy_quick_hybrid_family(run_suite) -> None:
    """`--family`: a hybrid suite's model (Granite 4.0-H's Mamba-2 layers) in two trees, eager
    and compiled: the compiled tree's decode steps run compiled, the eager one's do not, and no
    attention-alone case is run (it takes the Qwen3 shape's layers)."""
    trees = ("--tree", "eager=.,VLLM_METAL_COMPILE=0", "--tree", "compiled=.,VLLM_METAL_COMPILE=1")
    run = run_suite("gpu_proxy", False, "--family", "granite", *trees)
    data = run.results("gpu_proxy")
    assert data["settings"]["family"] == "granite" and "attention" not in data
    for name in ("eager", "compiled"):
        engine = data["engines"][name]
        assert engine["status"] == "ok", engine
        kinds = [k for case in engine["cases"].values() for k in case["phases"]["kinds"]]
        assert any(k.startswith("decode") for k in kinds), kinds
        assert any("compiled" in k for k in kinds) == (name == "compiled"), (name, kinds)
    assert "granite" in run.report("gpu_proxy", ("## Decode tok/s (same run)",))


@pytest.mark.slow
@pytest.mark.full
def test_gpu_proxy_quick_qwen3_5_against_mlx_lm(run_suite) -> None:
    """The text-only Qwen3.5 checkpoint, whose model type mlx-lm knows only as its wrapper's, runs
    in stock mlx-lm beside the plugin, and the report gives the ratio; sampled, the plugin's
    requests seeded, and a kernel profile asked for (which MLX's CPU device skips, saying so)."""
    run = run_suite(
        "gpu_proxy", True, "--family", "qwen3_5", "--streams", "1,2",
        "--sampled", "--seeded", "--kernel-streams", "1",
    )  # fmt: skip
    data = run.results("gpu_proxy")
    assert data["settings"]["seeded"] and data["settings"]["sampling"]["top_k"] == 50
    for name in ("mlx_lm", "plugin"):
        engine = data["engines"][name]
        assert engine["status"] == "ok", engine
        assert all(case["decode_tok_s"] > 0 for case in engine["cases"].values()), engine
        assert "CUDA" in engine["kernels"]["1"]["skipped"], engine["kernels"]
    assert set(data["summary"]["vs_mlx_lm"]["plugin"]) == {"1", "2"}, data["summary"]
