"""Proves the benchmark harness's pieces that need no engine: stage records, the server helpers'
parsing, report cells, the suite list, and the main run's and torch_backend suite's summaries
and reports from hand-made results."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import servers
from bench.harness.decode_rounds import agreement
from bench.harness.report.format import cases_table, machine_line, num, quick_note
from bench.harness.report.publish import publish, targets_table
from bench.harness.stages import (
    StageLog,
    blas_log_lines,
    keep_earlier_families,
    kv_bytes,
    pick_cases,
)

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def test_a_stage_log_records_ok_error_and_skipped(tmp_path: Path) -> None:
    log = StageLog(tmp_path / "r.json", ("a", "b", "c"), ["a", "b"])
    log.run("a", lambda: {"x": 1})
    log.run("b", lambda: 1 / 0)
    log.run("c", lambda: {"never": True})
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["a"]["status"] == "ok" and saved["a"]["x"] == 1
    assert saved["b"]["status"] == "error" and "ZeroDivisionError" in saved["b"]["error"]
    assert saved["c"] == {"status": "skipped", "reason": "not in --stages"}
    assert log.failed() == ["b"]


def test_blas_lines_and_kv_bytes() -> None:
    text = "x CPU BLAS for MLX: mkl, 2 threads\ny\nz CPU BLAS for MLX: mkl, 2 threads\n"
    assert blas_log_lines(text) == ["mkl, 2 threads"]
    assert kv_bytes({"kv_bytes_per_token": 1}, 100, 1) == 64 * 2**20  # the floor
    big = kv_bytes({"kv_bytes_per_token": 2**16}, 1024, 32)
    assert big == int(1.5 * 32 * (64 + 1) * 16 * 2**16)


def test_cases_run_in_the_order_named() -> None:
    import argparse

    p = argparse.ArgumentParser()
    chosen = [{"name": n} for n in ("plain", "backoff", "no_backoff")]
    picked = pick_cases(p, argparse.Namespace(cases=["no_backoff", "plain", "no_backoff"]), chosen)
    assert [c["name"] for c in picked] == ["no_backoff", "plain"]
    assert pick_cases(p, argparse.Namespace(cases=None), chosen) == chosen
    with pytest.raises(SystemExit):
        pick_cases(p, argparse.Namespace(cases=["nope"]), chosen)


def test_free_port_is_bindable_below_the_ephemeral_range_and_log_tail_reads_the_end(
    tmp_path: Path,
) -> None:
    ports = {servers.free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        assert 10000 <= port < servers._ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    log = tmp_path / "server.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    assert servers.log_tail(log, 2) == "line 98\nline 99"
    assert servers.log_tail(tmp_path / "missing.log") == "(no server log)"


def test_prometheus_samples_are_parsed_with_their_labels() -> None:
    text = (
        "# HELP vllm:x counter\n"
        'vllm:prompt_tokens_cached_by_source_total{model_name="m",source="host"} 288.0\n'
        "vllm:num_preemptions_total 3\n"
    )
    assert servers.parse_metrics(text) == [
        ("vllm:prompt_tokens_cached_by_source_total", {"model_name": "m", "source": "host"}, 288.0),
        ("vllm:num_preemptions_total", {}, 3.0),
    ]


def test_agreement_counts_common_prefixes() -> None:
    a = agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]])
    assert a["identical"] == 1 and a["common_prefix_tokens"] == [2, 3] and a["passed"]
    assert not agreement([[1]], [[2]])["passed"]


def test_report_cells_and_publish(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib")
    assert num(None) == "—" and num(1.234, 2) == "1.23"
    assert "harness" in quick_note("the tiny model")
    line = machine_line({"cpu": "C", "machine": "x86_64", "logical_cores": 2, "ram_bytes": 2**31,
                         "git": {"commit": "abcdef123", "dirty": True}})  # fmt: skip
    assert line.startswith("Measured on C") and "abcdef1 (dirty tree)" in line
    case = {"rounds": 1, "median_tpot_ms": 10.0, "decode_tok_s": 100.0, "output_tok_s": 90.0,
            "median_ttft_ms": 5.0, "round_s": [0.5]}  # fmt: skip
    assert cases_table({"c1_plugin": case})[-1].startswith("| c1_plugin | 1 | 10.0 | 100.0 |")
    rows = targets_table({"t": {"goal": 1.0, "measured": 0.5, "met": False}}, "≥")
    assert rows[-1] == "| t | ≥ 1.0x | 0.50x | missed |"

    def plot(report: dict, plt: object) -> object:
        fig, ax = plt.subplots()  # type: ignore[attr-defined]
        ax.plot([1, 2], [report["v"], report["v"]])
        return fig

    written = publish({"v": 1}, tmp_path, "x", lambda r: f"# {r['v']}\n", plot)
    assert json.loads((tmp_path / "x.json").read_text()) == {"v": 1}
    assert (tmp_path / "x.md").read_text() == "# 1\n"
    assert [p.name for p in written] == ["x.md", "x.png"]
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_suite_list_names_every_suite_module() -> None:
    from bench.run import SUITES

    proc = subprocess.run([sys.executable, "-m", "bench.run", "--list"], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == [s.name for s in SUITES]
    for suite in SUITES:
        assert (ROOT / "bench" / "suites" / f"{suite.name}.py").is_file(), suite.name


def test_summary_compares_the_plugin_with_vllm_cpu_at_32() -> None:
    """The targets computed from hand-made serve runs (no processes)."""
    from bench.suites.main import TARGETS
    from bench.suites.main_summary import summarize, targets_section

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
    text = "\n".join(targets_section(summary))
    assert "| output tok/s at 32 concurrent, plugin / vLLM CPU | ≥ 1.0x | 0.80x | missed |" in text
    assert "1.25x short of the goal" in text


def test_keep_earlier_families_of_a_hybrid_report(tmp_path: Path) -> None:
    """A run of some `--families` keeps the other families of the report already in its folder,
    in the suite's order, each with the run that measured it; a family it ran replaces the
    earlier one; other settings, or a family the suite no longer has, keep nothing."""
    order = ("a", "b", "c", "d")
    same = ("dtype", "streams")

    def report(families: list[str], command: str, **settings: object) -> dict:
        return {"settings": {"dtype": "float32", "streams": [1, 16], "command": command,
                             "total_seconds": 10.0, **settings},
                "machine": {"git": {"commit": command * 7}},
                "families": {f: {"cases": {"from": command}} for f in families}}  # fmt: skip

    path = tmp_path / "hybrid.json"
    assert keep_earlier_families(report(["b"], "2"), path, order, same) == report(["b"], "2")
    path.write_text(json.dumps(report(["a", "b", "c", "gone"], "1")))
    merged = keep_earlier_families(report(["d", "b"], "2"), path, order, same)
    assert list(merged["families"]) == ["a", "b", "c", "d"]
    assert {f: r["cases"]["from"] for f, r in merged["families"].items()} == {
        "a": "1", "b": "2", "c": "1", "d": "2"}  # fmt: skip
    run = {"command": "1", "total_seconds": 10.0, "machine": {"git": {"commit": "1111111"}}}
    assert merged["families"]["a"]["earlier_run"] == run == merged["families"]["c"]["earlier_run"]
    assert "earlier_run" not in merged["families"]["b"]
    assert merged["settings"]["command"] == "2" and merged["machine"]["git"]["commit"] == "2" * 7
    # Merged again later: a family keeps the run that measured it, not the one it was kept by.
    path.write_text(json.dumps(merged))
    again = keep_earlier_families(report(["c"], "3"), path, order, same)
    assert again["families"]["a"]["earlier_run"] == run
    assert again["families"]["b"]["earlier_run"]["command"] == "2"
    assert "earlier_run" not in again["families"]["c"]
    # Settings that make the figures incomparable: this run's families alone.
    for differ in ({"dtype": "bfloat16"}, {"streams": [1, 32]}):
        alone = keep_earlier_families(report(["c"], "3", **differ), path, order, same)
        assert list(alone["families"]) == ["c"], differ


def test_hybrid_report_names_the_run_of_each_kept_family(tmp_path: Path) -> None:
    """The hybrid report of a merged run: a dense Qwen3.5 row measured now beside the committed
    run's families, each kept family naming the run (and commit) that measured it."""
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib")
    import copy

    from bench.suites.hybrid import FAMILIES, SAME_SETTINGS, summarize
    from bench.suites.hybrid_report import NO_CPU_PEER, write_report

    committed = json.loads((ROOT / "docs" / "benchmarks" / "hybrid.json").read_text())
    earlier = copy.deepcopy(committed)
    for r in earlier["families"].values():
        r.pop("earlier_run", None)  # as a report of one run
    earlier["families"].pop("qwen3_5", None)
    earlier["settings"].update(command="python -m bench.run hybrid --out old", total_seconds=713.0)
    earlier["machine"]["git"] = {"commit": "0123456789abcdef", "dirty": False}
    earlier["machine"]["cpu"] = "the CPU"
    (tmp_path / "hybrid.json").write_text(json.dumps(earlier))
    qwen3_5 = copy.deepcopy(earlier["families"]["qwen3_next"])
    qwen3_5["model"].update(architecture="Qwen3_5ForCausalLM", num_experts=None,
                            experts_per_token=None, intermediate_size=3584)  # fmt: skip
    now = {**copy.deepcopy(earlier), "families": {"qwen3_5": qwen3_5}}
    now["settings"]["command"] = "python -m bench.run hybrid --families qwen3_5"
    now["machine"]["git"] = {"commit": "fedcba9876543210", "dirty": False}
    report = keep_earlier_families(now, tmp_path / "hybrid.json", FAMILIES, SAME_SETTINGS)
    report["summary"] = summarize(report)
    write_report(report, tmp_path)
    text = (tmp_path / "hybrid.md").read_text()
    assert text.startswith("# Hybrid, latent-attention and sliding-window decode: Qwen3-Next, "
                           "Qwen3.5, Granite 4.0-H, DeepSeek-V3, Gemma 4, LFM2\n")  # fmt: skip
    assert "s (Qwen3.5); the other families are kept from earlier runs" in text
    assert "commit fedcba9." in text
    assert ("Qwen3-Next, Granite 4.0-H, DeepSeek-V3, Gemma 4 and LFM2: `python -m bench.run hybrid "
            "--out old` in 713 s. Measured on") in text  # fmt: skip
    assert text.count("Kept from an earlier run: `python -m bench.run hybrid --out old` "
                      "(commit 0123456).") == 5  # fmt: skip
    section = text[text.index("## Qwen3.5") : text.index("## Granite")]
    assert "Kept from" not in section and NO_CPU_PEER["qwen3_5"] in section
    assert "per layer a dense MLP of intermediate 3584;" in section
    assert (
        f"| Qwen3.5 | 16 | {qwen3_5['cases']['c16_plugin']['decode_tok_s']:.1f} | not run | — |"
        in text
    )
    assert (tmp_path / "hybrid.png").read_bytes()[:8] == PNG
    assert "Another CPU" not in text
    report["machine"]["cpu"] = "another CPU"
    write_report(report, tmp_path)
    text = (tmp_path / "hybrid.md").read_text()
    assert "at start; commit 0123456. Another CPU than this run's: its rows and this run's" in text


def test_hybrid_gemma4_shape_is_e2b_like() -> None:
    """The hybrid suite's Gemma 4: E2B's layout at hidden 1024 (4 sliding layers of one 256-wide
    KV head then a full one of 512, the layers after the first full-attention block sharing K/V),
    described from its config: only the 5 layers that compute K/V count in its KV bytes."""
    from bench.suites.hybrid_describe import _sliding
    from bench.suites.hybrid_models import SHAPES
    from bench.suites.hybrid_report import model_line
    from tests.fixtures.tiny_gemma4 import tiny_gemma4_text_config

    config = tiny_gemma4_text_config("dense", **SHAPES["gemma4"])
    assert "global_head_dim" not in config  # transformers 5: the full layers' size per layer
    d = _sliding(config, 4)
    assert d["mixer_shape"] == {
        "window": 512, "sliding_layers": 8, "full_layers": 2, "sliding_kv_heads": 1,
        "sliding_head_dim": 256, "full_kv_heads": 1, "full_head_dim": 512, "kv_shared_layers": 5,
        "double_wide_mlp": True, "per_layer_input": 256,
    }  # fmt: skip
    assert d["kv_bytes_per_token"] == (4 * 2 * 256 + 2 * 512) * 4  # 4 sliding + 1 full compute K/V
    d |= {"name": "g", "architecture": "Gemma4ForCausalLM", "dtype": "float32", "num_layers": 10,
          "hidden_size": 1024, "num_heads": 8, "vocab_size": 32000, "tied_embeddings": True,
          "num_parameters": 365_000_000, "active_parameters_per_token": 283_000_000}  # fmt: skip
    line = model_line(d)
    assert "10 layers `SSSSASSSSA`: 8 sliding-window layers (window 512, 1 KV head of 256)" in line
    assert "2 full-attention layers (1 KV head of 512), 8 query heads" in line
    assert "the last 5 layers compute no K/V" in line and "KV 12 KiB per token" in line


def test_hybrid_gemma4_quick_checkpoint_description(tmp_path: Path) -> None:
    """The `--quick` Gemma 4 (the tests' tiny one) described from its files: tied, its per-layer
    embedding counted in the parameters but not the active ones."""
    from bench.suites.hybrid_describe import describe_hybrid_model
    from bench.suites.hybrid_models import write_hybrid_model

    d = describe_hybrid_model(write_hybrid_model(tmp_path, "gemma4", quick=True))
    assert d["architecture"] == "Gemma4ForCausalLM" and d["tied_embeddings"]
    assert d["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert d["num_experts"] is None and d["intermediate_size"] == 128
    assert d["state_bytes_per_request"] == 0
    per_layer = d["vocab_size"] * 6 * 16  # embed_tokens_per_layer
    assert d["num_parameters"] - d["active_parameters_per_token"] == per_layer
    # 3 sliding layers (2 KV heads of 32) and 1 full (2 of 64) compute K/V; the last 2 read them
    assert d["kv_bytes_per_token"] == (3 * 2 * 2 * 32 + 2 * 2 * 64) * 4


def test_torch_backend_bench_command_line_and_report(tmp_path: Path) -> None:
    """The torch_backend suite's command line and report without engines (its `--quick` run is
    in tests/bench/test_suites.py)."""
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib")
    from bench.harness.stages import BACKEND_ENV
    from bench.suites import torch_backend as tb

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
    tb.write_report(report, tmp_path)
    text = (tmp_path / "torch-backend.md").read_text()
    assert "| 32 | 800.0 | 640.0 | failed | 1.25x | — |" in text
    assert "**1/2 identical**" in text and "## MLX (plugin): failed" in text
    assert (tmp_path / "torch-backend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_regenerates_every_committed_report(tmp_path: Path) -> None:
    """`bench.run report DIR` writes every report in docs/benchmarks again from its JSON: the
    same markdown (but for the command named in the first lines) and a PNG for each."""
    pytest.importorskip("matplotlib", reason="the reports' plots need matplotlib")
    import shutil

    docs = ROOT / "docs" / "benchmarks"
    folder = tmp_path / "benchmarks"
    shutil.copytree(docs, folder, ignore=shutil.ignore_patterns("*.md", "*.png"))
    proc = subprocess.run([sys.executable, "-m", "bench.run", "report", str(folder)], cwd=ROOT,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    stems = [p.stem for p in docs.glob("*.json")]
    assert len(stems) >= 12
    for stem in stems:
        committed = (docs / f"{stem}.md").read_text().splitlines()
        written = (folder / f"{stem}.md").read_text().splitlines()
        assert len(written) == len(committed), stem
        differ = [i for i, (a, b) in enumerate(zip(written, committed)) if a != b]
        # Only the generating command may read differently (`bench.X` -> `bench.run X`).
        assert all("bench" in committed[i] and i < 10 for i in differ), (stem, differ)
    for png in docs.glob("*.png"):
        assert (folder / png.name).read_bytes()[:8] == PNG, png.name
