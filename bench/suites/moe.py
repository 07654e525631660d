"""Mixture-of-experts decode throughput: the plugin against vLLM's own CPU backend, one run.

The model is a random-weight Qwen3-MoE-style checkpoint written locally (`write_moe_model`): 8
layers, hidden 1024, 16 query / 4 KV heads of 128, in every layer 16 experts (SwiGLU, intermediate
512) of which the router picks 4 per token (weights renormalised, as Qwen3-MoE does), an untied
32,000-row vocabulary (Mixtral's size, so the LM head is a tenth of the work per token, as in a real
MoE, and not most of it): 309 M parameters, 125 M of them active per token. Its tokenizer is the
project's tiny BPE tokenizer padded to the vocabulary.

Each backend is one `vllm.LLM` (greedy, EOS ignored, the same engine arguments) in a worker
process of its own (`VLLM_TARGET_DEVICE=cpu` for vLLM's; the workers are
`bench.harness.workers`, the rounds `bench.harness.decode_rounds`). Both workers are started,
then this process sends them the same rounds alternately (the first backend alternating), each
once the other worker is idle again: single stream (1 request) and 16 concurrent streams (16
requests at once), 32-token prompts and 64 output tokens. Decode tok/s = streams / median TPOT
(vLLM's per-request metrics: time from the first to the last token over the tokens between them),
so prefill is left out; output tok/s (tokens / wall time, prefill included) is reported beside
it. One warm-up round of each size comes first. Both backends' greedy tokens of one 16-stream
round are compared.

    python -m bench.run moe --out docs/benchmarks          # a few minutes on 2 cores
    python -m bench.run moe --quick --out /tmp/moe-quick   # tiny MoE, checks the harness

`--quick`: the tests' tiny Qwen3-MoE (2 layers, hidden 128, 8 experts, top-2), 8 output tokens, one
round per case, `enforce_eager` on both backends (vLLM's CPU backend then skips its torch.compile
warm-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.decode_rounds import STREAMS, fill_round_defaults, round_parser
from bench.harness.report.format import (
    BACKEND_NAMES,
    NOT_MEASURED,
    cases_table,
    machine_line,
    millions,
    num,
    quick_note,
    threads_cell,
)
from bench.harness.report.publish import publish, regenerate
from bench.harness.stages import command_line, runs_peers

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (the workers are `bench.harness.workers`).

BACKENDS = ("plugin", "cpu")
DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device; vLLM's CPU backend too
SHAPE = {
    "num_layers": 8,
    "hidden_size": 1024,
    "num_heads": 16,
    "num_kv_heads": 4,
    "head_dim": 128,
    "num_experts": 16,
    "top_k": 4,
    "moe_intermediate_size": 512,
    "vocab_size": 32000,
}
# The usual 0.02 init keeps 8 layers' activations tame; the router's logits (std ~0.6) still send
# different tokens to different experts.
WEIGHT_STD = 0.02


def cases() -> list[dict[str, Any]]:
    return [{"name": f"c{n}_{be}", "streams": n, "backend": be} for n in STREAMS for be in BACKENDS]


# ------------------------------------------------------------------------------ checkpoint


def write_moe_model(work: Path, quick: bool, seed: int = 0) -> Path:
    """Write (or reuse) the benchmark checkpoint (`--quick`: the tests' tiny Qwen3-MoE)."""
    from tests.fixtures.tiny_moe import write_tiny_moe

    name = "qwen3-moe-tiny" if quick else "qwen3-moe-309m-random"
    path = Path(work) / "models" / f"{name}-{DTYPE}"
    shape = None if quick else SHAPE
    stamp = {"kind": "qwen3_moe", "shape": shape, "dtype": DTYPE, "seed": seed, "format": 1}
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path
    if quick:
        write_tiny_moe(path, "qwen3_moe", dtype=DTYPE, seed=seed, style="hub")
    else:
        from bench.harness.checkpoints import pad_tokenizer

        write_tiny_moe(path, "qwen3_moe", dtype=DTYPE, seed=seed, style="hub", **SHAPE,
                       weight_std=WEIGHT_STD, router_std=WEIGHT_STD)  # fmt: skip
        pad_tokenizer(path / "tokenizer.json", SHAPE["vocab_size"])
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def describe_moe_model(path: Path) -> dict[str, Any]:
    """Shape, total and active parameters (per token: attention, router, top-k experts, norms
    and the LM head; the embedding is only gathered), from config.json and the safetensors
    header."""
    from bench.harness.checkpoints import safetensors_sizes

    config = json.loads((path / "config.json").read_text())
    sizes = safetensors_sizes(path / "model.safetensors")
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[config["dtype"]]
    experts = config.get("num_experts", config.get("num_local_experts"))
    k = config["num_experts_per_tok"]
    expert_bytes = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
    other = sum(v for n, v in sizes.items() if ".mlp.experts." not in n)
    embed = sizes["model.embed_tokens.weight"]
    active = other - embed + expert_bytes * k // experts
    return {
        "path": str(path),
        "name": path.name,
        "architecture": config["architectures"][0],
        "dtype": config["dtype"],
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "num_experts": experts,
        "experts_per_token": k,
        "moe_intermediate_size": config["moe_intermediate_size"],
        "vocab_size": config["vocab_size"],
        "num_parameters": sum(sizes.values()) // itemsize,
        "active_parameters_per_token": active // itemsize,
        "kv_bytes_per_token": 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
        * config["head_dim"] * itemsize,
    }  # fmt: skip


# ------------------------------------------------------------------------------ the whole run


def run(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    """Both backends side by side on the checkpoint (`bench.decode_rounds.run`); the plugin's
    alone under `--quick` without `--peers`."""
    from bench.harness.decode_rounds import run as run_rounds

    backends = BACKENDS if runs_peers(args) else ("plugin",)
    return run_rounds(args, describe_moe_model(model), logs, backends=backends, tag="moe", dtype=DTYPE)  # fmt: skip


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    cs, big = report["cases"], max(STREAMS)
    backends = [be for be in BACKENDS if f"c1_{be}" in cs]
    # None where vLLM CPU was not measured (`--quick` without `--peers`).
    ratios = {f"c{n}_plugin_vs_cpu": round(cs[f"c{n}_plugin"]["decode_tok_s"]
                                           / cs[f"c{n}_cpu"]["decode_tok_s"], 3)
              if f"c{n}_cpu" in cs else None for n in STREAMS}  # fmt: skip
    batching = {be: round(cs[f"c{big}_{be}"]["decode_tok_s"] / cs[f"c1_{be}"]["decode_tok_s"], 2)
                for be in backends}  # fmt: skip
    a = report["agreement"]
    return {"ratios": ratios, f"c{big}_vs_c1": batching,
            "agreement_passed": None if a is None else a["passed"]}  # fmt: skip


# ---------------------------------------------------------------------------------- report


QUICK_NOTE = quick_note("the tiny MoE")


def _model_line(d: dict[str, Any]) -> str:
    return (
        f"`{d['name']}` ({d['architecture']}, {d['num_layers']} layers, hidden {d['hidden_size']}, "
        f"{d['num_heads']} query / {d['num_kv_heads']} KV heads of {d['head_dim']}, "
        f"{d['num_experts']} experts of intermediate {d['moe_intermediate_size']}, top-"
        f"{d['experts_per_token']}, vocabulary {d['vocab_size']:,}; "
        f"{millions(d['num_parameters'])} M parameters, "
        f"{millions(d['active_parameters_per_token'])} M active per token; {d['dtype']})"
    )


def _markdown(report: dict[str, Any]) -> str:
    s, summary, cases = report["settings"], report["summary"], report["cases"]
    a = report["agreement"]
    big = max(s["streams"])
    lines = [
        "# Mixture-of-experts decode: the plugin against vLLM's CPU backend",
        "",
        (
            f"Generated by `python -m bench.run moe{' --quick' if s.get('quick') else ''}` in "
            f"{s['total_seconds']:.0f} s. Raw figures: `moe.json`."
        ),
        "",
        machine_line(report.get("machine") or {}),
        "",
        *([QUICK_NOTE, ""] if s.get("quick") else []),
        (
            f"Model: {_model_line(report['model'])}, random weights. Greedy decoding, EOS ignored, "
            f"{s['input_len']}-token prompts and {s['output_len']} output tokens, {s['dtype']} on "
            f"both backends, the same engine arguments. 1 stream: {s['c1_rounds']} round(s) of one "
            f"request; {big} streams: {s['c16_rounds']} round(s) of {big} requests at once. "
            "Decode tok/s = streams / median TPOT (prefill excluded); output tok/s = tokens / wall "
            "time of a round (prefill included). Both backends' workers run side by side and get "
            "each round in turn (the first backend alternating), after one warm-up round of each "
            "size; a round starts once the previous round's worker is idle again."
        ),
        "",
        "## Plugin / vLLM CPU (same run)",
        "",
        (
            "| streams | plugin decode tok/s | vLLM CPU decode tok/s | plugin / vLLM CPU | "
            "plugin TPOT ms | vLLM CPU TPOT ms |"
        ),
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in s["streams"]:
        p, c = cases[f"c{n}_plugin"], cases.get(f"c{n}_cpu")
        cpu = (NOT_MEASURED, NOT_MEASURED, NOT_MEASURED) if c is None else (
            num(c["decode_tok_s"]), f"{num(summary['ratios'][f'c{n}_plugin_vs_cpu'], 2)}x",
            num(c["median_tpot_ms"]))  # fmt: skip
        lines.append(
            f"| {n} | {num(p['decode_tok_s'])} | {cpu[0]} | {cpu[1]} | "
            f"{num(p['median_tpot_ms'])} | {cpu[2]} |"
        )
    lines += ["", f"{big} streams against 1 (decode tok/s):", ""]
    lines += [f"- {BACKEND_NAMES[be]}: {v:.2f}x" for be, v in summary[f"c{big}_vs_c1"].items()]
    lines += ["", f"## Agreement (one {big}-stream round, plugin vs vLLM CPU)", ""]
    if a is None:
        lines.append("Not measured: vLLM CPU did not run (`--quick` without `--peers`).")
    else:
        lines.append(
            f"{a['identical']} of {a['requests']} greedy continuations identical, first token "
            f"equal in {a['first_token_equal']}; tokens in common from the start: "
            f"{', '.join(str(x) for x in a['common_prefix_tokens'])}; "
            f"{a['distinct_continuations']} distinct continuations on the plugin. "
            f"Passed (every first token equal): {'yes' if a['passed'] else 'NO'}."
        )
    lines += [
        "",
        "## Cases",
        "",
        *cases_table(cases),
        "",
        "## Workers",
        "",
        "| backend | platform | engine start s (both starting at once) | warm-up rounds s | threads |",
        "|---|---|---:|---|---|",
    ]
    for be, w in report["workers"].items():
        warm = ", ".join(num(x, 2) for x in w.get("warmup_s", []))
        lines.append(
            f"| {BACKEND_NAMES[be]} | {w.get('platform', '—')} | {num(w['engine_start_s'])} | "
            f"{warm} | {threads_cell(be, w)} |"
        )
    lines += ["", "![MoE decode throughput](moe.png)"]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], plt: Any) -> Any:
    cases, ratios = report["cases"], report["summary"]["ratios"]
    streams = report["settings"]["streams"]
    fig, axes = plt.subplots(1, len(streams), figsize=(3.4 * len(streams), 4.2))
    for ax, n in zip(axes, streams):
        ran = [be for be in BACKEND_NAMES if f"c{n}_{be}" in cases]
        values = [cases[f"c{n}_{be}"]["decode_tok_s"] for be in ran]
        colors = {"plugin": "tab:blue", "cpu": "tab:gray"}
        bars = ax.bar([BACKEND_NAMES[be] for be in ran], values, color=[colors[be] for be in ran])
        for bar, v in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom")
        ratio = ratios.get(f"c{n}_plugin_vs_cpu")
        label = "1 stream" if n == 1 else f"{n} streams"
        ax.set_title(f"{label}\nplugin / CPU {num(ratio, 2)}x", fontsize=10)
        ax.set_ylim(0, max(values) * 1.18)
    axes[0].set_ylabel("decode tok/s (streams / TPOT)")
    title = "MoE decode, plugin vs vLLM CPU"
    if report["settings"].get("quick"):
        title += " (quick run: tiny MoE)"
    fig.suptitle(title)
    return fig


def write_report(report: dict[str, Any], out: Any) -> list[Any]:
    return publish(report, out, "moe", _markdown, _plot)


def regenerate_report(folder: Path) -> None:
    """The markdown and plot again from the JSON in `folder`."""
    regenerate(folder, "moe", _markdown, _plot)


def main(argv: list[str] | None = None) -> int:
    p = round_parser("moe", __doc__, "tiny MoE: checks the harness")
    args = p.parse_args(argv)
    fill_round_defaults(args)

    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("moe-quick" if args.quick else "moe")
    logs.mkdir(parents=True, exist_ok=True)
    print("[moe] machine", flush=True)
    machine = describe_machine_apart(logs)
    print("[moe] checkpoint", flush=True)
    model = write_moe_model(work, args.quick, args.seed)
    result = run(args, model, logs)
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "streams": list(STREAMS),
            "c1_rounds": args.c1_rounds,
            "c16_rounds": args.c16_rounds,
            "seed": args.seed,
            "command": command_line("moe", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        **result,
    }
    report["summary"] = summarize(report)
    write_report(report, Path(args.out))
    if report["agreement"] is not None and not report["agreement"]["passed"]:
        print("[moe] the backends' first greedy tokens differ; see the report", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
