"""The engine on a GPU that is not Apple's: the plugin against stock mlx-lm on MLX's CUDA backend
(docs/gpu-proxy.md), same checkpoint, 1/8/32/64 streams, and where a plugin step's time goes.

Engines, one after another, each alone in a process of its own (`gpu_proxy_worker`):
- mlx-lm: `stream_generate` (one stream) and `batch_generate` (several, all at once);
- the plugin, once per `--tree NAME=PATH` (default: this checkout as `plugin`): `vllm.LLM` with
  that tree first on PYTHONPATH, engine core in-process, so one run can hold a before and an
  after of the plugin beside mlx-lm.
The checkpoint is the harness's random Qwen3-0.6B-shaped one in bfloat16
(`bench/harness/checkpoints.py`), or with `--family` a hybrid suite's model of that family in
bfloat16 (`hybrid_models.py`: Gated DeltaNet, Mamba-2, latent attention, short convolutions;
then no attention-alone case); prompts are `--input-len` random ids, `--output-len` greedy
tokens (`--sampled`: drawn with a temperature, top-p and top-k; `--seeded`: the plugin's
requests each with a seed) with EOS ignored. Decode tok/s leaves prefill out. Each plugin case also records the
median per-step phases (host build, submit, wait, sampling, the engine around them) and a
cProfile of `--profile-streams`. Last, a decode step's attention alone (the last tree's pure-MLX
paged attention against attention over a contiguous cache, as mlx-lm keeps it), which bounds the
plugin's batched figures on the proxy. Only ratios within one run mean anything: the figures are
an NVIDIA GPU's through MLX, not an Apple GPU's.

    python -m bench.run gpu_proxy --out docs/benchmarks                    # on the GPU machine
    python -m bench.run gpu_proxy --tree before=/tmp/old --tree after=. --out DIR
    python -m bench.run gpu_proxy --quick --out /tmp/gpu-proxy-quick       # tiny model: the harness
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.stages import ROOT, command_line, process_env, suite_parser
from bench.suites.hybrid_models import FAMILIES, write_hybrid_model

STREAMS = (1, 8, 32, 64)
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "top_k": 50}  # --sampled, for every engine
QUICK = {"streams": [1, 2], "input_len": 16, "output_len": 8, "profile_tokens": 4,
         "model_size": "tiny", "kv_bytes": 64 * 2**20}  # fmt: skip
FULL = {"streams": list(STREAMS), "input_len": 128, "output_len": 256, "profile_tokens": 64,
        "model_size": "0.6b", "kv_bytes": 8 * 2**30}  # fmt: skip


def parser():
    p = suite_parser("gpu_proxy", __doc__, "tiny model, 2 streams, 8 tokens: checks the harness")
    p.add_argument("--tree", action="append", default=None, metavar="NAME=PATH[,VAR=VALUE...]",
                   help="a vllm-metal source tree to run as engine NAME, with these environment "
                        "variables (repeatable; e.g. eager=.,VLLM_METAL_COMPILE=0)")  # fmt: skip
    p.add_argument("--streams", default=None, help="comma-separated stream counts")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (128)")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="every request's presence penalty (mlx-lm's over the last prompt + "
                        "output tokens)")  # fmt: skip
    p.add_argument(
        "--sampled",
        action="store_true",
        help=f"every request sampled ({SAMPLED}) instead of greedy",
    )
    p.add_argument("--seeded", action="store_true",
                   help="with --sampled, each plugin request with a seed of its own (mlx-lm "
                        "has none to give)")  # fmt: skip
    p.add_argument("--profile-streams", default="1,32", help="cProfiled stream counts ('' none)")
    p.add_argument(
        "--kernel-streams",
        default="",
        help="stream counts whose CUDA kernels are profiled (torch's profiler; '' none)",
    )
    p.add_argument("--no-mlx-lm", action="store_true", help="the plugin trees only")
    p.add_argument("--model-size", default=None,
                   help="bench.harness.checkpoints shape (0.6b; tiny with --quick)")  # fmt: skip
    p.add_argument("--family", default=None, choices=FAMILIES,
                   help="a hybrid suite's model instead (hybrid_models.py)")  # fmt: skip
    p.add_argument("--kv-gib", type=float, default=None,
                   help="the plugin's KV-cache pool in GiB (8; 1/16 with --quick)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    return p


def parse_tree(text: str) -> tuple[str, Path, dict[str, str]]:
    """`NAME=PATH[,VAR=VALUE...]` -> (name, resolved path, environment)."""
    name, rest = text.split("=", 1)
    path, *settings = rest.split(",")
    return name, Path(path).resolve(), dict(s.split("=", 1) for s in settings)


def run_worker(engine: str, spec: dict[str, Any], tree: Path | None, log: Path,
               timeout: float, tree_env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One engine's worker; its result, or the error and its log's tail."""
    env = process_env()
    if tree is not None:  # the worker puts it first on sys.path once `bench` is imported
        spec = {**spec, "plugin_tree": str(tree), "plugin_env": tree_env or {}}
    result = log.with_suffix(".json")
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.suites.gpu_proxy_worker", "--engine", engine,
           "--spec", json.dumps(spec), "--result", str(result)]  # fmt: skip
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    if rc == 0 and result.is_file():
        return {"status": "ok", **json.loads(result.read_text())}
    tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
    return {"status": "error", "returncode": rc, "log_tail": tail,
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def summarize(engines: dict[str, dict[str, Any]], streams: list[int]) -> dict[str, Any]:
    """Each plugin tree's decode tok/s over mlx-lm's at each stream count, and over the first
    tree's (the 'before' of a before/after run)."""

    def tok_s(name: str, n: int) -> float | None:
        e = engines.get(name, {})
        return (
            e.get("cases", {}).get(str(n), {}).get("decode_tok_s")
            if e.get("status") == "ok"
            else None
        )

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a / b, 3)

    trees = [n for n in engines if n != "mlx_lm"]
    out: dict[str, Any] = {"vs_mlx_lm": {}, "vs_first_tree": {}}
    for name in trees:
        out["vs_mlx_lm"][name] = {
            str(n): ratio(tok_s(name, n), tok_s("mlx_lm", n)) for n in streams
        }
        if trees and name != trees[0]:
            out["vs_first_tree"][name] = {str(n): ratio(tok_s(name, n), tok_s(trees[0], n))
                                          for n in streams}  # fmt: skip
    out["failed"] = [n for n, e in engines.items() if e.get("status") != "ok"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from bench.harness.checkpoints import SHAPES, write_model
    from bench.suites.gpu_proxy_report import write_report

    settings = dict(QUICK if args.quick else FULL)
    if args.streams:
        settings["streams"] = [int(s) for s in args.streams.split(",")]
    if args.input_len:
        settings["input_len"] = args.input_len
    if args.presence_penalty:
        settings["presence_penalty"] = args.presence_penalty
    if args.output_len:
        settings["output_len"] = args.output_len
    if args.sampled:
        settings["sampling"] = SAMPLED
        settings["seeded"] = args.seeded
    if args.model_size:
        settings["model_size"] = args.model_size
    if args.kv_gib:
        settings["kv_bytes"] = int(args.kv_gib * 2**30)
    profile = [int(s) for s in args.profile_streams.split(",") if s]
    settings["profile_streams"] = [1] if args.quick else profile
    settings["kernel_streams"] = [int(s) for s in args.kernel_streams.split(",") if s]
    trees = [parse_tree(t) for t in (args.tree or [f"plugin={ROOT}"])]

    work = Path(args.work_dir)
    logs = work / ("gpu-proxy-quick" if args.quick else "gpu-proxy")
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.family:
        path = write_hybrid_model(work, args.family, args.quick, args.seed, "bfloat16")
        settings["family"] = args.family
        vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    else:
        path = write_model(work / "models", settings["model_size"], "bfloat16", args.seed)
        vocab_size = SHAPES[settings["model_size"]].vocab_size
    spec = {**settings, "model": str(path), "seed": args.seed, "vocab_size": vocab_size}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": {**settings, "trees": {n: f"{p} {e or ''}".strip()
                                                                for n, p, e in trees}},
                              "command": command_line("gpu_proxy", argv), "engines": {}}  # fmt: skip
    order = [] if args.no_mlx_lm or (args.quick and not args.peers) else [("mlx_lm", None, {})]
    order += trees
    for name, tree, tree_env in order:
        print(f"[gpu_proxy] {name}", flush=True)
        engine = "mlx_lm" if tree is None else "plugin"
        report["engines"][name] = run_worker(engine, spec, tree, logs / f"{name}.log",
                                             args.timeout, tree_env)  # fmt: skip
        report["summary"] = summarize(report["engines"], settings["streams"])
        report["seconds"] = round(time.perf_counter() - started, 1)
        (out / "gpu_proxy.json").write_text(json.dumps(report, indent=2) + "\n")  # partial too
    name, tree, _ = trees[-1]
    if not args.family:  # the attention-alone case takes the Qwen3 shape's layers
        print("[gpu_proxy] attention alone", flush=True)
        report["attention"] = run_worker(
            "attention", spec, tree, logs / "attention.log", args.timeout
        )
        (out / "gpu_proxy.json").write_text(json.dumps(report, indent=2) + "\n")
    write_report(out)
    print(json.dumps(report["summary"], indent=2))
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
