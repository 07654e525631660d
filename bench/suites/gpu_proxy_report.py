"""The gpu_proxy suite's report: `gpu_proxy.md` and `gpu_proxy.png` from its JSON
(`bench/suites/gpu_proxy.py` measures; `python -m bench.run report DIR` rewrites)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.harness.phases import PHASES as ALL_PHASES
from bench.harness.report.format import CPU_NOTE, num, quick_note, ratio
from bench.harness.report.publish import regenerate

STEM = "gpu_proxy"
CAVEAT = (
    "An NVIDIA GPU through MLX's CUDA backend stands in for an Apple GPU (docs/gpu-proxy.md): the "
    "same MLX graphs, built in Python and run asynchronously, but none of the plugin's Metal "
    "kernels (its pure-MLX ops run instead) and another GPU's speeds. Only the ratios between "
    "engines of one run mean anything; no figure here is an Apple figure."
)


# A plugin step's phases; its engines do not draft (`spec_decode --profile` reports drafting).
PHASES = tuple(p for p in ALL_PHASES if p[0] != "draft_ms")


def _engines(report: dict[str, Any]) -> list[str]:
    return list(report["engines"])


def _tok_s(report: dict[str, Any], name: str, n: int) -> float | None:
    e = report["engines"][name]
    return (
        e.get("cases", {}).get(str(n), {}).get("decode_tok_s") if e.get("status") == "ok" else None
    )


def _markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    streams = s["streams"]
    names = _engines(report)
    device = next((e.get("device") for e in report["engines"].values() if e.get("device")), {})
    on_cpu = "cpu" in str(device.get("default_device", "cpu"))
    where = "MLX's CPU device" if on_cpu else "the GPU proxy (MLX's CUDA backend)"
    lines = [f"# The plugin against mlx-lm on {where}", ""]
    if s.get("quick"):
        lines += [quick_note("the tiny model"), ""]
    lines += [f"*{CPU_NOTE if on_cpu else CAVEAT}*", "",
              f"Command: `{report['command']}`. Device: {device.get('device_name', '?')} "
              f"(MLX {device.get('mlx', '?')}, default device {device.get('default_device', '?')}). "
              f"Checkpoint: random {_model(s)} bfloat16; {s['input_len']}-token prompts, "
              f"{s['output_len']} {_how(s)} tokens, EOS ignored"
              + (f", presence penalty {s['presence_penalty']}" if s.get("presence_penalty") else "")
              + ". Trees: "
              + ", ".join(f"`{k}` = {v}" for k, v in s["trees"].items()), "",
              "## Decode tok/s (same run)", "",
              "| engine | " + " | ".join(f"{n} stream{'s' if n > 1 else ''}" for n in streams) + " |",
              "|---|" + "---:|" * len(streams)]  # fmt: skip
    for name in names:
        lines.append(
            f"| {name} | " + " | ".join(num(_tok_s(report, name, n)) for n in streams) + " |"
        )
    summary = report.get("summary", {})
    for key, title in (("vs_mlx_lm", "over mlx-lm"), ("vs_first_tree", "over the first tree")):
        for name, by_n in summary.get(key, {}).items():
            lines.append(
                f"| {name} {title} | " + " | ".join(ratio(by_n.get(str(n))) for n in streams) + " |"
            )
    lines += ["", "## A plugin step, mean ms per model step", "",
              "| engine | streams | " + " | ".join(label for _, label in PHASES) + " |",
              "|---|---:|" + "---:|" * len(PHASES)]  # fmt: skip
    for name in names:
        for n, case in report["engines"][name].get("cases", {}).items():
            phases = case.get("phases")
            if phases:
                lines.append(
                    f"| {name} | {n} | "
                    + " | ".join(num(phases.get(k), 2) for k, _ in PHASES)
                    + " |"
                )
    lines += _attention(report)
    lines += _kernels(report)
    for name in names:
        e = report["engines"][name]
        if e.get("status") != "ok":
            lines += ["", f"**{name} failed** (exit {e.get('returncode')}):", "", "```",
                      e.get("log_tail", "")[-1500:], "```"]  # fmt: skip
        for n, text in e.get("profiles", {}).items():
            lines += ["", f"<details><summary>cProfile, {name}, {n} stream(s)</summary>", "",
                      "```", text.strip()[-6000:], "```", "</details>"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _attention(report: dict[str, Any]) -> list[str]:
    """The attention-alone table, when the run measured it."""
    att = report.get("attention")
    if not att or att.get("status") != "ok":
        return []
    streams = list(att["cases"])
    lines = ["", (f"## A decode step's attention alone: ms for all {att['layers']} layers at a "
             f"{att['context']}-token context"), "",
             ("The plugin's pure-MLX paged attention gathers each sequence's blocks before attending "
             "(the Metal kernels read the pages in place, as its CUDA decode kernel does); mlx-lm "
             "attends over its contiguous cache. All compiled."), "",
             "| | " + " | ".join(f"{n} stream{'s' if int(n) > 1 else ''}" for n in streams) + " |",
             "|---|" + "---:|" * len(streams)]  # fmt: skip
    rows = (("paged_ms", "paged, pure MLX", 2), ("cuda_kernel_ms", "paged, CUDA kernel", 2),
            ("cuda_kernel_max_error", "CUDA kernel, largest difference from pure MLX", 4),
            ("contiguous_ms", "contiguous cache", 2))  # fmt: skip
    for key, label, digits in rows:
        if all(key in att["cases"][n] for n in streams):
            values = " | ".join(num(att["cases"][n][key], digits) for n in streams)
            lines.append(f"| {label} | {values} |")
    return lines


def _kernels(report: dict[str, Any]) -> list[str]:
    """The CUDA kernels per step (`--kernel-streams`), when the run profiled them."""
    runs = [(name, n, k) for name, e in report["engines"].items()
            for n, k in e.get("kernels", {}).items() if "steps" in k]  # fmt: skip
    if not runs:
        return []
    lines = ["", "## CUDA kernels per step (torch's profiler, a round of its own)", "",
             ("Kernel time summed over the step's kernels; the CUDA API's host time (graph "
              "instantiation, updates, launches) beside it. A step whose kernel time is well "
              "under its wall time waits on the host."), "",
             "| engine | streams | wall ms | kernel ms | kernels | CUDA API ms |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, n, k in runs:
        lines.append(f"| {name} | {n} | {num(k['wall_ms'], 2)} | {num(k['kernel_ms'], 2)} | "
                     f"{num(k['kernels_per_step'], 0)} | {num(k['api_ms'], 2)} |")  # fmt: skip
    for name, n, k in runs:
        lines += ["", f"<details><summary>kernels and API calls, {name}, {n} stream(s)</summary>",
                  "", "| kind | name | ms a step | calls a step |", "|---|---|---:|---:|"]  # fmt: skip
        for kind in ("top_kernels", "top_api"):
            lines += [f"| {kind[4:]} | `{r['name']}` | {num(r['ms'], 3)} | {num(r['calls'], 1)} |"
                      for r in k[kind]]  # fmt: skip
        lines.append("</details>")
    return lines


def _plot(report: dict[str, Any], plt: Any) -> Any:
    streams = report["settings"]["streams"]
    names = _engines(report)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        values = [_tok_s(report, name, n) or 0 for n in streams]
        xs = [j + i * width for j in range(len(streams))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(streams))])
    ax.set_xticklabels([f"{n} stream{'s' if n > 1 else ''}" for n in streams])
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=8)
    device = next((e.get("device") for e in report["engines"].values() if e.get("device")), {})
    on_cpu = "cpu" in str(device.get("default_device", "cpu"))
    where = "MLX's CPU device" if on_cpu else "an NVIDIA GPU through MLX's CUDA backend"
    ax.set_title(f"{_model(report['settings'])} on {where}: ratios only, not Apple figures",
                 fontsize=9)  # fmt: skip
    return fig


def write_report(out: Path) -> None:
    """The markdown and plot from `out`/gpu_proxy.json."""
    regenerate(out, STEM, _markdown, _plot)


def regenerate_report(folder: Path) -> None:
    regenerate(folder, STEM, _markdown, _plot)


def _how(settings: dict[str, Any]) -> str:
    """How the tokens were drawn: greedy, or sampled (seeded: the plugin's requests)."""
    sampling = settings.get("sampling")
    if not sampling:
        return "greedy"
    seeded = ", each plugin request seeded" if settings.get("seeded") else ""
    return "sampled (" + ", ".join(f"{k} {v}" for k, v in sampling.items()) + seeded + ")"


def _model(settings: dict[str, Any]) -> str:
    """The checkpoint's name: a hybrid suite's family (`--family`) or the harness's shape."""
    family = settings.get("family")
    return f"{family} (hybrid suite's shape)" if family else settings["model_size"]
