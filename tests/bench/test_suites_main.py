"""Proves the main run (`python -m bench.run main --quick`: machine, offline and served single
stream, `vllm serve` against vLLM's CPU backend) runs end to end and writes its report and plots;
`--quick --peers` (full tier) for what only the comparison shows."""

from __future__ import annotations

import pytest

from tests.bench.conftest import PNG


def _main_single_stream(res: dict, name: str) -> None:
    settings = res["settings"]
    requests = res[name]["requests"]
    assert len(requests) == settings["num_prompts"], name
    for request in requests:
        # Exactly output_len tokens: EOS is ignored on both sides, so the decode work matches.
        assert request["output_tokens"] == settings["output_len"], name
        assert 0 < request["ttft_ms"] < 1e3 * request["e2e_s"] + 1, name
        assert request["decode_tok_s"] == pytest.approx(1e3 / request["tpot_ms"]), name


def _main_common(run) -> dict:
    from bench.suites.main import SECTIONS

    res = run.results("results")
    assert set(res) == {"settings", "model", "summary", *SECTIONS}
    ran = res["settings"]["stages"]
    for name in SECTIONS:
        assert res[name]["status"] == ("ok" if name in ran else "skipped"), (name, res[name])
    assert res["machine"]["ram_bytes"] > 0 and res["machine"]["versions"]["mlx"]
    assert res["bandwidth"]["gbps"]["roofline"] > 0
    _main_single_stream(res, "plugin_offline")
    assert res["plugin_offline"]["platform"] == "MetalPlatform"
    blas = res["machine"]["cpu_blas"]
    assert blas["name"] and "active" in blas and "threads" in blas
    if blas["active"] and "cpu" in res["machine"]["mlx_device"].lower():
        # The engine core is a process of its own; it says which BLAS it uses in the stage log.
        assert any(line.startswith(blas["name"]) for line in
                   res["plugin_offline"].get("cpu_blas_logged", []))  # fmt: skip
    text = (run.out / "results.md").read_text()
    for heading in ("## Machine", "## Targets", "## Single stream", "## Decode against"):
        assert heading in text
    assert f"| CPU BLAS for MLX | {blas['name']}" in text and "plugin `vllm.LLM`" in text
    for name in ("decode_single_stream.png", "serve_concurrency.png", "startup.png"):
        assert f"]({name})" in text, name
        assert (run.out / name).read_bytes()[:8] == PNG, name
    return res


@pytest.mark.slow
@pytest.mark.full
def test_main_quick(run_suite) -> None:
    run = run_suite("main")
    res = _main_common(run)
    ran = res["settings"]["stages"]
    assert "serve_plugin" in ran and "mlx_lm" not in ran and "serve_cpu" not in ran
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
    # The model description matches the tiny Qwen3's shape.
    model = res["model"]
    h, inter, layers, vocab = 256, 512, 2, 768
    q, kv, d = 4 * 64, 2 * 64, 64
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * d
    params = 2 * vocab * h + layers * per_layer + h  # untied embedding + LM head, final norm
    assert model["num_parameters"] == params
    assert model["weight_bytes"] == 2 * params  # bfloat16
    assert model["weight_bytes_per_token"] == 2 * (params - vocab * h)  # embedding only gathered
    assert "`mlx_lm`: skipped" in (run.out / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.full
def test_main_with_peers(run_suite) -> None:
    run = run_suite("main", peers=True)
    res = _main_common(run)
    assert {"mlx_lm", "serve_cpu"} <= set(res["settings"]["stages"])
    assert res["serve_cpu"]["status"] == "ok"
    _main_single_stream(res, "mlx_lm")
    blas = res["machine"]["cpu_blas"]
    if blas["active"] and "cpu" in res["machine"]["mlx_device"].lower():
        # mlx-lm runs in its own process: it imported the plugin first and got the same library.
        assert res["mlx_lm"]["cpu_blas"].startswith(blas["name"])
        assert res["mlx_lm"]["mlx_cblas_sgemm"] == blas["mlx_cblas_sgemm"]
    # On MLX's CPU device mlx-lm is also measured in float32 (the plugin's compute dtype there);
    # the target is taken against the faster of the two.
    mlx = res["mlx_lm"]
    variants = [mlx] + ([mlx["float32"]] if "float32" in mlx else [])
    if res["plugin_offline"]["compute_dtype"] == "float32" and mlx["compute_dtype"] != "float32":
        assert "float32" in mlx, "mlx-lm was not measured in the plugin's compute dtype"
    best = max(v["median_decode_tok_s"] for v in variants)
    ratio = res["summary"]["targets"]["single_stream_vs_mlx_lm"]["value"]
    assert ratio == pytest.approx(res["plugin_offline"]["median_decode_tok_s"] / best)
    assert "mlx-lm `stream_generate`" in (run.out / "results.md").read_text()


# ----------------------------------------------------------------------- kernels and profile
