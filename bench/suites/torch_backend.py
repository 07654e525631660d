"""The plugin's torch backend against vLLM's CPU backend and the plugin's MLX backend: decode
throughput at 1 and 32 streams, one run, and how far the three engines' greedy tokens agree.

Three engines serve the same checkpoint with the same engine arguments:

- torch: the plugin with `VLLM_METAL_BACKEND=mps` (vLLM's own model classes on torch, attention
  through the plugin's paged kernels; torch's `cpu` device off a Mac);
- vLLM CPU: vLLM's own CPU backend (`VLLM_TARGET_DEVICE=cpu`; the plugin is not loaded);
- MLX: the plugin's default backend (`VLLM_METAL_BACKEND=mlx`, mlx-lm's layers on MLX).

The model is a random-weight Qwen3 from the harness's checkpoint writer
(`bench/harness/checkpoints.py`, `--model-size 0.17b`): 8 layers of Qwen3-0.6B's width (hidden 1024, MLP 3072, 16 query / 8 KV
heads, head_dim 64 as vLLM's CPU backend takes no 16 or 32), an untied 32,000-row vocabulary,
weights from N(0, 0.1): 166 M parameters. Not the main run's 0.6b checkpoint by default: on that
one (tied embedding, N(0, 0.02) weights) greedy decoding repeats one token for several steps at a
time (transformers float32: 2-5 distinct tokens in 16), so the agreement check would say little;
here transformers' 32 greedy tokens are 32 distinct ones. `--model-size 0.6b` measures that one.
The checkpoint is float32: the plugin's MLX backend computes in float32 on MLX's CPU device, and
vLLM's CPU backend and torch run a float32 checkpoint in float32, so all three compute the same
thing.

Each engine is one `vllm.LLM` in a worker process of its own (`bench.harness.workers`),
the engines one after another: one engine's worker is
started, runs all its rounds and is shut down before the next one starts, so no two engines ever
share the cores. The rounds are `bench.harness.decode_rounds`'s: one warm-up round of each size, then
single stream (`--c1-rounds` rounds of 1 request) and 32 concurrent streams (`--c32-rounds` rounds
of 32 requests at once), every request its own prompt of `--input-len` random token ids (the same
prompts, in the same order, for every engine), greedy, EOS ignored, `--output-len` tokens. Decode
tok/s = streams / median TPOT (vLLM's per-request metrics: first to last token over the tokens
between them, so TTFT and prefill are left out). The greedy continuations of the first 32-stream
round are compared between every two engines and across all three ("k/n identical").

    python -m bench.run torch_backend --out docs/benchmarks             # full run, quiet machine
    python -m bench.run torch_backend --quick --out /tmp/torch-quick    # tiny model: the harness

`--quick`: the tests' tiny Qwen3 (`--model-size tiny`: 2 layers, hidden 256, 4 / 2 heads of 64),
16-token prompts, 8 output tokens, one round per case, `enforce_eager` on every engine (vLLM's CPU
backend then skips its torch.compile warm-up). Each engine takes 25-60 s of it on 2 cores, most of
that engine start-up and shutdown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.harness.decode_rounds import fill_round_defaults, round_parser
from bench.harness.report.format import (
    WORKER_COLUMNS,
    bars,
    cases_table,
    machine_line,
    millions,
    num,
    quick_note,
    ratio,
    threads_cell,
    worker_cells,
)
from bench.harness.report.publish import publish, regenerate
from bench.harness.stages import command_line

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (the workers are `bench.harness.workers`).

STREAMS = (1, 32)
# Run order; each name is a `bench.harness.stages.BACKEND_ENV` entry.
BACKENDS = ("torch", "cpu", "mlx")
DTYPE = "float32"
INPUT_LEN = {False: 128, True: 16}  # by --quick
# The ratios the report leads with: (numerator, denominator) engines.
RATIOS = (("torch", "cpu"), ("mlx", "torch"))


def cases() -> list[dict[str, Any]]:
    return [{"name": f"c{n}_{be}", "streams": n, "backend": be} for n in STREAMS for be in BACKENDS]


def parser() -> argparse.ArgumentParser:
    from bench.harness.checkpoints import SHAPES

    p = round_parser("torch_backend", __doc__,
                     "tiny model, short rounds: checks the harness", streams=STREAMS)  # fmt: skip
    p.add_argument("--model-size", choices=sorted(SHAPES), default=None,
                   help="bench.harness.checkpoints checkpoint: 0.17b (tiny with --quick)")  # fmt: skip
    p.set_defaults(input_len=None)  # INPUT_LEN
    return p


def run_engine(args: argparse.Namespace, desc: dict[str, Any], backend: str,
               logs: Path) -> dict[str, Any]:  # fmt: skip
    """One engine's rounds, alone on the machine; a failure is recorded with its log's tail."""
    from bench.harness.decode_rounds import kv_log
    from bench.harness.decode_rounds import run as run_rounds

    started = time.perf_counter()
    try:
        result = run_rounds(args, desc, logs, backends=(backend,), tag="torch_backend", dtype=DTYPE,
                            keep_tokens=True)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - one engine's failure must not lose the others
        traceback.print_exc()
        log = logs / f"torch_backend_{backend}.log"
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.is_file() else ""
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
                "log": str(log), "log_tail": tail,
                "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    w = result["workers"][backend]
    w["kv"] = kv_log(w["log"])
    w["seconds"] = round(time.perf_counter() - started, 1)
    return {"status": "ok", **result}


def compare(tokens: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Agreement of every two engines' greedy tokens (`decode_rounds.agreement`), and how many
    continuations all of them share."""
    from bench.harness.decode_rounds import agreement

    names = list(tokens)
    pairs = {f"{a}_vs_{b}": agreement(tokens[a], tokens[b])
             for i, a in enumerate(names) for b in names[i + 1:]}  # fmt: skip
    rows = list(zip(*tokens.values()))
    return {
        "engines": names,
        "requests": len(rows),
        "all_identical": sum(all(r == row[0] for r in row) for row in rows),
        "distinct_continuations": {be: len({tuple(t) for t in ts}) for be, ts in tokens.items()},
        "pairs": pairs,
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Ratios of decode tok/s at each stream count (None where an engine failed), each engine's
    many-stream gain over one stream, and whether every engine had room for all streams."""
    cs, big = report["cases"], max(STREAMS)

    def tok_s(n: int, be: str) -> float | None:
        c = cs.get(f"c{n}_{be}")
        return None if c is None else c["decode_tok_s"]

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else round(x / y, 3)

    return {
        "ratios": {f"c{n}_{a}_vs_{b}": ratio(tok_s(n, a), tok_s(n, b))
                   for n in STREAMS for a, b in RATIOS},
        f"c{big}_vs_c1": {be: ratio(tok_s(big, be), tok_s(1, be)) for be in report["engines_ok"]},
        "concurrency_ok": all((w["kv"]["max_concurrency"] or 0) >= big
                              for w in report["workers"].values()),
        "failed": [be for be, e in report["engines"].items() if e["status"] != "ok"],
    }  # fmt: skip


def cpu_bind() -> str:
    """Every core this process may run on, as `VLLM_CPU_OMP_THREADS_BIND` takes them.

    Left at `auto`, vLLM's CPU worker binds its OpenMP threads to all cores but one (the front
    end's), which is a single core on a 2-core machine, while the torch backend's threads use
    every core: the comparison would measure the binding, not the engines.
    """
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


# ---------------------------------------------------------------------------------- report


STEM = "torch-backend"
QUICK_NOTE = quick_note("the tiny model")
ENGINE_NAMES = {"torch": "torch (plugin, mps)", "cpu": "vLLM CPU", "mlx": "MLX (plugin)"}
COLORS = {"torch": "tab:orange", "cpu": "tab:gray", "mlx": "tab:blue"}


def _model_line(d: dict[str, Any]) -> str:
    return (
        f"`{d['name']}` ({d['architecture']}, {d['num_layers']} layers, hidden {d['hidden_size']}, "
        f"MLP {d['intermediate_size']}, {d['num_heads']} query / {d['num_kv_heads']} KV heads of "
        f"{d['head_dim']}, vocabulary {d['vocab_size']:,}"
        f"{' (tied)' if d['tied_embeddings'] else ''}; {millions(d['num_parameters'])} M "
        f"parameters; {d['dtype']})"
    )


def _agreement_lines(a: dict[str, Any], big: int) -> list[str]:
    n = a["requests"]
    if len(a["engines"]) < 2:
        return ["Fewer than two engines ran: nothing to compare."]
    names = " / ".join(ENGINE_NAMES[be] for be in a["engines"])
    distinct = ", ".join(f"{ENGINE_NAMES[be]} {k}" for be, k in a["distinct_continuations"].items())
    lines = [
        f"Greedy continuations of the first {big}-stream round ({n} prompts):",
        "",
        f"- all of {names}: **{a['all_identical']}/{n} identical**",
    ]
    for key, p in a["pairs"].items():
        first, second = key.split("_vs_")
        lines.append(
            f"- {ENGINE_NAMES[first]} vs {ENGINE_NAMES[second]}: {p['identical']}/{n} identical, "
            f"first token equal in {p['first_token_equal']}/{n}; tokens in common from the start: "
            f"{', '.join(str(x) for x in p['common_prefix_tokens'])}"
        )
    lines += [
        "",
        (
            f"Distinct continuations: {distinct}. Random weights: a near-tie in the LM head may "
            "flip a later token between two float32 implementations (other matmul kernels, other "
            "summation order); a first token that differs would point at a real difference."
        ),
    ]
    return lines


def _threads_cell(be: str, w: dict[str, Any]) -> str:
    # The torch backend's engine core neither binds OpenMP threads (as vLLM's CPU worker does)
    # nor runs MLX matmuls: torch's defaults.
    return "torch's defaults" if be == "torch" else threads_cell(be, w)


def _markdown(report: dict[str, Any]) -> str:
    s, summary, cases = report["settings"], report["summary"], report["cases"]
    streams, big = s["streams"], max(s["streams"])
    engines = list(report["engines"])
    ok = report["engines_ok"]
    engine = report.get("engine") or {}
    lines = [
        "# The torch backend against vLLM's CPU backend and the MLX backend",
        "",
        (
            f"Generated by `{s['command']}` in {s['total_seconds']:.0f} s. Raw figures: "
            f"`{STEM}.json`."
        ),
        "",
        machine_line(report.get("machine") or {}),
        "",
        *([QUICK_NOTE, ""] if s.get("quick") else []),
        (
            f"Model: {_model_line(report['model'])}, random weights from N(0, "
            f"{s['weight_std']:g}) (`bench/harness/checkpoints.py`'s `{s['model_size']}` checkpoint). "
            "Greedy decoding, EOS ignored, "
            f"{s['input_len']}-token prompts and {s['output_len']} output tokens, {s['dtype']}, "
            "the same prompts and the same engine arguments on every engine (prefix caching off, "
            f"`max_num_seqs` {engine.get('max_num_seqs', '—')}, `kv_cache_memory_bytes` "
            f"{engine.get('kv_cache_memory_bytes', 0) / 2**20:.0f} MiB, `enforce_eager` "
            f"{engine.get('enforce_eager', '—')}). The engines ran one after another "
            f"({' → '.join(ENGINE_NAMES[be] for be in s['order'])}), each alone on the machine in "
            f"a worker process of its own. 1 stream: {s['c1_rounds']} round(s) of one request; "
            f"{big} streams: {s[f'c{big}_rounds']} round(s) of {big} requests at once, after one "
            "warm-up round of each size. Decode tok/s = streams / median TPOT (TTFT and prefill "
            "excluded); output tok/s = tokens / wall time of a round (prefill included). torch "
            "runs on torch's CPU device here and MLX on its CPU backend: nothing in this report is "
            "an Apple GPU figure."
        ),
        "",
        "## Decode throughput (same run)",
        "",
        (
            "| streams | "
            + " | ".join(f"{ENGINE_NAMES[be]} decode tok/s" for be in engines)
            + " | torch / vLLM CPU | MLX / torch | "
            + " | ".join(f"{ENGINE_NAMES[be]} TPOT ms" for be in engines)
            + " |"
        ),
        "|---:|" + "---:|" * (2 * len(engines) + 2),
    ]
    for n in streams:
        got = [cases.get(f"c{n}_{be}") for be in engines]
        tok_s = " | ".join("failed" if c is None else num(c["decode_tok_s"]) for c in got)
        tpot = " | ".join("—" if c is None else num(c["median_tpot_ms"]) for c in got)
        r = summary["ratios"]
        lines.append(
            f"| {n} | {tok_s} | {ratio(r[f'c{n}_torch_vs_cpu'])} | "
            f"{ratio(r[f'c{n}_mlx_vs_torch'])} | {tpot} |"
        )
    lines += ["", f"{big} streams against 1 (decode tok/s):", ""]
    lines += [f"- {ENGINE_NAMES[be]}: {ratio(v)}" for be, v in summary[f"c{big}_vs_c1"].items()]
    lines += ["", "## Agreement", "", *_agreement_lines(report["agreement"], big)]
    for be in summary["failed"]:
        e = report["engines"][be]
        lines += [
            "",
            f"## {ENGINE_NAMES[be]}: failed",
            "",
            f"`{e['error'].splitlines()[0][:300]}`; log `{e.get('log')}`, its tail:",
            "",
            "```",
            e.get("log_tail", "").rstrip()[-2000:],
            "```",
        ]
    lines += ["", "## Cases", "", *cases_table(cases)]
    lines += [
        "",
        "## Engines",
        "",
        f"| engine | {WORKER_COLUMNS} | threads | engine's run s |",
        "|---|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for be in ok:
        w = report["workers"][be]
        lines.append(
            f"| {ENGINE_NAMES[be]} | {worker_cells(w)} | {_threads_cell(be, w)} | "
            f"{num(w.get('seconds'))} |"
        )
    lines += [
        "",
        (
            f"Every engine holds {big} requests of {engine.get('max_model_len')} tokens at once "
            f"(vLLM's logged maximum concurrency ≥ {big}), so none was preempted."
            if summary["concurrency_ok"]
            else f"**An engine holds fewer than {big} requests at once: rounds may have "
            "preempted.**"
        ),
        "",
        "![torch backend decode throughput](torch-backend.png)",
    ]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], plt: Any) -> Any:
    cases, ratios = report["cases"], report["summary"]["ratios"]
    streams = report["settings"]["streams"]
    fig, axes = plt.subplots(1, len(streams), figsize=(3.8 * len(streams), 4.2), squeeze=False)
    for ax, n in zip(axes[0], streams):
        engines = [be for be in report["engines"] if f"c{n}_{be}" in cases]
        if engines:
            bars(ax, [ENGINE_NAMES[be] for be in engines],
                  [cases[f"c{n}_{be}"]["decode_tok_s"] for be in engines],
                  [COLORS[be] for be in engines], ".1f")  # fmt: skip
        label = "1 stream" if n == 1 else f"{n} streams"
        ax.set_title(
            f"{label}\ntorch / CPU {ratio(ratios[f'c{n}_torch_vs_cpu'])}, "
            f"MLX / torch {ratio(ratios[f'c{n}_mlx_vs_torch'])}",
            fontsize=9,
        )
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].set_ylabel("decode tok/s (streams / TPOT)")
    title = "Decode, torch backend vs vLLM CPU vs MLX backend (CPU)"
    if report["settings"].get("quick"):
        title += "\n(quick run: tiny model)"
    fig.suptitle(title, fontsize=10)
    return fig


def write_report(report: dict[str, Any], out: Any) -> list[Any]:
    return publish(report, out, STEM, _markdown, _plot)


def regenerate_report(folder: Path) -> None:
    """The markdown and plot again from the JSON in `folder`."""
    regenerate(folder, STEM, _markdown, _plot)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with every default filled in."""
    args = parser().parse_args(argv)
    fill_round_defaults(args)
    if args.input_len is None:
        args.input_len = INPUT_LEN[args.quick]
    if args.model_size is None:
        args.model_size = "tiny" if args.quick else "0.17b"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from bench.harness.checkpoints import SHAPES, describe_model, write_model
    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("torch-backend-quick" if args.quick else "torch-backend")
    logs.mkdir(parents=True, exist_ok=True)
    print("[torch_backend] machine", flush=True)
    machine = describe_machine_apart(logs)
    print(f"[torch_backend] checkpoint ({args.model_size}, {DTYPE})", flush=True)
    path = write_model(work / "models", args.model_size, DTYPE, args.seed)
    desc = {"name": path.name, **describe_model(path)}

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind()
    engines = {be: run_engine(args, desc, be, logs) for be in BACKENDS}
    ok = [be for be, e in engines.items() if e["status"] == "ok"]
    big = max(STREAMS)
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "model_size": args.model_size,
            "weight_std": SHAPES[args.model_size].weight_std,
            "dtype": DTYPE,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "streams": list(STREAMS),
            "c1_rounds": args.c1_rounds,
            f"c{big}_rounds": getattr(args, f"c{big}_rounds"),
            "seed": args.seed,
            "order": list(BACKENDS),
            "vllm_cpu_omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "command": command_line("torch_backend", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        "model": desc,
        "engine": next((engines[be]["engine"] for be in ok), None),
        "engines": {
            be: {k: e[k] for k in ("status", "error", "log", "log_tail", "seconds") if k in e}
            for be, e in engines.items()
        },
        "engines_ok": ok,
        "workers": {be: engines[be]["workers"][be] for be in ok},
        "cases": {k: c for be in ok for k, c in engines[be]["cases"].items()},
        "agreement": compare({be: engines[be]["token_ids"][be] for be in ok}),
    }
    assert all(engines[be]["engine"] == report["engine"] for be in ok), "engine arguments differ"
    report["summary"] = summarize(report)
    write_report(report, Path(args.out))
    status = 0
    for be in report["summary"]["failed"]:
        print(f"[torch_backend] {be} failed: {engines[be]['error'][:500]}", file=sys.stderr)
        status = 1
    if not report["summary"]["concurrency_ok"]:
        print(f"[torch_backend] an engine holds fewer than {big} requests", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
