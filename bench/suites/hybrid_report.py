"""`hybrid.md` and `hybrid.png` from the results of `python -m bench.run hybrid`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harness.report.format import (
    BACKEND_NAMES,
    NOT_MEASURED,
    WORKER_COLUMNS,
    cases_table,
    gib,
    machine_line,
    millions,
    num,
    quick_note,
    threads_cell,
    worker_cells,
)
from bench.harness.report.publish import publish, regenerate
from bench.suites.hybrid import PEER_DEVIATES

QUICK_NOTE = quick_note("the tiny models")
FAMILY_NAMES = {
    "qwen3_next": "Qwen3-Next",
    "qwen3_5": "Qwen3.5",
    "granite": "Granite 4.0-H",
    "deepseek_v3": "DeepSeek-V3",
    "gemma4": "Gemma 4",
    "lfm2": "LFM2",
}
# Why a family that is neither a hybrid nor latent attention is in this suite.
FAMILY_NOTES = {
    "gemma4": (
        "Gemma 4 (text) is in this suite for its layer mix, not for a state: sliding-window and "
        "full-attention layers with their own KV heads and head sizes, which vLLM puts in KV-cache "
        "groups of their own as it does a hybrid's attention and state layers, and layers that "
        "compute no K/V and read an earlier layer's. At these lengths every sliding layer attends "
        "over its whole context (the window never slides)."
    ),
}
NOT_MEASURED_PEER = "vLLM CPU: not measured (`--quick` without `--peers` runs the plugin alone)."
# Why vLLM's CPU backend is not run, by family (those without a peer in `hybrid.BACKENDS`).
NO_CPU_PEER = {
    "qwen3_next": (
        "vLLM's CPU backend is not run for Qwen3-Next: its Gated DeltaNet CPU kernel "
        "(`cpu_gdn_attention_core`) asserts bfloat16 inputs, so its engine dies on the first step "
        'of a float32 model ("CPU GDN attention requires BF16"). It does run the model in '
        "bfloat16, but that is another computation than the plugin's float32 (other matmul "
        "kernels and precision, no meaningful agreement check), so the plugin runs alone here."
    ),
    "qwen3_5": (
        "vLLM's CPU backend is not run for Qwen3.5: on Linux vLLM cannot inspect the model at all. "
        "Its `qwen3_5` model module imports `qwen3_vl`, which imports transformers' "
        "torchvision-only Qwen2-VL image processor, and torchvision does not load beside torch "
        "2.13.0+cpu, so `ModelConfig` fails (\"Model architectures ['Qwen3_5ForCausalLM'] failed "
        'to be inspected"; the published wrapper fails the same way) before any engine starts, '
        "in any dtype. The plugin runs alone here."
    ),
}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _pattern(types: list[str]) -> str:
    short = {
        "linear_attention": "L",
        "full_attention": "A",
        "mamba": "M",
        "attention": "A",
        "mla": "A",
        "sliding_attention": "S",
        "conv": "C",
    }
    return "".join(short.get(t, "?") for t in types)


def _latent_model_line(d: dict[str, Any]) -> str:
    m = d["mixer_shape"]
    return (
        f"`{d['name']}` ({d['architecture']}, {d['num_layers']} MLA layers of {d['num_heads']} "
        f"heads: query LoRA rank {m['q_lora_rank']}, latent {m['kv_lora_rank']} + rotary "
        f"{m['rope_dim']}, nope / value head dims {m['nope_dim']} / {m['value_dim']}; hidden "
        f"{d['hidden_size']}; {m['dense_layers']} dense layer (intermediate "
        f"{m['dense_intermediate_size']}), then per layer {d['num_experts']} experts of "
        f"intermediate {d['expert_intermediate_size']}, top-{d['experts_per_token']}, and a shared "
        f"expert of {d['shared_intermediate_size']}; vocabulary {d['vocab_size']:,}; "
        f"{millions(d['num_parameters'])} M parameters, "
        f"{millions(d['active_parameters_per_token'])} M active per token; latent KV "
        f"{d['kv_bytes_per_token'] / 1024:g} KiB per token; {d['dtype']})"
    )


def _names(names: list[str]) -> str:
    """Names joined as "A", "A and B", "A, B and C"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _mlp(d: dict[str, Any]) -> str:
    if d["num_experts"] is None:
        return f"per layer a dense MLP of intermediate {d['intermediate_size']}"
    return (
        f"per layer {d['num_experts']} experts of intermediate {d['expert_intermediate_size']}, "
        f"top-{d['experts_per_token']}, and a shared expert of {d['shared_intermediate_size']}"
    )


def _sliding_model_line(d: dict[str, Any]) -> str:
    m = d["mixer_shape"]
    shared = m["kv_shared_layers"]
    wide = " (twice as wide in the layers that compute no K/V)" if m["double_wide_mlp"] else ""
    return (
        f"`{d['name']}` ({d['architecture']}, {d['num_layers']} layers "
        f"`{_pattern(d['layer_types'])}`: {m['sliding_layers']} sliding-window layers (window "
        f"{m['window']}, {m['sliding_kv_heads']} KV head{'s' if m['sliding_kv_heads'] != 1 else ''} "
        f"of {m['sliding_head_dim']}) and {m['full_layers']} full-attention layers "
        f"({m['full_kv_heads']} KV head{'s' if m['full_kv_heads'] != 1 else ''} of "
        f"{m['full_head_dim']}), {d['num_heads']} query heads; the last {shared} layers compute no "
        f"K/V and read the last earlier layer's of their kind; hidden {d['hidden_size']}; "
        f"per-layer inputs of {m['per_layer_input']}; {_mlp(d)}{wide}; vocabulary "
        f"{d['vocab_size']:,}{' (tied)' if d['tied_embeddings'] else ''}; "
        f"{millions(d['num_parameters'])} M parameters, "
        f"{millions(d['active_parameters_per_token'])} M active per token (the per-layer "
        f"embedding is only gathered); KV {d['kv_bytes_per_token'] / 1024:g} KiB per token while "
        f"within the window; {d['dtype']})"
    )


def model_line(d: dict[str, Any]) -> str:
    m = d["mixer_shape"]
    if d["mixer"] == "MLA":
        return _latent_model_line(d)
    if d["mixer"] == "sliding window":
        return _sliding_model_line(d)
    if d["mixer"] == "Gated DeltaNet":
        mixer = (
            f"{d['state_layers']} Gated DeltaNet layers ({m['key_heads']} key heads of "
            f"{m['key_head_dim']}, {m['value_heads']} value heads of {m['value_head_dim']})"
        )
    elif d["mixer"] == "short convolution":
        mixer = (
            f"{d['state_layers']} gated short-convolution layers (window {m['window']}, "
            f"{m['channels']} channels)"
        )
    else:
        mixer = (
            f"{d['state_layers']} Mamba-2 layers ({m['heads']} heads of {m['head_dim']}, state "
            f"{m['state']}, {m['groups']} group{'s' if m['groups'] != 1 else ''})"
        )
    return (
        f"`{d['name']}` ({d['architecture']}, {d['num_layers']} layers "
        f"`{_pattern(d['layer_types'])}`: {mixer} and {d['attention_layers']} attention "
        f"layer{'s' if d['attention_layers'] != 1 else ''} "
        f"({d['num_heads']} query / "
        f"{d['num_kv_heads']} KV heads of {d['head_dim']}); hidden {d['hidden_size']}; {_mlp(d)}; "
        f"vocabulary {d['vocab_size']:,}{' (tied)' if d['tied_embeddings'] else ''}; "
        f"{millions(d['num_parameters'])} M parameters, "
        f"{millions(d['active_parameters_per_token'])} M active per token; state "
        f"{_mib(d['state_bytes_per_request'])} per request, attention KV "
        f"{d['kv_bytes_per_token'] / 1024:g} KiB per token; {d['dtype']})"
    )


def _idle_memory_lines(rows: list[dict[str, Any]] | None) -> list[str]:
    """Each backend's idle resident memory at two KV cache sizes, and what the larger adds."""
    if not rows:
        return []
    sizes = sorted({r["kv_cache_bytes"] for r in rows})
    by = {(r["backend"], r["kv_cache_bytes"]): r["idle_rss_bytes"] for r in rows}
    head = " | ".join(f"idle, KV cache {b / 2**30:g} GiB" for b in sizes)
    lines = [
        "",
        "Memory held by an idle engine (started, no request; one engine at a time):",
        "",
        f"| backend | {head} | added by {(sizes[-1] - sizes[0]) / 2**30:g} GiB more KV cache |",
        "|---|" + "---:|" * (len(sizes) + 1),
    ]
    for be in dict.fromkeys(r["backend"] for r in rows):
        cells = " | ".join(gib(by[(be, b)]) for b in sizes)
        # One size only (`--quick` without `--peers`): nothing to subtract.
        added = gib(by[(be, sizes[-1])] - by[(be, sizes[0])]) if len(sizes) > 1 else NOT_MEASURED
        lines.append(f"| {BACKEND_NAMES[be]} | {cells} | {added} |")
    return lines


def _family_section(family: str, r: dict[str, Any], s: dict[str, Any], big: int) -> list[str]:
    cases, backends = r["cases"], list(r["workers"])
    name = FAMILY_NAMES[family]
    lines = [f"## {name}", ""]
    run = r.get("earlier_run")
    if run:
        commit = ((run.get("machine") or {}).get("git") or {}).get("commit") or "unknown"
        lines += [f"Kept from an earlier run: `{run['command']}` (commit {commit[:7]}).", ""]
    lines += [f"Model: {model_line(r['model'])}, random weights.", ""]
    if family in FAMILY_NOTES:
        lines += [FAMILY_NOTES[family], ""]
    if "cpu" in backends:
        lines += [
            "Plugin / vLLM CPU, side by side in the same run:",
            "",
            (
                "| streams | plugin decode tok/s | vLLM CPU decode tok/s | plugin / vLLM CPU | "
                "plugin TPOT ms | vLLM CPU TPOT ms |"
            ),
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n in sorted({c["streams"] for c in cases.values()}):
            p, c = cases[f"c{n}_plugin"], cases[f"c{n}_cpu"]
            lines.append(
                f"| {n} | {num(p['decode_tok_s'])} | {num(c['decode_tok_s'])} | "
                f"{num(s['ratios'][f'c{n}_plugin_vs_cpu'], 2)}x | {num(p['median_tpot_ms'])} | "
                f"{num(c['median_tpot_ms'])} |"
            )
    else:
        peer = "ratios" in s  # the family has a vLLM CPU peer, not run here
        lines += [
            NOT_MEASURED_PEER if peer else NO_CPU_PEER[family],
            "",
            "| streams | plugin decode tok/s | plugin TPOT ms |",
            "|---:|---:|---:|",
        ]
        for n in sorted({c["streams"] for c in cases.values()}):
            p = cases[f"c{n}_plugin"]
            lines.append(f"| {n} | {num(p['decode_tok_s'])} | {num(p['median_tpot_ms'])} |")
    lines += ["", f"{big} streams against 1 (decode tok/s):", ""]
    lines += [f"- {BACKEND_NAMES[be]}: {v:.2f}x" for be, v in s[f"c{big}_vs_c1"].items()]
    a = r.get("agreement")
    if family in PEER_DEVIATES:
        lines += ["", PEER_DEVIATES[family]]
    if a:
        lines += [
            "",
            (
                f"Agreement (one {big}-stream round, plugin vs vLLM CPU): {a['identical']} of "
                f"{a['requests']} greedy continuations identical, first token equal in "
                f"{a['first_token_equal']}; tokens in common from the start: "
                f"{', '.join(str(x) for x in a['common_prefix_tokens'])}; "
                f"{a['distinct_continuations']} distinct continuations on the plugin. "
                f"Passed (every first token equal): {'yes' if a['passed'] else 'NO'}."
            ),
        ]
    lines += ["", *cases_table(cases)]
    lines += [
        "",
        f"| backend | {WORKER_COLUMNS} | threads |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for be, w in r["workers"].items():
        lines.append(f"| {BACKEND_NAMES[be]} | {worker_cells(w)} | {threads_cell(be, w)} |")
    lines += _idle_memory_lines(r.get("idle_memory"))
    ok = s["concurrency_ok"]
    lines += [
        "",
        (
            f"Every engine holds {big} requests of {r['engine']['max_model_len']} tokens at once "
            f"(vLLM's logged maximum concurrency ≥ {big}), so none was preempted."
            if ok
            else f"**An engine holds fewer than {big} requests at once: rounds may have "
            "preempted.**"
        ),
    ]
    return lines


def _runs_lines(report: dict[str, Any]) -> list[str]:
    """Which run measured which family: this one, and any earlier ones whose families were kept
    (`bench.harness.stages.keep_earlier_families`)."""
    st, fams = report["settings"], report["families"]
    command = f"python -m bench.run hybrid{' --quick' if st.get('quick') else ''}"
    now = [FAMILY_NAMES[f] for f, r in fams.items() if "earlier_run" not in r]
    earlier: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for f, r in fams.items():
        if "earlier_run" in r:
            key = json.dumps(r["earlier_run"], sort_keys=True)
            earlier.setdefault(key, (r["earlier_run"], []))[1].append(FAMILY_NAMES[f])
    if not earlier:
        return [
            f"Generated by `{command}` in {st['total_seconds']:.0f} s. Raw figures: `hybrid.json`.",
            "",
            machine_line(report.get("machine") or {}),
        ]
    lines = [
        (
            f"Generated by `{command}` in {st['total_seconds']:.0f} s ({_names(now)}); the other "
            "families are kept from earlier runs of the same settings, below. Raw figures: "
            "`hybrid.json`."
        ),
        "",
        machine_line(report.get("machine") or {}),
    ]
    cpu = (report.get("machine") or {}).get("cpu")
    for run, names in earlier.values():
        seconds = f" in {run['total_seconds']:.0f} s" if run.get("total_seconds") else ""
        other = (run["machine"] or {}).get("cpu") != cpu
        lines += [
            "",
            f"{_names(names)}: `{run['command']}`{seconds}. {machine_line(run['machine'] or {})}"
            + (" Another CPU than this run's: its rows and this run's do not compare." if other
               else ""),
        ]  # fmt: skip
    return lines


def _title(fams: dict[str, Any]) -> str:
    kinds = "Hybrid and latent-attention"
    if any(f in FAMILY_NOTES for f in fams):
        kinds = "Hybrid, latent-attention and sliding-window"
    return f"{kinds} decode"


def _markdown(report: dict[str, Any]) -> str:
    st, summary, fams = report["settings"], report["summary"], report["families"]
    big = max(st["streams"])
    lines = [
        f"# {_title(fams)}: {', '.join(FAMILY_NAMES[f] for f in fams)}",
        "",
        *_runs_lines(report),
        "",
        *([QUICK_NOTE, ""] if st.get("quick") else []),
        (
            f"Greedy decoding, EOS ignored, {st['input_len']}-token prompts and {st['output_len']} "
            f"output tokens, {st['dtype']}, the same engine arguments on every engine (prefix "
            f"caching off, `kv_cache_memory_bytes` "
            f"{next(iter(fams.values()))['engine']['kv_cache_memory_bytes'] / 2**20:.0f} MiB). "
            f"1 stream: {st['c1_rounds']} round(s) of one request; {big} streams: "
            f"{st['c16_rounds']} round(s) of {big} requests at once, after one warm-up round of "
            "each size. Decode tok/s = streams / median TPOT (prefill excluded); output tok/s = "
            "tokens / wall time of a round (prefill included). Where two backends run, their "
            "workers run side by side and get each round in turn (the first backend alternating); "
            "a round starts once the previous round's worker is idle again. Random weights "
            "(matrices from N(0, 0.02)): these figures are about the machinery, not any released "
            "checkpoint's quality. MLX here runs on the CPU: nothing in this report is an Apple "
            "GPU figure."
        ),
        "",
        (
            "Resident memory when idle: the worker's process and its engine core's, once the "
            "engine is up (weights loaded, warm-up done, KV cache allocated) and before any "
            "request. vLLM's CPU backend writes its whole KV cache at allocation; the plugin "
            "reserves its pool and the OS commits a page when a step first writes it "
            "(`kv.pool.uncommitted`), so an idle plugin holds little of it."
        ),
        "",
        "| family | streams | plugin decode tok/s | vLLM CPU decode tok/s | plugin / vLLM CPU |",
        "|---|---:|---:|---:|---:|",
    ]
    for family, r in fams.items():
        for n in st["streams"]:
            p = r["cases"][f"c{n}_plugin"]
            c = r["cases"].get(f"c{n}_cpu")
            ratio = summary[family].get("ratios", {}).get(f"c{n}_plugin_vs_cpu")
            peer = "ratios" in summary[family]  # a vLLM CPU peer, measured or not
            missing = NOT_MEASURED if peer else "not run"
            no_ratio = NOT_MEASURED if peer and c is None else "—"
            lines.append(
                f"| {FAMILY_NAMES[family]} | {n} | {num(p['decode_tok_s'])} | "
                f"{num(c['decode_tok_s']) if c else missing} | "
                f"{num(ratio, 2) + 'x' if ratio is not None else no_ratio} |"
            )
    for family, r in fams.items():
        lines += ["", *_family_section(family, r, summary[family], big)]
    lines += ["", "![Hybrid decode throughput](hybrid.png)"]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], plt: Any) -> Any:
    fams, summary = report["families"], report["summary"]
    streams = report["settings"]["streams"]
    # One column per family, one row per stream count.
    fig, axes = plt.subplots(len(streams), len(fams), figsize=(2.9 * len(fams), 3.6 * len(streams)),
                             squeeze=False)  # fmt: skip
    colors = {"plugin": "tab:blue", "cpu": "tab:gray"}
    for row, n in enumerate(streams):
        for col, family in enumerate(fams):
            ax = axes[row][col]
            cases = fams[family]["cases"]
            backends = [be for be in BACKEND_NAMES if f"c{n}_{be}" in cases]
            values = [cases[f"c{n}_{be}"]["decode_tok_s"] for be in backends]
            bars = ax.bar([BACKEND_NAMES[be] for be in backends], values,
                          color=[colors[be] for be in backends])  # fmt: skip
            for bar, v in zip(bars, values):
                ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom")
            label = "1 stream" if n == 1 else f"{n} streams"
            ratio = summary[family].get("ratios", {}).get(f"c{n}_plugin_vs_cpu")
            has_peer = "ratios" in summary[family]
            sub = (f"plugin / CPU {num(ratio, 2)}x" if ratio is not None
                   else "vLLM CPU not measured" if has_peer else "no vLLM CPU peer")  # fmt: skip
            ax.set_title(f"{FAMILY_NAMES[family]}, {label}\n{sub}", fontsize=9)
            ax.set_ylim(0, max(values) * 1.18)
            ax.tick_params(axis="x", labelsize=8)
    for row in axes:
        row[0].set_ylabel("decode tok/s (streams / TPOT)")
    title = f"{_title(fams).replace('latent-attention', 'MLA')} (MLX on CPU), plugin vs vLLM CPU"
    if report["settings"].get("quick"):
        title += " (quick run: tiny models)"
    fig.suptitle(title)
    return fig


def write_report(report: dict[str, Any], out: Any) -> list[Any]:
    return publish(report, out, "hybrid", _markdown, _plot)


def regenerate_report(folder: Path) -> None:
    """The markdown and plot again from the JSON in `folder`."""
    regenerate(folder, "hybrid", _markdown, _plot)
