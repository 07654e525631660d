"""`vision.md` and `vision.png` from the results of `python -m bench.run vision`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.harness.report.format import (
    BACKEND_NAMES,
    CPU_NOTE,
    NOT_MEASURED,
    bars,
    machine_line,
    num,
    per_backend,
    quick_note,
    ratio,
    threads_cell,
    yes,
)
from bench.harness.report.publish import publish, regenerate

QUICK_NOTE = quick_note("the tests' tiny Idefics3")


def _model_line(d: dict[str, Any]) -> str:
    return (
        f"`{d['name']}` ({d['architecture']}; text model {d['text_layers']} layers, hidden "
        f"{d['text_hidden']}, MLP {d['text_intermediate']}, {d['text_heads']} query / "
        f"{d['text_kv_heads']} KV heads of {d['head_dim']}, vocabulary {d['vocab_size']:,}; "
        f"vision tower {d['vision_layers']} layers, hidden {d['vision_hidden']}, MLP "
        f"{d['vision_intermediate']}, {d['vision_heads']} heads, {d['tile_size']}x"
        f"{d['tile_size']} tiles of {d['patch_size']}x{d['patch_size']} patches "
        f"({d['patches_per_tile']:,} per tile), pixel shuffle by {d['scale_factor']} to "
        f"{d['image_tokens_per_tile']} image embeddings per tile, longest edge "
        f"{d['longest_edge']}; {d['num_parameters'] / 1e6:.1f} M parameters, "
        f"{d['vision_parameters'] / 1e6:.1f} M of them the vision tower's and "
        f"{d['connector_parameters'] / 1e6:.1f} M the connector's; {d['dtype']})"
    )


def _same(x: bool | None) -> str:
    return NOT_MEASURED + " (vLLM CPU did not run)" if x is None else yes(x)


def _cell(case: dict[str, Any] | None, key: str, fmt: str) -> str:
    """A figure of `case`, "not measured" where the case did not run, a dash where it is None."""
    if case is None:
        return NOT_MEASURED
    return "—" if case[key] is None else format(case[key], fmt)


def _agreement_lines(a: dict[str, Any], max_tokens: int) -> list[str]:
    lines = [
        (
            f"Requests answered: {per_backend(a['requests'])} (warm-up rounds included), "
            f"{a['images']} images, each sent to both backends. Same greedy token ids on both "
            f"backends for every image: **{_same(a['identical_across_backends'])}**. Distinct "
            f"answers among the images: {a['distinct_answers']} (the answer depends on the "
            "image)."
        ),
        "",
        (
            "Tokens per request (streamed token ids; the usage's `completion_tokens` and the "
            "servers' `vllm:generation_tokens_total` per request agree when full length holds): "
            f"{per_backend(a['tokens_per_request'], lambda ts: '/'.join(map(str, ts)))} "
            f"(limit {max_tokens}, EOS ignored); full length everywhere: "
            f"{per_backend(a['every_request_full_length'], yes)}. Passed: {yes(a['passed'])}."
        ),
    ]
    first = a.get("first_difference")
    if first:
        lines += [
            "",
            (
                f"Images whose answers differ: {a['images_differing']}. First difference: "
                f"image seed {first['image_seed']}, token {first['token_index']}:"
            ),
            "",
            f"- {BACKEND_NAMES['plugin']}: `{first['plugin_tokens']}` `{first['plugin_text']!r}`",
            f"- {BACKEND_NAMES['cpu']}: `{first['cpu_tokens']}` `{first['cpu_text']!r}`",
        ]
    return lines


def _tower_lines(t: dict[str, Any] | None, ttft_ms: float) -> list[str]:
    """The vision tower profile: one layer's operations, MLX against torch on one thread."""
    if not t:
        return []
    mlx, torch_ms, other = t["mlx_ms"], t["torch_1_thread_ms"], t["mlx_other_ms"]
    lines = [
        "## Where the time goes: the vision tower, one tile",
        "",
        (
            f"Measured after the servers stopped, in a process of its own: one layer of the "
            f"plugin's tower ({t['tokens_per_tile']:,} patches, hidden {t['hidden']}, MLP "
            f"{t['intermediate']}, {t['heads']} heads) operation by operation in MLX (its float32 "
            "matmuls on the plugin's CPU BLAS), against the same operations in torch on one "
            "thread, as vLLM's CPU worker runs them on its one core (torch's operators, not "
            "necessarily vLLM's exact kernels); random inputs, fastest of 3."
        ),
        "",
        "| operation (one layer) | plugin (MLX) ms | torch, 1 thread ms | MLX / torch |",
        "|---|---:|---:|---:|",
    ]
    rows = [(name, ms, torch_ms.get(name)) for name, ms in mlx.items()]
    rows.append(("sum", sum(mlx.values()), sum(torch_ms.values())))
    for name, ms, ref in rows:
        factor = f"{ms / ref:.1f}x" if ref else "—"
        lines.append(f"| {name} | {ms:.1f} | {num(ref)} | {factor} |")
    lines += [
        "",
        (
            f"Inside MLX's attention, the softmax over the {t['heads']} x "
            f"{t['tokens_per_tile']:,}² scores alone takes {other['softmax inside attention']:.1f}"
            f" ms. The whole layer in MLX: {other['one layer']:.1f} ms; the plugin's whole tower "
            f"({t['layers']} layers, the patch embedding and the connector) for one tile: "
            f"{other['whole tower, one tile']:.0f} ms, against the plugin's median TTFT of "
            f"{ttft_ms:.0f} ms."
        ),
    ]
    return lines


def _markdown(report: dict[str, Any]) -> str:
    s, summary, cases = report["settings"], report["summary"], report["cases"]
    w, a, ratios = report["workload"], report["agreement"], summary["ratios"]
    big = max(s["concurrency"])
    size, tok = w["image_size"], w["max_tokens"]
    p1, c1, pb, cb = (cases.get(f"c{n}_{be}") for n in (1, big) for be in ("plugin", "cpu"))

    def vs(x: float | None) -> str:
        return NOT_MEASURED if c1 is None else ratio(x)

    lines = [
        "# Images through `vllm serve`: the plugin against vLLM's CPU backend",
        "",
        (
            f"Generated by `python -m bench.run vision{' --quick' if s.get('quick') else ''}` in "
            f"{s['total_seconds']:.0f} s. Raw figures: `vision.json`."
        ),
        "",
        machine_line(report.get("machine") or {}),
        "",
        *([QUICK_NOTE, ""] if s.get("quick") else []),
        CPU_NOTE,
        "",
        f"Model: {_model_line(report['model'])}, random weights (seed 0).",
        "",
        (
            f"Each backend is one `vllm serve` (`--dtype {s['dtype']} --max-model-len "
            f"{s['max_model_len']} --max-num-seqs {big} --max-num-batched-tokens "
            f"{s['max_num_batched_tokens']} --kv-cache-memory-bytes {s['kv_cache_memory_bytes']} "
            f"--limit-mm-per-prompt '{{\"image\": 1}}'"
            f"{' --enforce-eager' if s.get('enforce_eager') else ''}`, the same for both; "
            "`VLLM_TARGET_DEVICE=cpu` for vLLM's), driven with the `openai` client: a streamed "
            "`chat.completions.create` whose user message is one `image_url` part "
            f"(`tiny_image(seed, ({size}, {size}))` as a PNG data URL) and the text "
            f'"{w["question"]}", `temperature=0`, `max_tokens={tok}`, '
            '`extra_body={"ignore_eos": True, "return_token_ids": True}`. Every request decodes '
            f"{tok} tokens and has an image of its own (the same image for both backends in a "
            "round): an image sent again would hit vLLM's multimodal processor cache and its "
            "prefix cache."
        ),
        "",
        (
            f"TTFT: send -> first streamed chunk with a generated token, one request at a time, "
            f"median of {s['c1_rounds']} request(s); it includes the API server's PNG decoding "
            "and image preprocessing (the same vLLM code on both backends), the vision tower, "
            "the connector and the prefill. Decode tok/s of a request: generated tokens after "
            "the first chunk's / (last token's arrival - first token's); at 1 concurrent over "
            f"the TTFT requests, at {big} concurrent over {s['c8_rounds']} round(s) of {big} "
            "requests released together (median over all their requests). Both servers run side "
            "by side and get each round in turn (the first backend alternating), after one "
            "warm-up round of each size; a round starts once the previous round's server is idle "
            "again."
        ),
        "",
        "## Plugin / vLLM CPU (same run)",
        "",
        "| | plugin (MLX) | vLLM CPU | plugin / vLLM CPU |",
        "|---|---:|---:|---:|",
        (
            f"| TTFT, 1 image, 1 concurrent (median ms; lower is better) | "
            f"{p1['median_ttft_ms']:.0f} | {_cell(c1, 'median_ttft_ms', '.0f')} | "
            f"{vs(ratios['ttft_plugin_vs_cpu'])} |"
        ),
        (
            f"| decode tok/s per request, 1 concurrent (median) | "
            f"{num(p1['median_decode_tok_s'])} | {_cell(c1, 'median_decode_tok_s', '.1f')} | "
            f"{vs(ratios['decode_c1_plugin_vs_cpu'])} |"
        ),
        (
            f"| decode tok/s per request, {big} concurrent (median) | "
            f"{num(pb['median_decode_tok_s'])} | {_cell(cb, 'median_decode_tok_s', '.1f')} | "
            f"{vs(ratios[f'decode_c{big}_plugin_vs_cpu'])} |"
        ),
        (
            f"| TTFT, {big} images at once (median ms) | {pb['median_ttft_ms']:.0f} | "
            f"{_cell(cb, 'median_ttft_ms', '.0f')} | {vs(ratios[f'ttft_c{big}_plugin_vs_cpu'])} |"
        ),
        (
            f"| output tok/s of a {big}-request round (all tokens / round wall time) | "
            f"{pb['output_tok_s']:.1f} | {_cell(cb, 'output_tok_s', '.1f')} | "
            f"{vs(ratios[f'output_c{big}_plugin_vs_cpu'])} |"
        ),
        "",
        (
            "A TTFT ratio below 1 and a tok/s ratio above 1 mean the plugin is faster. "
            "*First-token spread*: how far apart a round's first tokens came; a request whose "
            "prompt a backend prefilled alone before the others decodes while their images are "
            "encoded, at a fraction of the rate."
        ),
        "",
        "## Agreement (every request, both backends)",
        "",
        *_agreement_lines(a, tok),
        "",
        "## Cases",
        "",
        (
            "| case | rounds | TTFT ms, median / max | decode tok/s per request, median / min | "
            "output tok/s (round) | first-token spread s | token chunks per request | prompt "
            "tokens | preemptions | server "
            "CPU s per round | busy after a round, s | other server's CPU s per round (max) | "
            "load average (1 min) after a round | round wall s |"
        ),
        "|---|---:|---|---|---:|---|---|---|---:|---|---:|---:|---|---|",
    ]
    for name, c in cases.items():
        lines.append(
            f"| {name} | {c['rounds']} | {c['median_ttft_ms']:.0f} / {c['max_ttft_ms']:.0f} | "
            f"{num(c['median_decode_tok_s'])} / {num(c['min_decode_tok_s'])} | "
            f"{c['output_tok_s']:.1f} | "
            f"{', '.join(num(x, 2) for x in c['first_token_spread_s'])} | "
            f"{'/'.join(map(str, c['token_chunks_per_request']))} | "
            f"{'/'.join(map(str, c['prompt_tokens']))} | {c['preemptions']:g} | "
            f"{', '.join(num(x) for x in c['server_cpu_s'])} | "
            f"{num(c.get('busy_after_round_s'), 2)} | "
            f"{num(max(c.get('other_server_cpu_s') or [None]), 2)} | "
            f"{', '.join(num(x, 1) for x in c['load_average_1m'])} | "
            f"{', '.join(num(x, 2) for x in c['round_wall_s'])} |"
        )
    lines += ["", *_tower_lines(report.get("tower_profile"), p1["median_ttft_ms"])]
    lines += [
        "",
        "## Servers",
        "",
        (
            "| backend | platform | launch to /health s (both starting at once) | warm-up rounds "
            f"s (1, {big} concurrent) | threads |"
        ),
        "|---|---|---:|---|---|",
    ]
    for be, info in report["servers"].items():
        warm = ", ".join(num(x, 2) for x in info.get("warmup_s", []))
        lines.append(
            f"| {BACKEND_NAMES[be]} | {info.get('platform') or '—'} | "
            f"{num(info['launch_to_health_s'])} | {warm} | {threads_cell(be, info)} |"
        )
    lines += ["", "![vision-language TTFT and decode](vision.png)"]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], plt: Any) -> Any:
    cases, ratios = report["cases"], report["summary"]["ratios"]
    levels = report["settings"]["concurrency"]
    ran = [be for be in BACKEND_NAMES if f"c1_{be}" in cases]
    colors = ["tab:blue", "tab:gray"][: len(ran)]
    names = [BACKEND_NAMES[be] for be in ran]
    fig, axes = plt.subplots(1, 1 + len(levels), figsize=(3.4 * (1 + len(levels)), 4.2))
    ax = axes[0]
    bars(ax, names, [cases[f"c1_{be}"]["median_ttft_ms"] for be in ran], colors, ".0f")
    ax.set_ylabel("ms (lower is better)", fontsize=9)
    ax.set_title(f"TTFT, 1 image\nplugin / CPU {ratio(ratios['ttft_plugin_vs_cpu'])}",
                 fontsize=10)  # fmt: skip
    for ax, n in zip(axes[1:], levels):
        values = [cases[f"c{n}_{be}"]["median_decode_tok_s"] or 0.0 for be in ran]
        bars(ax, names, values, colors, ".1f")
        ax.set_ylabel("decode tok/s per request (higher is better)", fontsize=9)
        label = "1 request" if n == 1 else f"{n} concurrent requests"
        ax.set_title(f"decode, {label}\nplugin / CPU "
                     f"{ratio(ratios[f'decode_c{n}_plugin_vs_cpu'])}", fontsize=10)  # fmt: skip
    w = report["workload"]
    title = (f"Idefics3 with images on CPU, plugin vs vLLM CPU ({w['image_size']}x"
             f"{w['image_size']} image, {w['max_tokens']} tokens)")  # fmt: skip
    if report["settings"].get("quick"):
        title += " (quick run: tiny Idefics3)"
    fig.suptitle(title)
    return fig


def write_report(report: dict[str, Any], out: Any) -> list[Any]:
    return publish(report, out, "vision", _markdown, _plot)


def regenerate_report(folder: Path) -> None:
    """The markdown and plot again from the JSON in `folder`."""
    regenerate(folder, "vision", _markdown, _plot)
