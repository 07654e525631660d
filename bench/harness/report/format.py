"""Markdown cells and plot pieces the suites' reports share: numbers, the machine line, where a
backend's threads ran, the decode-round cases and workers tables."""

from __future__ import annotations

from typing import Any

BACKEND_NAMES = {"plugin": "plugin (MLX)", "cpu": "vLLM CPU"}
CPU_NOTE = (
    "These are CPU figures: the plugin runs on MLX's CPU device here (no GPU on this machine), so "
    "they say nothing about the plugin's speed on an Apple GPU."
)
# The columns of `worker_cells`.
WORKER_COLUMNS = (
    "platform | engine start s | warm-up rounds s | KV cache tokens | max concurrency (logged) | "
    "resident memory when idle"
)


def quick_note(what: str) -> str:
    """The line a `--quick` report starts with: `what` ran, and its figures claim nothing."""
    return f"*Quick run on {what}: it checks the harness; its figures are no speed claim.*"


# A figure of a peer that a `--quick` run without `--peers` did not run.
NOT_MEASURED = "not measured"


def num(x: Any, nd: int = 1) -> str:
    """`x` with `nd` decimals, or a dash for None."""
    return "—" if x is None else f"{x:.{nd}f}"


def ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def millions(n: int) -> str:
    return f"{n / 1e6:.0f}" if n >= 1e7 else f"{n / 1e6:.2f}"


def gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f} GiB"


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def per_backend(values: dict[str, Any], show: Any = str) -> str:
    """`plugin (MLX) X, vLLM CPU Y` for a {backend: value} dict."""
    return ", ".join(f"{BACKEND_NAMES[be]} {show(v)}" for be, v in values.items())


def machine_line(m: dict[str, Any]) -> str:
    """One sentence: the CPU, cores, RAM, MLX device, CPU BLAS, load and commit of a run."""
    load = ", ".join(f"{x:.1f}" for x in m.get("load_average_at_start") or [])
    git = m.get("git") or {}
    commit = (git.get("commit") or "unknown")[:7] + (" (dirty tree)" if git.get("dirty") else "")
    blas = (m.get("cpu_blas") or {}).get("describe", "unknown")
    return (
        f"Measured on {m.get('cpu', 'an unknown CPU')} ({m.get('machine')}, "
        f"{m.get('logical_cores')} logical cores, {m.get('ram_bytes', 0) / 2**30:.0f} GiB RAM), "
        f"MLX device {m.get('mlx_device')}, CPU BLAS {blas}; load average {load} at start; "
        f"commit {commit}."
    )


def threads_cell(backend: str, w: dict[str, Any]) -> str:
    """Where a worker's compute threads ran: vLLM's CPU worker binds its OpenMP threads to the
    cores it logs; the plugin's engine core logs MLX's CPU BLAS and its threads."""
    if backend == "cpu":
        cores = w.get("omp_bound_cores")
        return "—" if cores is None else f"torch's OpenMP bound to core(s) {cores}"
    blas = w.get("cpu_blas_logged") or []
    return f"MLX's BLAS: {blas[0]}" if blas else "—"


def cases_table(cases: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines of a table of `bench.harness.decode_rounds.run`'s cases, one row each."""
    lines = [
        (
            "| case | rounds | median TPOT ms | decode tok/s | output tok/s | median TTFT ms | "
            "busy after a round, s | round s |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in cases.items():
        lines.append(
            f"| {name} | {c['rounds']} | {c['median_tpot_ms']:.1f} | {c['decode_tok_s']:.1f} | "
            f"{c['output_tok_s']:.1f} | {c['median_ttft_ms']:.0f} | "
            f"{num(c.get('busy_after_call_s'), 2)} | {', '.join(num(x, 2) for x in c['round_s'])} |"
        )
    return lines


def worker_cells(w: dict[str, Any]) -> str:
    """A decode-round worker's `WORKER_COLUMNS` as markdown cells: platform, engine start,
    warm-up rounds, the KV cache size and maximum concurrency it logged (`kv`), idle memory."""
    warm = ", ".join(num(x, 2) for x in w.get("warmup_s", []))
    kv = w.get("kv", {})
    tokens = kv.get("kv_cache_tokens")
    return (
        f"{w.get('platform', '—')} | {num(w['engine_start_s'])} | {warm} | "
        f"{'—' if tokens is None else f'{tokens:,}'} | {num(kv.get('max_concurrency'), 2)}x | "
        f"{gib(w.get('idle_rss_bytes'))}"
    )


def bars(ax: Any, labels: list[str], values: list[float], colors: list[str], fmt: str) -> None:
    """Labelled bars on a matplotlib axis, the value printed above each."""
    drawn = ax.bar(labels, values, color=colors)
    for bar, v in zip(drawn, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, format(v, fmt), ha="center", va="bottom",
                fontsize=9)  # fmt: skip
    ax.set_ylim(0, max(values) * 1.18)


def speedup_bars(plt: Any, speedups: dict[str, float], xlabel: str) -> Any:
    """A figure of horizontal bars, one per ratio (green at or above 1x, red below), each
    labelled with its value, and a line at 1x."""
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(1, len(speedups)) + 1.2))
    names = list(speedups)
    values = [speedups[n] for n in names]
    ax.barh(names, values, color=["tab:green" if v >= 1.0 else "tab:red" for v in values])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}x", va="center")
    return fig
