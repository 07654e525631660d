"""The main run's summary: decode figures against the roofline, and the targets with their gaps
(`summarize`), and the markdown of its Targets section. Nothing here measures anything."""

from __future__ import annotations

from typing import Any


def stage_ok(section: dict[str, Any] | None) -> bool:
    return bool(section) and section.get("status") == "ok"


def serve_runs(results: dict[str, Any], backend: str) -> dict[int, dict[str, Any]]:
    serve = results.get(f"serve_{backend}", {})
    return {r["concurrency"]: r for r in serve.get("runs", [])} if stage_ok(serve) else {}


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def roofline_tok_s(results: dict[str, Any], dtype: str | None = None) -> float | None:
    """Single-stream decode ceiling: bandwidth / weight bytes read per token, for weights held
    in the checkpoint's dtype (or in `dtype`)."""
    bw = results.get("bandwidth", {}).get("gbps", {}).get("roofline")
    model = results.get("model", {})
    weight = model.get("weight_bytes_per_token")
    if weight and dtype and model.get("dtype") in _ITEMSIZE:
        weight = weight * _ITEMSIZE[dtype] // _ITEMSIZE[model["dtype"]]
    return bw * 1e9 / weight if bw and weight else None


def plugin_compute_dtype(results: dict[str, Any]) -> str | None:
    """The dtype the plugin's model computes in (float32 on MLX's CPU device)."""
    off = results.get("plugin_offline", {})
    if stage_ok(off) and off.get("compute_dtype"):
        return off["compute_dtype"]
    device = str(results.get("machine", {}).get("mlx_device", "")).lower()
    return "float32" if "cpu" in device else results.get("model", {}).get("dtype")


def mlx_lm_variants(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, figures) of each mlx-lm run: as loaded, and cast to float32 when measured."""
    mlx = results.get("mlx_lm", {})
    if not stage_ok(mlx):
        return []
    dtype = mlx.get("compute_dtype") or results.get("model", {}).get("dtype") or "as loaded"
    out = [(f"mlx-lm stream_generate ({dtype})", mlx)]
    if isinstance(mlx.get("float32"), dict):
        out.append(("mlx-lm stream_generate (float32)", mlx["float32"]))
    return out


def summarize(results: dict[str, Any], targets: dict[str, float]) -> dict[str, Any]:
    """Decode figures as roofline fractions, the targets with their gaps, and the causes the
    results themselves show."""
    roof = roofline_tok_s(results)
    compute = plugin_compute_dtype(results)

    def frac(tok_s: float | None) -> float | None:
        return tok_s / roof if roof and tok_s else None

    decode: list[dict[str, Any]] = []
    singles = [*mlx_lm_variants(results)]
    if stage_ok(results.get("plugin_offline", {})):
        singles.append(("plugin, vllm.LLM", results["plugin_offline"]))
    for label, sec in singles:
        tok_s = sec["median_decode_tok_s"]
        decode.append({"what": label, "concurrency": 1, "per_stream_tok_s": tok_s,
                       "roofline_fraction": frac(tok_s)})  # fmt: skip
    for backend, label in (("plugin", "plugin, vllm serve"), ("cpu", "vLLM CPU, vllm serve")):
        for c, run in sorted(serve_runs(results, backend).items()):
            tpot = run.get("mean_tpot_ms")
            tok_s = 1e3 / tpot if tpot else None
            decode.append({"what": label, "concurrency": c, "per_stream_tok_s": tok_s,
                           "aggregate_output_tok_s": run.get("output_throughput"),
                           "roofline_fraction": frac(tok_s)})  # fmt: skip

    checks: dict[str, Any] = {}
    off = results.get("plugin_offline", {})
    variants = mlx_lm_variants(results)
    if variants and stage_ok(off):
        # Against the faster way of running mlx-lm on this device.
        label, mlx = max(variants, key=lambda v: v[1]["median_decode_tok_s"])
        ratio = off["median_decode_tok_s"] / mlx["median_decode_tok_s"]
        checks["single_stream_vs_mlx_lm"] = {
            "value": ratio,
            "target": targets["single_stream_vs_mlx_lm"],
            "met": ratio >= targets["single_stream_vs_mlx_lm"],
            "against": label,
            "tpot_overhead_ms": off["median_tpot_ms"] - mlx["median_tpot_ms"],
            "ttft_ratio": off["median_ttft_ms"] / mlx["median_ttft_ms"],
            "ratios": {
                name: off["median_decode_tok_s"] / sec["median_decode_tok_s"]
                for name, sec in variants
            },
            "plugin_compute_dtype": compute,
        }
    plugin = serve_runs(results, "plugin")
    if 1 in plugin and max(plugin, default=0) > 1:
        top = max(plugin)
        ratio = plugin[top]["output_throughput"] / plugin[1]["output_throughput"]
        entry = {
            "value": ratio,
            "concurrency": top,
            "target": targets["aggregate_32_vs_single"],
            "met": ratio >= targets["aggregate_32_vs_single"] and top >= 32,
            "tpot_growth": plugin[top]["mean_tpot_ms"] / plugin[1]["mean_tpot_ms"],
        }
        matmul = results.get("bandwidth", {}).get("matmul", {})
        if compute in matmul:
            entry["mlx_matmul_batching_gain"] = matmul[compute]["batching_gain"]
            entry["mlx_matmul_batch"] = matmul[compute]["batch"]
            entry["mlx_matmul_dtype"] = compute
        checks["aggregate_32_vs_single"] = entry
    cpu = serve_runs(results, "cpu")
    top = max(set(plugin) & set(cpu), default=0)
    if top and cpu[top].get("output_throughput"):
        p, c = plugin[top], cpu[top]
        ratio = p["output_throughput"] / c["output_throughput"]
        checks["plugin_32_vs_cpu_32"] = {
            "value": ratio,
            "concurrency": top,
            "target": targets["plugin_32_vs_cpu_32"],
            "met": ratio >= targets["plugin_32_vs_cpu_32"] and top >= 32,
            "plugin_output_tok_s": p["output_throughput"],
            "cpu_output_tok_s": c["output_throughput"],
            "tpot_ratio": p["mean_tpot_ms"] / c["mean_tpot_ms"] if c.get("mean_tpot_ms") else None,
            "ttft_ratio": p["mean_ttft_ms"] / c["mean_ttft_ms"] if c.get("mean_ttft_ms") else None,
        }
    startup = results.get("startup", {})
    if stage_ok(startup) and "plugin_tiny" in startup:
        seconds = startup["plugin_tiny"]["launch_to_first_token_s"]
        checks["tiny_startup_s"] = {
            "value": seconds,
            "target": targets["tiny_startup_s"],
            "met": seconds <= targets["tiny_startup_s"],
            "phases_s": startup["plugin_tiny"].get("phases_s", {}),
        }
    versus_cpu = {
        str(c): plugin[c]["output_throughput"] / cpu[c]["output_throughput"]
        for c in sorted(set(plugin) & set(cpu))
        if cpu[c].get("output_throughput")
    }
    return {
        "roofline_tok_s": roof,
        "plugin_compute_dtype": compute,
        "roofline_compute_tok_s": roofline_tok_s(results, compute),
        "decode": decode,
        "targets": checks,
        "plugin_vs_vllm_cpu_output_tok_s": versus_cpu,
    }


# ---------------------------------------------------------------------------------- targets


def fmt(x: Any, nd: int = 1, unit: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def targets_section(summary: dict[str, Any]) -> list[str]:
    t = summary.get("targets", {})
    lines = ["## Targets", "", "| target | goal | measured | status |", "|---|---:|---:|---|"]
    s = t.get("single_stream_vs_mlx_lm")
    if s:
        lines.append(f"| single-stream decode, plugin / mlx-lm | ≥ {s['target']:.1f}x | "
                     f"{s['value']:.2f}x | {'met' if s['met'] else 'missed'} |")  # fmt: skip
    a = t.get("aggregate_32_vs_single")
    if a:
        lines.append(f"| output tok/s at {a['concurrency']} concurrent / at 1 | ≥ {a['target']:.0f}x"
                     f" | {a['value']:.2f}x | {'met' if a['met'] else 'missed'} |")  # fmt: skip
    vc = t.get("plugin_32_vs_cpu_32")
    if vc:
        lines.append(f"| output tok/s at {vc['concurrency']} concurrent, plugin / vLLM CPU | "
                     f"≥ {vc['target']:.1f}x | {vc['value']:.2f}x | "
                     f"{'met' if vc['met'] else 'missed'} |")  # fmt: skip
    st = t.get("tiny_startup_s")
    if st:
        lines.append(f"| `vllm serve` tiny model, launch → first token | ≤ {st['target']:.0f} s | "
                     f"{st['value']:.1f} s | {'met' if st['met'] else 'missed'} |")  # fmt: skip
    lines += ["", "### Gaps and where the time goes (from this run)", ""]
    if s:
        word = "ahead of" if s["met"] else "behind"
        others = ", ".join(
            f"{v:.2f}x against {k.removeprefix('mlx-lm stream_generate ')}"
            for k, v in s.get("ratios", {}).items()
        )
        lines.append(
            f"- **Single stream**: the plugin is {abs(s['value'] - 1) * 100:.1f}% {word} "
            f"{s.get('against', 'mlx-lm')}, the faster way to run mlx-lm here "
            f"({s['tpot_overhead_ms']:+.1f} ms per output token; TTFT ratio "
            f"{s['ttft_ratio']:.2f}x; {others}). The plugin computes in "
            f"{s.get('plugin_compute_dtype')}; both run the same mlx-lm layers on the same MLX "
            "device and BLAS, so the difference is the per-step work around the forward: see "
            "the profile tables."
        )
    if a:
        gain = a.get("mlx_matmul_batching_gain")
        text = (
            f"- **Batching**: {a['value']:.2f}x the single-stream output rate at "
            f"{a['concurrency']} concurrent, {a['target'] / a['value']:.1f}x short of the goal. "
            f"The step time grows {a['tpot_growth']:.1f}x from 1 to {a['concurrency']} sequences"
        )
        if gain is not None:
            text += (
                f"; MLX's {a.get('mlx_matmul_dtype', '')} matmul on this device does "
                f"{a['mlx_matmul_batch']} rows {gain:.1f}x as fast per row as 1 row (a purely "
                f"memory-bound matmul would give ~{a['mlx_matmul_batch']}x), which bounds what "
                "batching can gain here"
            )
        lines.append(text + ".")
    if vc:
        lines.append(
            f"- **Against vLLM's CPU backend at {vc['concurrency']} concurrent**: "
            f"{vc['plugin_output_tok_s']:.1f} vs {vc['cpu_output_tok_s']:.1f} output tok/s "
            + (
                f"({(vc['value'] - 1) * 100:.0f}% ahead). "
                if vc["met"]
                else f"({vc['target'] / vc['value']:.2f}x short of the goal). "
            )
            + f"TPOT ratio {fmt(vc.get('tpot_ratio'), 2)}x, TTFT ratio "
            f"{fmt(vc.get('ttft_ratio'), 2)}x (plugin / vLLM CPU); the step profile of the "
            "benchmark model below shows where the plugin's step time goes."
        )
    if st:
        phases = st.get("phases_s", {})
        order = sorted(phases.items(), key=lambda kv: kv[1])
        steps = ", ".join(f"{k} {v:.1f} s" for k, v in order)
        gap = st["value"] - st["target"]
        lines.append(
            f"- **Startup**: {st['value']:.1f} s to the first token "
            + (f"({gap:.1f} s over the goal). " if gap > 0 else "(within the goal). ")
            + f"Seconds after launch at each phase: {steps}, first token "
            f"{st['value']:.1f} s."
        )
    return lines
