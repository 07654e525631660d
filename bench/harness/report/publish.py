"""Where a benchmark's results go: `<stem>.json` (raw figures), `<stem>.md` and `<stem>.png`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Markdown = Callable[[dict[str, Any]], str]
# (report, matplotlib.pyplot) -> the figure to save as <stem>.png
Plot = Callable[[dict[str, Any], Any], Any]


def publish(
    report: dict[str, Any], out: Path, stem: str, markdown: Markdown, plot: Plot
) -> list[Path]:
    """Write the report's JSON, markdown and plot (when matplotlib is there) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    md = out / f"{stem}.md"
    md.write_text(markdown(report))
    try:
        import matplotlib
    except ImportError:
        return [md]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot(report, plt)
    fig.tight_layout()
    png = out / f"{stem}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [md, png]


def targets_table(targets: dict[str, dict[str, Any]], relation: str) -> list[str]:
    """Markdown lines of a `## Targets` section: each ratio against its goal (`relation` is
    "≥" or "≤"), met or missed."""
    lines = ["## Targets", "", "| target | goal | measured | status |", "|---|---:|---:|---|"]
    for key, t in targets.items():
        if t["measured"] is None:  # a case it needs did not run (`--quick` without `--peers`)
            lines.append(f"| {key} | {relation} {t['goal']}x | not measured | — |")
            continue
        status = "met" if t["met"] else "missed"
        lines.append(f"| {key} | {relation} {t['goal']}x | {t['measured']:.2f}x | {status} |")
    return lines


def regenerate(folder: Path, stem: str, markdown: Markdown, plot: Plot) -> None:
    """The markdown and plot again from folder/<stem>.json (`python -m bench.run report DIR`)."""
    folder = Path(folder)
    publish(json.loads((folder / f"{stem}.json").read_text()), folder, stem, markdown, plot)
