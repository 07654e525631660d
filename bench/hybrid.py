"""Decode throughput of hybrid and latent-attention models: Qwen3-Next (Gated DeltaNet),
Granite 4.0-H (Mamba-2) and DeepSeek-V3 (multi-head latent attention), one run; and the memory an
idle engine holds.

Three random-weight checkpoints written locally with the tests' writers at larger shapes
(`write_hybrid_model`), all 8 layers of hidden 1024 in their families' layer patterns, an
untied (Qwen3-Next, DeepSeek-V3) or tied (Granite, as released) 32,000-row vocabulary, the layers
followed by MoE blocks of 8 experts (SwiGLU, intermediate 512, top-2) plus a shared expert of 512:

- Qwen3-Next (`Qwen3NextForCausalLM`): 3 Gated DeltaNet layers then 1 gated full attention,
  twice; the linear layers have 8 key and 16 value heads of 128 (a 1 MiB float32 recurrent state
  per layer and request), the attention 8 query / 2 KV heads of 128.
- Granite 4.0-H (`GraniteMoeHybridForCausalLM`): 3 Mamba-2 layers then 1 attention layer, twice;
  Mamba-2 with 32 heads of 64 (intermediate 2048), state 128, one group of B/C, the attention 16
  query / 4 KV heads of 64. One group because vLLM's gated RMSNorm (`Mixer2RMSNormGated`)
  normalises each group's slice while transformers and mlx-lm (the plugin's model code)
  normalise the whole intermediate: with more groups the two backends compute different models
  and the agreement check would mean nothing. The released Granite 4.0-H models have one group.
- DeepSeek-V3 (`DeepseekV3ForCausalLM`): MLA with DeepSeek-V3's own head shapes (16 heads; query
  LoRA rank 384; latent 512 plus a rotary part of 64, so 576 values cached per token and layer;
  nope and value head dims 128), the first layer dense (intermediate 2048), the other 7 MoE with
  sigmoid routing.

Weights are drawn from N(0, 0.02) (the embedding of the tied Granite from N(0, 0.01), as its
muP multiplier scales it by 12), so 8 layers' activations stay tame. The tokenizer is the
project's tiny BPE tokenizer padded to the vocabulary (`bench.model._pad_tokenizer`).

Each (family, backend) is one `vllm.LLM` (greedy, EOS ignored, float32, the same engine
arguments, prefix caching off as the plugin has it for hybrids anyway) in a worker process of its
own; each worker reports its resident memory (its process and the engine core's) once the engine
is up and idle, with the KV cache allocated; the rounds are `bench/decode_rounds.py`'s (as bench.moe's): one warm-up round of each size,
then single stream (1 request) and 16 concurrent streams (16 requests at once), 32-token prompts
and 64 output tokens; decode tok/s = streams / median TPOT. Granite runs the plugin and vLLM's own
CPU backend (`VLLM_TARGET_DEVICE=cpu`) side by side, the same rounds in turn, and compares their
greedy tokens of one 16-stream round; so does DeepSeek-V3 (vLLM's CPU MLA kernel is built for
576-value rows only, which these shapes have). Qwen3-Next runs the plugin alone: vLLM's CPU backend does not
serve a float32 Qwen3-Next (its Gated DeltaNet CPU kernel, `cpu_gdn_attention_core`, asserts
bfloat16 inputs, so the engine dies on its first step with "CPU GDN attention requires BF16"), and
a bfloat16 vLLM against the plugin's float32 would measure two different computations (other
matmul kernels, other precision, no meaningful agreement check), so there is no like-for-like peer.
The KV cache is 1 GiB per engine (`kv_cache_memory_bytes`), far more than 16 requests of 112
tokens need with their state pages; every worker's log line "Maximum concurrency for N tokens per
request" is recorded and must be at least 16, so no request is preempted.

    python -m bench.hybrid --out docs/benchmarks             # ~12 min on 2 cores
    python -m bench.hybrid --quick --out /tmp/hybrid-quick   # tiny models, ~3 min: the harness

`--quick`: the tests' tiny checkpoints (hidden 128; Granite with one group, as above; DeepSeek-V3
with the 512 + 64 latent vLLM's CPU kernel needs),
8 output tokens, one round per case, `enforce_eager` on every engine (vLLM's CPU backend then
skips its torch.compile warm-up).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.decode_rounds import STREAMS, fill_round_defaults, round_parser
from bench.generate_worker import worker

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (each worker is this module with --reply-fd).

FAMILIES = ("qwen3_next", "granite", "deepseek_v3")
# vLLM's CPU backend cannot start Qwen3-Next here (module docstring): the plugin runs alone.
BACKENDS = {
    "qwen3_next": ("plugin",),
    "granite": ("plugin", "cpu"),
    "deepseek_v3": ("plugin", "cpu"),
}
DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device; vLLM's CPU backend too
KV_CACHE_BYTES = {False: 2**30, True: 256 * 2**20}  # by --quick
VOCAB = 32000
MOE = {"num_experts": 8, "top_k": 2}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_next": {
        "num_layers": 8,
        "full_attention_interval": 4,
        "hidden_size": 1024,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        **MOE,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": VOCAB,
    },
    "granite": {
        "layer_types": ["mamba", "mamba", "mamba", "attention"] * 2,
        "hidden_size": 1024,
        "num_heads": 16,
        "num_kv_heads": 4,  # attention head size: hidden / heads = 64
        "attention_multiplier": 1 / 64,  # Granite's 1 / head_dim
        "mamba_n_heads": 32,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        **MOE,
        "intermediate_size": 512,
        "shared_intermediate_size": 512,
        "vocab_size": VOCAB,
    },
    "deepseek_v3": {
        "num_layers": 8,
        "first_k_dense_replace": 1,
        "hidden_size": 1024,
        "num_heads": 16,
        "q_lora_rank": 384,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": MOE["num_experts"],
        "top_k": MOE["top_k"],
        "n_shared_experts": 1,
        "moe_intermediate_size": 512,
        "intermediate_size": 2048,
        "vocab_size": VOCAB,
    },
}
# vLLM's CPU MLA kernel takes 576-value latent rows only.
QUICK_KWARGS: dict[str, dict[str, Any]] = {
    "qwen3_next": {},
    "granite": {"mamba_n_groups": 1},
    "deepseek_v3": {
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
}
# Families whose vLLM CPU peer is known to compute other tokens than transformers float32 (which
# the plugin's tokens equal in the tests): their agreement is reported, not required.
PEER_DEVIATES = {
    "deepseek_v3": (
        "vLLM's CPU backend does not always reproduce transformers float32 on random-weight MLA "
        "models: on the tests' tiny DeepSeek-V3 shapes with weights from N(0, 0.3) (the `--quick` "
        "model), and on a 1-layer dense one with DeepSeek's own head shapes, its first token "
        "(prefill, `CPU_SDPA_MLA`) equals transformers' but its decode steps (`CPU_MLA`, "
        "`mla_decode_kvcache_cpu`) drift within a few tokens, while the plugin's tokens and "
        "logprobs equal transformers' (tests/backends/mlx/runner/test_mla.py). So the agreement "
        "below is reported, not required."
    ),
}
# Idle memory of the MLA engines at these KV cache sizes (by --quick).
IDLE_KV_BYTES = {False: (2**30, 4 * 2**30), True: (256 * 2**20, 2**30)}
WEIGHT_STD = 0.02
STDS = {
    "qwen3_next": {"weight_std": WEIGHT_STD, "router_std": WEIGHT_STD},
    "granite": {"weight_std": WEIGHT_STD, "embed_std": WEIGHT_STD / 2},
    "deepseek_v3": {"weight_std": WEIGHT_STD, "router_std": WEIGHT_STD},
}


def cases() -> list[dict[str, Any]]:
    return [{"name": f"{f}_c{n}_{be}", "family": f, "streams": n, "backend": be}
            for f in FAMILIES for n in STREAMS for be in BACKENDS[f]]  # fmt: skip


# ------------------------------------------------------------------------------ checkpoints


def write_hybrid_model(work: Path, family: str, quick: bool, seed: int = 0) -> Path:
    """Write (or reuse) a family's benchmark checkpoint (`--quick`: the tests' tiny one, Granite
    with one group)."""
    from vllm_metal.testing.tiny_deepseek_v3 import write_tiny_deepseek_v3
    from vllm_metal.testing.tiny_granitemoehybrid import write_tiny_granitemoehybrid
    from vllm_metal.testing.tiny_qwen3_next import write_tiny_qwen3_next

    writer = {
        "qwen3_next": write_tiny_qwen3_next,
        "granite": write_tiny_granitemoehybrid,
        "deepseek_v3": write_tiny_deepseek_v3,
    }[family]
    name = f"{family}-tiny" if quick else f"{family}-hybrid-random"
    path = Path(work) / "models" / f"{name}-{DTYPE}"
    if quick:
        kwargs: dict[str, Any] = dict(QUICK_KWARGS[family])
    else:
        kwargs = {**SHAPES[family], **STDS[family]}
    stamp = {"kind": family, "kwargs": kwargs, "dtype": DTYPE, "seed": seed, "format": 1}
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path
    writer(path, dtype=DTYPE, seed=seed, **kwargs)
    if not quick:
        from bench.model import _pad_tokenizer

        _pad_tokenizer(path / "tokenizer.json", kwargs["vocab_size"])
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def describe_hybrid_model(path: Path) -> dict[str, Any]:
    """Shape, layer pattern, total and active parameters (per token: everything but the experts
    the router skips and, when untied, the embedding, which is only gathered), KV bytes per token
    and state bytes per request, from config.json and the safetensors header."""
    from bench.model import _safetensors_sizes

    c = json.loads((path / "config.json").read_text())
    sizes = _safetensors_sizes(path / "model.safetensors")
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[c["dtype"]]
    family = {"qwen3_next": _gated_delta, "granitemoehybrid": _mamba2, "deepseek_v3": _latent}
    shape = family[c["model_type"]](c, itemsize)
    sparse = re.compile(r"\.mlp\.experts\.|\.block_sparse_moe\.(input|output)_linear\.")
    expert_bytes = sum(v for n, v in sizes.items() if sparse.search(n))
    other = sum(v for n, v in sizes.items() if not sparse.search(n))
    tied = c.get("tie_word_embeddings", False)
    active = other - (0 if tied else sizes["model.embed_tokens.weight"])
    active += expert_bytes * c["num_experts_per_tok"] // shape["num_experts"]
    return {
        "path": str(path),
        "name": path.name,
        "architecture": c["architectures"][0],
        "dtype": c["dtype"],
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_heads": c["num_attention_heads"],
        "experts_per_token": c["num_experts_per_tok"],
        "vocab_size": c["vocab_size"],
        "tied_embeddings": tied,
        "num_parameters": sum(sizes.values()) // itemsize,
        "active_parameters_per_token": active // itemsize,
        **shape,
    }


def _gated_delta(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    state = c["linear_num_value_heads"] * c["linear_value_head_dim"] * c["linear_key_head_dim"]
    mixer = {
        "key_heads": c["linear_num_key_heads"],
        "value_heads": c["linear_num_value_heads"],
        "key_head_dim": c["linear_key_head_dim"],
        "value_head_dim": c["linear_value_head_dim"],
    }
    return _with_state(
        c, itemsize, "Gated DeltaNet", mixer, c["head_dim"], state,
        conv=(c["linear_conv_kernel_dim"], 2 * key_dim + value_dim),
        experts=(c["num_experts"], c["moe_intermediate_size"],
                 c["shared_expert_intermediate_size"]),
    )  # fmt: skip


def _mamba2(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    inner = c["mamba_n_heads"] * c["mamba_d_head"]
    mixer = {
        "heads": c["mamba_n_heads"],
        "head_dim": c["mamba_d_head"],
        "state": c["mamba_d_state"],
        "groups": c["mamba_n_groups"],
    }
    return _with_state(
        c, itemsize, "Mamba-2", mixer, c["hidden_size"] // c["num_attention_heads"],
        inner * c["mamba_d_state"],
        conv=(c["mamba_d_conv"], inner + 2 * c["mamba_n_groups"] * c["mamba_d_state"]),
        experts=(c["num_local_experts"], c["intermediate_size"], c["shared_intermediate_size"]),
    )  # fmt: skip


def _with_state(c: dict[str, Any], itemsize: int, mixer: str, mixer_shape: dict[str, Any],
                head_dim: int, state: int, conv: tuple[int, int],
                experts: tuple[int, int, int]) -> dict[str, Any]:  # fmt: skip
    """A hybrid's fields: its state layers (float32 state plus the convolution window) and
    attention layers."""
    layer_types = c["layer_types"]
    attention = [t for t in layer_types if t in ("full_attention", "attention")]
    state_layers = len(layer_types) - len(attention)
    kernel, conv_dim = conv
    return {
        "layer_types": layer_types,
        "mixer": mixer,
        "mixer_shape": mixer_shape,
        "state_layers": state_layers,
        "attention_layers": len(attention),
        "num_kv_heads": c["num_key_value_heads"],
        "head_dim": head_dim,
        "num_experts": experts[0],
        "expert_intermediate_size": experts[1],
        "shared_intermediate_size": experts[2],
        "kv_bytes_per_token": 2 * len(attention) * c["num_key_value_heads"] * head_dim * itemsize,
        "state_bytes_per_request": state_layers * (4 * state + (kernel - 1) * conv_dim * itemsize),
    }


def _latent(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """DeepSeek-V3's fields: every layer MLA, caching one latent row per token."""
    layers = c["num_hidden_layers"]
    dense = c["first_k_dense_replace"]
    row = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    return {
        "layer_types": ["mla"] * layers,
        "mixer": "MLA",
        "mixer_shape": {
            "q_lora_rank": c["q_lora_rank"],
            "kv_lora_rank": c["kv_lora_rank"],
            "rope_dim": c["qk_rope_head_dim"],
            "nope_dim": c["qk_nope_head_dim"],
            "value_dim": c["v_head_dim"],
            "dense_layers": dense,
            "dense_intermediate_size": c["intermediate_size"],
        },
        "state_layers": 0,
        "attention_layers": layers,
        "num_kv_heads": 1,
        "head_dim": row,
        "num_experts": c["n_routed_experts"],
        "expert_intermediate_size": c["moe_intermediate_size"],
        "shared_intermediate_size": c["moe_intermediate_size"] * c["n_shared_experts"],
        "kv_bytes_per_token": layers * row * itemsize,
        "state_bytes_per_request": 0,
    }


# ------------------------------------------------------------------------------ the whole run


def _kv_log(path: str) -> dict[str, Any]:
    """What the engine logged about its KV cache: size in tokens and how many requests of
    max_model_len fit at once (fewer than 16 would let the 16-stream rounds preempt)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    size = re.findall(r"KV cache size: ([\d,]+) tokens", text)
    conc = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)
    preempt = len(re.findall(r"preempt", text, flags=re.IGNORECASE))
    return {
        "kv_cache_tokens": int(size[-1].replace(",", "")) if size else None,
        "max_concurrency": float(conc[-1][1]) if conc else None,
        "log_lines_mentioning_preemption": preempt,
    }


def run_family(args: argparse.Namespace, family: str, logs: Path) -> dict[str, Any]:
    from bench.decode_rounds import run as run_rounds

    print(f"[hybrid] {family}: checkpoint", flush=True)
    model = write_hybrid_model(Path(args.work_dir), family, args.quick, args.seed)
    logs.mkdir(parents=True, exist_ok=True)
    result = run_rounds(args, describe_hybrid_model(model), logs, backends=BACKENDS[family],
                        tag=f"hybrid_{family}", module="bench.hybrid", dtype=DTYPE,
                        kv_cache_bytes=KV_CACHE_BYTES[args.quick])  # fmt: skip
    for w in result["workers"].values():
        w["kv"] = _kv_log(w["log"])
    if family == "deepseek_v3":
        print(f"[hybrid] {family}: idle memory", flush=True)
        result["idle_memory"] = idle_memory(args, model, BACKENDS[family], logs)
    return result


def idle_memory(args: argparse.Namespace, model: Path, backends: tuple[str, ...],
                logs: Path) -> list[dict[str, Any]]:  # fmt: skip
    """Resident memory of each backend's engine, up and idle, at each of `IDLE_KV_BYTES`: one
    engine at a time, started, asked nothing, shut down. A pool committed at allocation shows as
    the difference between the sizes; one committed as it is written does not."""
    from bench.decode_rounds import engine_args, max_model_len
    from bench.pooling_worker import Worker, close_all

    inputs = logs / "prompts.json"  # written by the rounds; nothing is generated here
    rows = []
    for kv_bytes in IDLE_KV_BYTES[args.quick]:
        for be in backends:
            engine = engine_args(model, DTYPE, kv_bytes, max_model_len(args), args.quick)
            name = f"idle_{be}_{kv_bytes >> 20}mib"
            worker = Worker(name, be, engine, inputs, logs / f"{name}.log", args.timeout,
                            module="bench.hybrid")  # fmt: skip
            try:
                ready = worker.receive()
            finally:
                close_all([worker])
            rows.append({"backend": be, "kv_cache_bytes": kv_bytes,
                         "idle_rss_bytes": ready["idle_rss_bytes"]})  # fmt: skip
    return rows


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    big = max(STREAMS)
    out: dict[str, Any] = {}
    for family, r in report["families"].items():
        cs, backends = r["cases"], BACKENDS[family]
        s: dict[str, Any] = {
            f"c{big}_vs_c1": {be: round(cs[f"c{big}_{be}"]["decode_tok_s"]
                                        / cs[f"c1_{be}"]["decode_tok_s"], 2)
                              for be in backends},
            "concurrency_ok": all((w["kv"]["max_concurrency"] or 0) >= big
                                  for w in r["workers"].values()),
        }  # fmt: skip
        if "cpu" in backends:
            s["ratios"] = {f"c{n}_plugin_vs_cpu": round(cs[f"c{n}_plugin"]["decode_tok_s"]
                                                        / cs[f"c{n}_cpu"]["decode_tok_s"], 3)
                           for n in STREAMS}  # fmt: skip
            s["agreement_passed"] = r["agreement"]["passed"]
        out[family] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = round_parser("python -m bench.hybrid", __doc__, "tiny hybrids: checks the harness")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    args = p.parse_args(argv)
    if args.reply_fd is not None:
        return worker(args)
    fill_round_defaults(args)
    families = [f for f in args.families.split(",") if f]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {FAMILIES}")
    if args.machine:
        from bench.machine import describe_machine

        Path(args.json).write_text(json.dumps(describe_machine(), indent=2))
        return 0

    from bench.run import _python_stage

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("hybrid-quick" if args.quick else "hybrid")
    logs.mkdir(parents=True, exist_ok=True)
    print("[hybrid] machine", flush=True)
    machine = _python_stage("bench.hybrid", ["--machine"], 600, logs / "machine.log")
    results = {}
    for family in families:
        fam_started = time.perf_counter()
        results[family] = run_family(args, family, logs / family)
        results[family]["seconds"] = round(time.perf_counter() - fam_started, 1)
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
            "backends": {f: list(BACKENDS[f]) for f in families},
            "command": " ".join(
                ["python -m bench.hybrid", *(argv if argv is not None else sys.argv[1:])]
            ),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        "families": results,
    }
    report["summary"] = summarize(report)
    from bench.hybrid_report import write_report

    write_report(report, Path(args.out))
    status = 0
    for family, s in report["summary"].items():
        if s.get("agreement_passed") is False and family not in PEER_DEVIATES:
            print(f"[hybrid] {family}: the backends' first greedy tokens differ", file=sys.stderr)
            status = 1
        if not s["concurrency_ok"]:
            print(f"[hybrid] {family}: an engine holds fewer than {max(STREAMS)} requests",
                  file=sys.stderr)  # fmt: skip
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
