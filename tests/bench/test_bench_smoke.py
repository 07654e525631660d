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


def test_single_stream_figures_are_consistent(bench_out: Path) -> None:
    results = json.loads((bench_out / "results.json").read_text())
    for name in ("mlx_lm", "plugin_offline"):
        (request,) = results[name]["requests"]
        # Exactly output_len tokens: EOS is ignored on both sides, so the decode work matches.
        assert request["output_tokens"] == OUTPUT_LEN, name
        assert 0 < request["ttft_ms"] < 1e3 * request["e2e_s"] + 1, name
        assert request["decode_tok_s"] == pytest.approx(1e3 / request["tpot_ms"]), name
    assert results["plugin_offline"]["platform"] == "MetalPlatform"
    ratio = results["summary"]["targets"]["single_stream_vs_mlx_lm"]["value"]
    want = (
        results["plugin_offline"]["median_decode_tok_s"] / results["mlx_lm"]["median_decode_tok_s"]
    )
    assert ratio == pytest.approx(want)


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
