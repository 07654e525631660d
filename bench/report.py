"""Turn results.json into results.md (tables, targets, where the time goes) and PNG plots.

Every figure in the markdown is read from the results of one `python -m bench.run`; nothing here
measures anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = ("decode_single_stream.png", "serve_concurrency.png", "startup.png")


def _ok(section: dict[str, Any] | None) -> bool:
    return bool(section) and section.get("status") == "ok"


def _runs(results: dict[str, Any], backend: str) -> dict[int, dict[str, Any]]:
    serve = results.get(f"serve_{backend}", {})
    return {r["concurrency"]: r for r in serve.get("runs", [])} if _ok(serve) else {}


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
    if _ok(off) and off.get("compute_dtype"):
        return off["compute_dtype"]
    device = str(results.get("machine", {}).get("mlx_device", "")).lower()
    return "float32" if "cpu" in device else results.get("model", {}).get("dtype")


def mlx_lm_variants(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, figures) of each mlx-lm run: as loaded, and cast to float32 when measured."""
    mlx = results.get("mlx_lm", {})
    if not _ok(mlx):
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
    if _ok(results.get("plugin_offline", {})):
        singles.append(("plugin, vllm.LLM", results["plugin_offline"]))
    for label, sec in singles:
        tok_s = sec["median_decode_tok_s"]
        decode.append({"what": label, "concurrency": 1, "per_stream_tok_s": tok_s,
                       "roofline_fraction": frac(tok_s)})  # fmt: skip
    for backend, label in (("plugin", "plugin, vllm serve"), ("cpu", "vLLM CPU, vllm serve")):
        for c, run in sorted(_runs(results, backend).items()):
            tpot = run.get("mean_tpot_ms")
            tok_s = 1e3 / tpot if tpot else None
            decode.append({"what": label, "concurrency": c, "per_stream_tok_s": tok_s,
                           "aggregate_output_tok_s": run.get("output_throughput"),
                           "roofline_fraction": frac(tok_s)})  # fmt: skip

    checks: dict[str, Any] = {}
    off = results.get("plugin_offline", {})
    variants = mlx_lm_variants(results)
    if variants and _ok(off):
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
    plugin = _runs(results, "plugin")
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
    cpu = _runs(results, "cpu")
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
    if _ok(startup) and "plugin_tiny" in startup:
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


# ------------------------------------------------------------------------------------- markdown


def _f(x: Any, nd: int = 1, unit: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _status_lines(results: dict[str, Any]) -> list[str]:
    bad = [
        (k, v) for k, v in results.items()
        if isinstance(v, dict) and v.get("status") in ("error", "skipped", "not run")
    ]  # fmt: skip
    if not bad:
        return []
    lines = ["", "Stages not in these results:", ""]
    for k, v in bad:
        lines.append(
            f"- `{k}`: {v['status']}"
            + (
                f" ({v.get('error') or v.get('reason')})"
                if v.get("error") or v.get("reason")
                else ""
            )
        )
    return lines


def _targets_section(summary: dict[str, Any]) -> list[str]:
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
            + f"TPOT ratio {_f(vc.get('tpot_ratio'), 2)}x, TTFT ratio "
            f"{_f(vc.get('ttft_ratio'), 2)}x (plugin / vLLM CPU); the step profile of the "
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


def _blas_row(blas: dict[str, Any] | None, results: dict[str, Any]) -> str:
    if not blas:
        return "| CPU BLAS for MLX | not recorded |"
    text = blas["name"]
    if blas.get("threads") is not None:
        text += f", {blas['threads']} thread{'s' if blas['threads'] != 1 else ''}"
    if blas.get("note"):
        text += f" ({blas['note']})"
    if blas.get("env"):
        text += "; " + ", ".join(f"`{k}={v}`" for k, v in blas["env"].items())
    logged = sorted(
        {line for sec in results.values() if isinstance(sec, dict)
         for line in sec.get("cpu_blas_logged", [])}
    )  # fmt: skip
    if logged:
        text += "; engine processes logged: " + "; ".join(logged)
    return f"| CPU BLAS for MLX | {text} |"


def _markdown(results: dict[str, Any]) -> str:
    s, m, mach = results.get("settings", {}), results.get("model", {}), results.get("machine", {})
    summary = results.get("summary", {})
    lines = [
        "# vllm-metal benchmarks",
        "",
        (
            f"Generated by `{s.get('command', 'python -m bench.run')}` in "
            f"{_f(s.get('total_seconds'), 0)} s. Raw figures: `results.json`. How to read and "
            "reproduce them: `README.md`."
        ),
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    if _ok(mach):
        versions = ", ".join(f"{k} {v}" for k, v in mach.get("versions", {}).items())
        load = ", ".join(f"{x:.1f}" for x in mach.get("load_average_at_start") or [])
        git = mach.get("git", {})
        lines += [
            f"| CPU | {mach['cpu']} ({mach['machine']}), {mach['logical_cores']} logical cores |",
            f"| RAM | {mach['ram_bytes'] / 2**30:.1f} GiB |",
            f"| OS | {mach['os']}, Python {mach['python']} |",
            f"| MLX device | {mach['mlx_device']} (Metal: {mach['metal_available']}) |",
            _blas_row(mach.get("cpu_blas"), results),
            f"| load average at start | {load} |",
            f"| versions | {versions} |",
            f"| git | {git.get('commit')} (dirty: {git.get('dirty')}) |",
        ]
    bw = results.get("bandwidth", {})
    if _ok(bw):
        g = bw["gbps"]
        lines.append(
            f"| memory bandwidth (GB/s) | read {g['read']:.1f}, copy {g['copy']:.1f}, MLX read "
            f"{g['mlx_read']:.1f}; MLX single-token matmul streams fp32 {g['mlx_gemv_float32']:.1f}"
            f", bf16 {g['mlx_gemv_bfloat16']:.1f}, fp16 {g['mlx_gemv_float16']:.1f} |"
        )
    if m:
        lines += [
            "",
            "## Model",
            "",
            (
                f"`{Path(m['path']).name}`: {m['architecture']}, {m['dtype']}, "
                f"{m['num_layers']} layers, hidden {m['hidden_size']}, MLP "
                f"{m['intermediate_size']}, heads {m['num_heads']}/{m['num_kv_heads']} × "
                f"{m['head_dim']}, vocab {m['vocab_size']}"
                f"{' (tied)' if m['tied_embeddings'] else ''}; {m['num_parameters'] / 1e6:.0f} M "
                f"parameters, {m['weight_bytes_per_token'] / 2**20:.0f} MiB of weights read per "
                f"decode step. Random weights. Prompts {s.get('input_len')} tokens, outputs "
                f"{s.get('output_len')} tokens (EOS ignored, greedy) everywhere."
            ),
        ]
    roof = summary.get("roofline_tok_s")
    lines += _status_lines(results)
    lines += [""] + _targets_section(summary)

    compute, roof_c = summary.get("plugin_compute_dtype"), summary.get("roofline_compute_tok_s")
    extra = ""
    if compute and m and compute != m.get("dtype") and roof_c:
        extra = (
            f" The plugin holds the weights in {compute} on this device, so its own ceiling is "
            f"{roof_c:.2f} tok/s."
        )
    lines += [
        "",
        "## Decode against the bandwidth roofline",
        "",
        (
            f"Roofline: {_f(roof, 2)} tok/s per sequence = best measured read bandwidth / weight "
            f"bytes per token in the checkpoint's dtype.{extra} Per-stream rate = 1 / TPOT."
        ),
        "",
        "| engine | concurrency | per-stream tok/s | aggregate output tok/s | of roofline |",
        "|---|---:|---:|---:|---:|",
    ]
    for d in summary.get("decode", []):
        lines.append(
            f"| {d['what']} | {d['concurrency']} | {_f(d['per_stream_tok_s'], 2)} | "
            f"{_f(d.get('aggregate_output_tok_s'), 2)} | {_pct(d['roofline_fraction'])} |"
        )

    lines += ["", "## Single stream", "",
              "| engine | TTFT ms | TPOT ms | decode tok/s | e2e s | start-up s |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    singles = [
        (label.replace("mlx-lm stream_generate", "mlx-lm `stream_generate`"), sec,
         results["mlx_lm"].get("load_s"))
        for label, sec in mlx_lm_variants(results)
    ]  # fmt: skip
    off = results.get("plugin_offline", {})
    if _ok(off):
        compute = f" ({off['compute_dtype']})" if off.get("compute_dtype") else ""
        singles.append((f"plugin `vllm.LLM`{compute}", off, off.get("engine_start_s")))
    for label, sec, start in singles:
        lines.append(
            f"| {label} | {_f(sec['median_ttft_ms'])} | {_f(sec['median_tpot_ms'], 2)} | "
            f"{_f(sec['median_decode_tok_s'], 2)} | {_f(sec['median_e2e_s'], 2)} | "
            f"{_f(start, 1)} |"
        )
    lines.append("")
    lines.append("Medians over the requests; each engine warmed up with one request first.")

    lines += [
        "",
        "## `vllm serve` under `vllm bench serve`",
        "",
        "Random dataset, fixed lengths, all requests sent at once with `--max-concurrency`.",
        "",
        (
            "| server | conc. | requests | output tok/s | TTFT mean / p99 ms | TPOT mean ms | "
            "ITL mean / p99 ms | duration s |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for backend, label in (("plugin", "plugin"), ("cpu", "vLLM CPU")):
        for c, r in sorted(_runs(results, backend).items()):
            lines.append(
                f"| {label} | {c} | {r.get('completed')}/{r.get('num_prompts')} | "
                f"{_f(r.get('output_throughput'), 2)} | {_f(r.get('mean_ttft_ms'), 0)} / "
                f"{_f(r.get('p99_ttft_ms'), 0)} | {_f(r.get('mean_tpot_ms'), 1)} | "
                f"{_f(r.get('mean_itl_ms'), 1)} / {_f(r.get('p99_itl_ms'), 1)} | "
                f"{_f(r.get('duration'), 1)} |"
            )
    vs = summary.get("plugin_vs_vllm_cpu_output_tok_s", {})
    if vs:
        lines += ["", "Plugin output tok/s over vLLM CPU's: "
                  + ", ".join(f"{v:.2f}x at {c}" for c, v in vs.items()) + "."]  # fmt: skip

    startup = results.get("startup", {})
    if _ok(startup):
        lines += [
            "",
            "## Start-up: `vllm serve` launch to first served token",
            "",
            "| server | /health s | first token s | phases (s after launch) |",
            "|---|---:|---:|---|",
        ]
        for name, st in startup.items():
            if not isinstance(st, dict) or "launch_to_first_token_s" not in st:
                continue
            phases = ", ".join(
                f"{k} {v:.1f}"
                for k, v in sorted(st.get("phases_s", {}).items(), key=lambda x: x[1])
            )
            lines.append(
                f"| {name.replace('_', ' ')} | {_f(st.get('launch_to_health_s'))} | "
                f"{_f(st['launch_to_first_token_s'])} | {phases} |"
            )

    prof = results.get("profile", {})
    if _ok(prof):
        models = prof.get("models") or [{"name": "tiny", "workloads": prof["workloads"]}]
        for entry in models:
            lines += _profile_table(entry, results)

    kern = results.get("kernels", {})
    if _ok(kern):
        cells = kern["attention_decode"].get("cells", [])
        speedups = [c["speedup"] for c in cells if "speedup" in c]
        if speedups:
            lines += [
                "",
                "## Kernels",
                "",
                (
                    "Decode paged attention, native op vs the best pure-MLX baseline: "
                    f"{min(speedups):.1f}x to {max(speedups):.1f}x over {len(cells)} cells; "
                    "full table in `attention_decode.md`."
                ),
            ]

    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in PLOTS] + [""]
    return "\n".join(lines)


def _profile_table(entry: dict[str, Any], results: dict[str, Any]) -> list[str]:
    works = entry["workloads"]
    if entry["name"] == "tiny":
        title, why = (
            "tiny model",
            ("The tiny model makes the forward cheap, so the work around it shows."),
        )
    else:
        title = f"benchmark model, `{entry.get('model_name', '')}`"
        why = "The step at the size the targets are measured at."
    lines = [
        "",
        f"## Plugin step profile ({title}, pyinstrument, in-process engine)",
        "",
        (
            f"Inclusive ms per decode step (prefill excluded), {entry.get('input_len', '?')}-token "
            f"prompts. {why} MLX's calls are invisible to the profiler: its evaluation shows as "
            "the runner's waits in `mx.async_eval` and for the logits (`to_torch`). The profiler "
            "slows the Python parts down; the unprofiled rows are the true step time. CPU time "
            "above wall time means a second thread was busy (BLAS threads, spinning included)."
        ),
        "",
        "| phase | " + " | ".join(f"batch {w['batch']}" for w in works) + " |",
        "|---|" + "---:|" * len(works),
        "| wall per step, no profiler | "
        + " | ".join(_f(w.get("unprofiled_ms_per_step"), 2) for w in works)
        + " |",
        "| CPU per step, no profiler | "
        + " | ".join(_f(w.get("unprofiled_cpu_ms_per_step"), 2) for w in works)
        + " |",
        "| wall per step, profiled | " + " | ".join(_f(w["ms_per_step"], 2) for w in works) + " |",
        "| CPU per step, profiled | "
        + " | ".join(_f(w.get("cpu_ms_per_step"), 2) for w in works)
        + " |",
    ]
    for i, row in enumerate(works[0]["phases"]):
        name = row["phase"].replace(" ", "&nbsp;", len(row["phase"]) - len(row["phase"].lstrip()))
        vals = " | ".join(_f(w["phases"][i]["ms_per_step"], 2) for w in works)
        lines.append(f"| {name} | {vals} |")
    return lines


# ---------------------------------------------------------------------------------------- plots


def _plots(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results.get("summary", {})
    written = []

    # 1. Single-stream decode rate per engine against the roofline.
    fig, ax = plt.subplots(figsize=(7, 3.8))
    rows = [d for d in summary.get("decode", []) if d["concurrency"] == 1 and d["per_stream_tok_s"]]
    ax.barh([d["what"] for d in rows], [d["per_stream_tok_s"] for d in rows], color="C0")
    for i, d in enumerate(rows):
        ax.text(d["per_stream_tok_s"], i, f" {d['per_stream_tok_s']:.2f}", va="center", fontsize=8)
    roof = summary.get("roofline_tok_s")
    if roof:
        dtype = results.get("model", {}).get("dtype", "")
        ax.axvline(roof, color="C3", ls="--", label=f"roofline, {dtype} weights {roof:.1f} tok/s")
        compute, roof_c = summary.get("plugin_compute_dtype"), summary.get("roofline_compute_tok_s")
        if compute and compute != dtype and roof_c:
            ax.axvline(roof_c, color="C3", ls=":", label=f"roofline, {compute} weights "
                       f"{roof_c:.1f} tok/s")  # fmt: skip
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("single-stream decode tokens/s (1 / TPOT)")
    ax.set_title(f"Single stream, {results.get('model', {}).get('path', '').split('/')[-1]}")
    fig.tight_layout()
    fig.savefig(out / PLOTS[0], dpi=110)
    plt.close(fig)
    written.append(PLOTS[0])

    # 2. Serving: output tok/s, TPOT and TTFT per concurrency.
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for backend, label, color in (("plugin", "plugin", "C0"), ("cpu", "vLLM CPU", "C1")):
        runs = sorted(_runs(results, backend).items())
        if not runs:
            continue
        cs = [c for c, _ in runs]
        for ax, key in zip(axes, ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")):
            ax.plot(cs, [r.get(key) or 0 for _, r in runs], "o-", color=color, label=label)
    for ax, title in zip(axes, ("output tokens/s", "mean TPOT (ms)", "mean TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.suptitle("vllm serve under vllm bench serve")
    fig.tight_layout()
    fig.savefig(out / PLOTS[1], dpi=110)
    plt.close(fig)
    written.append(PLOTS[1])

    # 3. Start-up phases per server launch.
    startup = results.get("startup", {})
    fig, ax = plt.subplots(figsize=(8, 3))
    names = []
    for i, (name, st) in enumerate(
        (k, v) for k, v in startup.items() if isinstance(v, dict) and "launch_to_first_token_s" in v
    ):
        names.append(name.replace("_", " "))
        marks = sorted(st.get("phases_s", {}).items(), key=lambda kv: kv[1])
        marks.append(("first token", st["launch_to_first_token_s"]))
        prev = 0.0
        for j, (phase, t) in enumerate(marks):
            ax.barh(i, t - prev, left=prev, color=f"C{j}", label=phase if i == 0 else None)
            prev = t
    target = results.get("summary", {}).get("targets", {}).get("tiny_startup_s", {}).get("target")
    if target:
        ax.axvline(target, color="k", ls=":", lw=1)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds after `vllm serve` launch (each bar ends at the phase's first log line)")
    if names:
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(out / PLOTS[2], dpi=110)
    plt.close(fig)
    written.append(PLOTS[2])
    return written


def write_report(results: dict[str, Any], out: Path) -> list[Path]:
    """Write results.md and the plots into ``out``; return the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(_markdown(results), encoding="utf-8")
    return [out / "results.md", *(out / p for p in _plots(results, out))]


if __name__ == "__main__":
    import json
    import sys

    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks")
    for p in write_report(json.loads((path / "results.json").read_text()), path):
        print(p)
