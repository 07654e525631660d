"""Proves every benchmark suite runs end to end in `--quick` mode (`python -m bench.run --quick
--all`, each suite in a process of its own, engines and servers for real on tiny models) and
writes its results: the JSON with its key figures present and positive, the markdown with its
sections, the plot a PNG. Only the harness is checked, not any speed; where a suite compares
backends, their answers must agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict, subprocess.CompletedProcess]:
    """One `bench.run --quick --all`: its output folder, its record, and the process."""
    pytest.importorskip("matplotlib", reason="the reports' plots need matplotlib")
    out = tmp_path_factory.mktemp("quick-out")
    work = tmp_path_factory.mktemp("quick-work")
    cmd = [sys.executable, "-m", "bench.run", "--quick", "--all",
           "--out", str(out), "--work-dir", str(work)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
    print(f"bench.run --quick --all into {out}:\n{proc.stderr[-3000:]}")
    record = json.loads((out / "quick-all.json").read_text())
    return out, record, proc


def results(quick: tuple, suite: str, stem: str | None = None) -> dict:
    """The suite's `<stem>.json`, once its run is seen to have succeeded (else its log's end)."""
    out, record, _ = quick
    entry = record["suites"][suite]
    log = Path(entry["log"]).read_text(encoding="utf-8", errors="replace")
    assert entry["status"] == "ok", f"{suite}: {entry}\n{log[-4000:]}"
    return json.loads((out / f"{stem or suite}.json").read_text())


def report_text(quick: tuple, stem: str, headings: tuple[str, ...]) -> str:
    """`<stem>.md`, once it holds every heading and `<stem>.png` is a PNG."""
    out = quick[0]
    text = (out / f"{stem}.md").read_text()
    for heading in headings:
        assert heading in text, heading
    assert (out / f"{stem}.png").read_bytes()[:8] == PNG
    return text


def assert_round_cases(data: dict, cases: list[dict]) -> None:
    """A decode-round suite's results hold every case, each with positive rates over the
    rounds its settings asked for."""
    assert set(data["cases"]) == {c["name"] for c in cases}
    for name, case in data["cases"].items():
        assert case["decode_tok_s"] > 0 and case["output_tok_s"] > 0, name
        assert case["rounds"] == data["settings"][f"c{case['streams']}_rounds"], name


def test_every_suite_ran_and_the_run_says_so(quick: tuple) -> None:
    from bench.run import SUITES

    _, record, proc = quick
    assert set(record["suites"]) == {s.name for s in SUITES}
    failed = [n for n, r in record["suites"].items() if r["status"] != "ok"]
    assert proc.returncode == (1 if failed else 0), proc.stderr[-2000:]
    assert not failed, f"suites that failed: {failed}"
    assert f"{len(SUITES)}/{len(SUITES)} suites ok" in proc.stderr


# ------------------------------------------------------------------------------------ main run


def test_main_run_writes_every_section(quick: tuple) -> None:
    from bench.suites.main import SECTIONS

    res = results(quick, "main", "results")
    assert set(res) == {"settings", "model", "summary", *SECTIONS}
    ran = res["settings"]["stages"]
    for name in SECTIONS:
        want = "ok" if name in ran else "skipped"
        assert res[name]["status"] == want, (name, res[name])
    assert "serve_cpu" not in ran and "serve_plugin" in ran
    assert res["machine"]["ram_bytes"] > 0
    assert res["machine"]["versions"]["mlx"]
    assert res["bandwidth"]["gbps"]["roofline"] > 0


def test_main_run_records_the_cpu_blas_shared_with_mlx_lm(quick: tuple) -> None:
    res = results(quick, "main", "results")
    blas = res["machine"]["cpu_blas"]
    assert blas["name"] and "active" in blas and "threads" in blas
    if blas["active"] and res["machine"]["mlx_device"].lower().find("cpu") >= 0:
        # mlx-lm runs in its own process: it imported the plugin first and got the same library.
        assert res["mlx_lm"]["cpu_blas"].startswith(blas["name"])
        assert res["mlx_lm"]["mlx_cblas_sgemm"] == blas["mlx_cblas_sgemm"]
        # The engine core is a process of its own; it says which BLAS it uses in the stage log.
        assert any(line.startswith(blas["name"]) for line in
                   res["plugin_offline"].get("cpu_blas_logged", []))  # fmt: skip
    assert f"| CPU BLAS for MLX | {blas['name']}" in (quick[0] / "results.md").read_text()


def test_main_run_single_stream_figures_are_consistent(quick: tuple) -> None:
    res = results(quick, "main", "results")
    settings = res["settings"]
    for name in ("mlx_lm", "plugin_offline"):
        requests = res[name]["requests"]
        assert len(requests) == settings["num_prompts"], name
        for request in requests:
            # Exactly output_len tokens: EOS is ignored on both sides, so the decode work matches.
            assert request["output_tokens"] == settings["output_len"], name
            assert 0 < request["ttft_ms"] < 1e3 * request["e2e_s"] + 1, name
            assert request["decode_tok_s"] == pytest.approx(1e3 / request["tpot_ms"]), name
    assert res["plugin_offline"]["platform"] == "MetalPlatform"
    # On MLX's CPU device mlx-lm is also measured in float32 (the plugin's compute dtype there);
    # the target is taken against the faster of the two.
    mlx = res["mlx_lm"]
    variants = [mlx] + ([mlx["float32"]] if "float32" in mlx else [])
    if res["plugin_offline"]["compute_dtype"] == "float32" and mlx["compute_dtype"] != "float32":
        assert "float32" in mlx, "mlx-lm was not measured in the plugin's compute dtype"
    best = max(v["median_decode_tok_s"] for v in variants)
    ratio = res["summary"]["targets"]["single_stream_vs_mlx_lm"]["value"]
    assert ratio == pytest.approx(res["plugin_offline"]["median_decode_tok_s"] / best)


def test_main_run_serves_and_times_the_start(quick: tuple) -> None:
    res = results(quick, "main", "results")
    runs = res["serve_plugin"]["runs"]
    assert [r["concurrency"] for r in runs] == res["settings"]["concurrency"]
    for r in runs:
        assert r["completed"] >= r["concurrency"] and not r["failed"], r
        assert r["output_throughput"] > 0 and r["mean_tpot_ms"] > 0, r
        assert r["command"].startswith("vllm bench serve ")
    startup = res["startup"]["plugin_tiny"]
    assert 0 < startup["launch_to_health_s"] <= startup["launch_to_first_token_s"]
    assert startup["phases_s"]["first_output"] > 0
    assert res["summary"]["targets"]["tiny_startup_s"]["value"] > 0


def test_main_run_model_description_matches_the_checkpoint_shape(quick: tuple) -> None:
    model = results(quick, "main", "results")["model"]
    h, inter, layers, vocab = 256, 512, 2, 768  # the tiny Qwen3 shape
    q, kv, d = 4 * 64, 2 * 64, 64
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * d
    params = 2 * vocab * h + layers * per_layer + h  # untied embedding + LM head, final norm
    assert model["num_parameters"] == params
    assert model["weight_bytes"] == 2 * params  # bfloat16
    assert model["weight_bytes_per_token"] == 2 * (params - vocab * h)  # embedding only gathered


def test_main_run_report_and_plots_are_written(quick: tuple) -> None:
    results(quick, "main", "results")
    text = (quick[0] / "results.md").read_text()
    for heading in ("## Machine", "## Targets", "## Single stream", "## Decode against"):
        assert heading in text
    assert "mlx-lm `stream_generate`" in text and "plugin `vllm.LLM`" in text
    for name in ("decode_single_stream.png", "serve_concurrency.png", "startup.png"):
        assert f"]({name})" in text, name
        assert (quick[0] / name).read_bytes()[:8] == PNG, name


# ----------------------------------------------------------------------- kernels and profile


def test_attention_kernel_cells_agree_with_the_reference(quick: tuple) -> None:
    data = results(quick, "attention", "attention_decode")
    checked = [cell for cell in data["cells"] if "max_abs_diff" in cell]
    assert checked, "no cell was checked against the baselines"
    for cell in data["cells"]:
        assert cell["native_ms"] > 0, cell
    for cell in checked:
        assert cell["speedup"] > 0 and cell["max_abs_diff"] < 1e-3, cell
    report_text(quick, "attention_decode", ())


def test_profile_splits_decode_steps_into_phases(quick: tuple) -> None:
    data = results(quick, "profile")
    workloads = data["results"]["workloads"]
    assert [r["batch"] for r in workloads] == data["batch_sizes"]
    for r in workloads:
        assert r["steps"] > 0 and r["unprofiled_ms_per_step"] > 0, r
        assert r["phases"] and all(p["ms_per_step"] >= 0 for p in r["phases"]), r


# ------------------------------------------------------------------------ decode-round suites


def test_moe_cases_and_agreement(quick: tuple) -> None:
    from bench.suites.moe import BACKENDS, STREAMS, cases

    data = results(quick, "moe")
    assert_round_cases(data, cases())
    assert data["workers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["workers"]["cpu"]["platform"] == "CpuPlatform"
    assert set(data["summary"]["ratios"]) == {f"c{n}_plugin_vs_cpu" for n in STREAMS}
    assert set(data["summary"][f"c{max(STREAMS)}_vs_c1"]) == set(BACKENDS)
    model = data["model"]
    assert model["architecture"] == "Qwen3MoeForCausalLM"
    assert model["active_parameters_per_token"] < model["num_parameters"]
    check = data["agreement"]
    assert check["passed"] and check["requests"] == max(STREAMS)
    assert check["distinct_continuations"] > 1
    text = report_text(
        quick, "moe", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Workers")
    )
    assert "Measured on" in text and "Quick run" in text


def test_hybrid_families_decode(quick: tuple) -> None:
    from bench.suites.hybrid import BACKENDS, FAMILIES

    data = results(quick, "hybrid")
    assert set(data["families"]) == set(FAMILIES)
    for family, f in data["families"].items():
        assert {c["backend"] for c in f["cases"].values()} == set(BACKENDS[family]), family
        for name, case in f["cases"].items():
            assert case["decode_tok_s"] > 0 and case["output_tok_s"] > 0, (family, name)
        assert f["workers"]["plugin"]["platform"] == "MetalPlatform", family
    report_text(quick, "hybrid", ())


def test_torch_backend_cases_and_agreement(quick: tuple) -> None:
    from bench.suites.torch_backend import BACKENDS, STREAMS, cases

    data = results(quick, "torch_backend", "torch-backend")
    assert_round_cases(data, cases())
    platforms = {be: w["platform"] for be, w in data["workers"].items()}
    assert platforms == {"torch": "MetalPlatform", "cpu": "CpuPlatform", "mlx": "MetalPlatform"}
    assert all(v is not None for v in data["summary"]["ratios"].values())
    assert data["summary"]["failed"] == [] and data["summary"]["concurrency_ok"]
    assert data["engine"]["max_num_seqs"] == max(STREAMS)
    a = data["agreement"]
    assert a["engines"] == list(BACKENDS) and a["requests"] == max(STREAMS)
    for pair, check in a["pairs"].items():
        assert check["passed"], pair
    assert min(a["distinct_continuations"].values()) > 1
    text = report_text(
        quick,
        "torch-backend",
        ("## Decode throughput (same run)", "## Agreement", "## Cases", "## Engines"),
    )
    assert "Measured on" in text and "Quick run" in text


def test_gguf_engine_and_layers(quick: tuple) -> None:
    from bench.suites.gguf import CASES

    data = results(quick, "gguf")
    assert set(data["engine"]) == set(CASES) and set(data["layers"]) == set(CASES)
    for case in CASES:
        assert data["engine"][case]["decode_tok_s"] > 0, case
        assert data["layers"][case]["decode_tok_s"] > 0, case
    report_text(quick, "gguf", ())


# ----------------------------------------------------------------------- engine-case suites


def test_lora_cases_ops_and_targets(quick: tuple) -> None:
    from bench.suites.lora import TARGETS, cases

    data = results(quick, "lora")
    assert set(data["cases"]) == {c["name"] for c in cases()}
    for name, case in data["cases"].items():
        assert case["median_tpot_ms"] > 0, name
        assert case["output_tok_s"] > 0, name
        assert case["concurrency"] == len(case["adapters"]), name
    split = data["cases"]["lora_split_c8"]["adapters"]
    assert split.count(0) == split.count(1) == 4
    assert len(data["settings"]["adapters"]) == 2
    for path in data["settings"]["adapters"]:
        assert (Path(path) / "adapter_config.json").is_file()
    assert data["ops"], "no op micro-benchmark case"
    for op in data["ops"]:
        for key in ("base_ms", "stacked_update_ms", "gather_update_ms", "stacked_total_ms",
                    "gather_total_ms"):  # fmt: skip
            assert op[key] > 0, (op, key)
    summary = data["summary"]
    assert set(summary["targets"]) == set(TARGETS)
    for key, value in summary["ratios"].items():
        assert value is not None and value > 0, key
    assert summary["targets"]["lora_step_time_vs_base"]["measured"] == pytest.approx(
        data["cases"]["lora_split_c8"]["median_tpot_ms"]
        / data["cases"]["base_c8"]["median_tpot_ms"],
        abs=1e-3,
    )
    # The wrapping with no adapter in the step leaves the base model's projections untouched.
    assert summary["checks"]["wrapping_keeps_base_tokens"]
    text = report_text(
        quick,
        "lora",
        ("## Targets", "## Ratios (same run)", "## Engine cases", "## One projection"),
    )
    assert "lora_step_time_vs_base" in text and "Measured on" in text


def test_spec_decode_cases(quick: tuple) -> None:
    data = results(quick, "spec_decode")
    assert data["cases"]
    for name, case in data["cases"].items():
        assert case["median_tpot_ms"] > 0 and case["output_tok_s"] > 0, name
    assert data["summary"]["speedups"] and data["summary"]["targets"]
    report_text(quick, "spec_decode", ())


def test_pooling_cases_and_agreement(quick: tuple) -> None:
    from bench.suites.pooling import BACKENDS, BATCHES, MODELS, cases

    data = results(quick, "pooling")
    assert set(data["cases"]) == {c["name"] for c in cases()}
    assert len(data["cases"]) == len(MODELS) * len(BATCHES) * len(BACKENDS)
    for name, case in data["cases"].items():
        assert case["inputs_per_s"] > 0, name
        assert case["median_call_s"] > 0, name
        assert case["calls"] == data["settings"][f"b{min(case['batch'], 32)}_calls"], name
        assert case["tokens_per_input"]["min"] >= data["settings"]["input_tokens"], name
    # Each backend ran where it should: the plugin's platform, and vLLM's own CPU platform.
    for kind, model in data["models"].items():
        assert model["workers"]["plugin"]["platform"] == "MetalPlatform", kind
        assert model["workers"]["cpu"]["platform"] == "CpuPlatform", kind
        check = model["agreement"]
        assert check["passed"], (kind, check)
        assert check["min_cosine"] >= 0.999, kind
        assert check["same_token_counts"], kind
        assert check["inputs"] == max(BATCHES), kind
    ratios = data["summary"]["ratios"]
    assert set(ratios) == {f"{m}_b{b}_plugin_vs_cpu" for m in MODELS for b in BATCHES}
    assert all(r > 0 for r in ratios.values())
    assert all(data["summary"]["agreement_passed"].values())
    text = report_text(
        quick,
        "pooling",
        ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Workers"),
    )
    assert "Measured on" in text and "Quick run" in text


def test_kv_offload_tiers(quick: tuple) -> None:
    from bench.suites.kv_offload import CASES

    data = results(quick, "kv_offload")
    assert data["problems"] == []
    assert set(data["cases"]) == set(CASES)
    for name, case in data["cases"].items():
        assert case["median_ttft_s"] > 0, name
        assert case["engine_start_s"] and all(s > 0 for s in case["engine_start_s"]), name
    report_text(quick, "kv_offload", ())


def test_sliding_window_blocks_are_freed(quick: tuple) -> None:
    hybrid, single = results(quick, "sliding_window_blocks")["rows"]
    assert hybrid["kv_cache_groups"] == 2 and single["kv_cache_groups"] == 1
    assert 0 < hybrid["decode_kib"] < single["decode_kib"]
    assert hybrid["tokens"] == single["tokens"]


def test_blas_matmul_candidates(quick: tuple) -> None:
    data = results(quick, "blas_matmul")
    assert "reference" in data["results"]
    for label, r in data["results"].items():
        assert all(ms > 0 for ms in r["ms"].values()), label


# --------------------------------------------------------------------------- served suites


def test_speech_cases_and_agreement(quick: tuple) -> None:
    from bench.suites.speech import BACKENDS, CONCURRENCY, QUICK_CLIP, cases

    data = results(quick, "speech")
    assert set(data["cases"]) == {c["name"] for c in cases()}
    seconds = data["clip"]["seconds"]
    assert seconds == QUICK_CLIP["seconds"]
    for name, case in data["cases"].items():
        n = case["concurrency"]
        assert case["rounds"] == data["settings"][f"c{n}_rounds"], name
        assert len(case["latency_s"]) == n * case["rounds"], name
        assert case["rtf"] == pytest.approx(case["median_round_wall_s"] / (n * seconds)), name
        assert case["audio_s_per_s"] == pytest.approx(1 / case["rtf"]), name
        # (round_wall_s is rounded to the millisecond)
        assert 0 < case["median_latency_s"] <= case["max_latency_s"]
        assert case["max_latency_s"] <= max(case["round_wall_s"]) + 1e-3, name
        assert case["tokens_per_request"] == [QUICK_CLIP["max_tokens"]] * case["rounds"], name
    # Each backend ran where it should: the plugin's platform, and vLLM's own CPU platform.
    assert data["servers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["servers"]["cpu"]["platform"] == "CpuPlatform"
    assert set(data["summary"]["ratios"]) == {f"c{n}_plugin_vs_cpu" for n in CONCURRENCY}
    assert set(data["summary"][f"c{max(CONCURRENCY)}_vs_c1"]) == set(BACKENDS)
    check = data["agreement"]
    assert check["passed"], check
    assert check["identical_across_backends"]
    assert all(check["matches_reference"].values())
    assert check["distinct_texts"] == {be: 1 for be in BACKENDS}
    assert not check["reference"]["stopped_at_eos"]
    assert check["reference"]["num_tokens"] == QUICK_CLIP["max_tokens"]
    assert check["text"].strip()
    text = report_text(
        quick,
        "speech",
        ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Servers"),
    )
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text


def test_vision_cases_and_agreement(quick: tuple) -> None:
    from bench.suites.vision import BACKENDS, CONCURRENCY, QUICK_CASE, cases

    data = results(quick, "vision")
    assert set(data["cases"]) == {c["name"] for c in cases()}
    max_tokens = QUICK_CASE["max_tokens"]
    for name, case in data["cases"].items():
        n = case["concurrency"]
        assert case["rounds"] == data["settings"][f"c{n}_rounds"], name
        assert len(case["requests"]) == n * case["rounds"], name
        assert case["tokens_per_request"] == [max_tokens], name
        assert case["server_generated_tokens"] == [n * max_tokens] * case["rounds"], name
        for request in case["requests"]:
            assert 0 < request["ttft_s"] < request["latency_s"], name
            assert request["decode_tok_s"] > 0, name
            assert request["usage_completion_tokens"] == max_tokens, name
        assert case["median_ttft_ms"] <= case["max_ttft_ms"], name
        assert case["min_decode_tok_s"] <= case["median_decode_tok_s"], name
    # Every request had an image of its own.
    seeds = [s for ss in data["workload"]["image_seeds"].values() for s in ss]
    assert len(seeds) == len(set(seeds))
    assert data["servers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["servers"]["cpu"]["platform"] == "CpuPlatform"
    ratios = data["summary"]["ratios"]
    assert ratios["ttft_plugin_vs_cpu"] > 0
    assert all(ratios[f"decode_c{n}_plugin_vs_cpu"] > 0 for n in CONCURRENCY)
    check = data["agreement"]
    assert check["passed"], check
    assert check["identical_across_backends"] and check["first_difference"] is None
    assert check["every_request_full_length"] == {be: True for be in BACKENDS}
    # The images decide the answers: different images, different tokens.
    assert check["distinct_answers"] > 1
    text = report_text(
        quick,
        "vision",
        ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Servers"),
    )
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text
