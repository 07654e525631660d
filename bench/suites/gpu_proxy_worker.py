"""The GPU-proxy suite's engines, one per process (`bench/suites/gpu_proxy.py` starts them):

    python -m bench.suites.gpu_proxy_worker --engine mlx_lm|plugin|attention --spec JSON --result FILE

`mlx_lm`: stock mlx-lm, `stream_generate` for one stream and `batch_generate` for several.
`plugin`: `vllm.LLM` on the vllm-metal of the spec's `plugin_tree` (else the one on the path),
its engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that the phase
timers (`PhaseTimers`) see the runner, and a cProfile pass after the timed rounds.
Both: with `kernel_streams`, a round under torch's profiler (`bench.harness.kernels`: the CUDA
kernels and API calls per step).
Both: greedy (or the spec's `sampling`; the plugin's requests seeded with `seeded`), EOS
ignored, the same random prompts; decode tok/s leaves prefill out
(mlx-lm's own `generation_tps`; the plugin's streams / median TPOT from vLLM's metrics).
`attention`: a decode step's attention alone, the plugin's pure-MLX paged version against
attention over a contiguous cache (`run_attention`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.kernels import kernel_profile
from bench.harness.phases import PhaseTimers, profiled


def prompts(n: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`n` prompts of `input_len` random token ids (the same for every engine)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab_size, 30000), size=(n, input_len)).tolist()


def device_facts() -> dict[str, Any]:
    import mlx.core as mx

    info = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    return {"mlx": mx.__version__, "default_device": str(mx.default_device()), **info}


# ----------------------------------------------------------------------------------- mlx-lm


def run_mlx_lm(spec: dict[str, Any]) -> dict[str, Any]:
    from mlx_lm import batch_generate, load, stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from vllm_metal.models.families.qwen3_5 import MLX_LM_MODULES

    # mlx-lm knows Qwen3.5 by its wrapper's model types only; it reads a text-only config as
    # the wrapper's text model when told that type.
    model_type = json.loads((Path(spec["model"]) / "config.json").read_text())["model_type"]
    wrapper = MLX_LM_MODULES.get(model_type)
    model, tokenizer = load(spec["model"], model_config={"model_type": wrapper} if wrapper else {})
    tokenizer.eos_token_ids = []  # EOS ignored, as for the plugin
    inputs = prompts(max(spec["streams"]), spec["input_len"], spec["vocab_size"], spec["seed"])
    processors, sampling = None, spec.get("sampling")
    sampler = (
        None
        if sampling is None
        else make_sampler(
            temp=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"]
        )
    )
    if spec.get("presence_penalty"):
        processors = make_logits_processors(
            presence_penalty=spec["presence_penalty"],
            presence_context_size=spec["input_len"] + spec["output_len"],
        )

    def single(max_tokens: int) -> dict[str, Any]:
        last = None
        for last in stream_generate(model, tokenizer, inputs[0], max_tokens=max_tokens,
                                    logits_processors=processors, sampler=sampler):  # fmt: skip
            pass
        return {"decode_tok_s": last.generation_tps, "tokens": last.generation_tokens}

    def batch(n: int, max_tokens: int) -> dict[str, Any]:
        out = batch_generate(model, tokenizer, inputs[:n], max_tokens=max_tokens,
                             completion_batch_size=n, prefill_batch_size=min(n, 8),
                             logits_processors=processors, sampler=sampler)  # fmt: skip
        return {"decode_tok_s": out.stats.generation_tps, "tokens": out.stats.generation_tokens}

    single(8)  # warm-up
    batch(max(spec["streams"]), 8)
    cases = {}
    for n in spec["streams"]:
        cases[str(n)] = single(spec["output_len"]) if n == 1 else batch(n, spec["output_len"])
        cases[str(n)]["how"] = "stream_generate" if n == 1 else "batch_generate"

    def profiled_round(n: int) -> dict[str, Any]:
        ran: dict[str, Any] = {}
        run = lambda: ran.update(
            single(spec["profile_tokens"]) if n == 1 else batch(n, spec["profile_tokens"])
        )
        return kernel_profile(run, lambda: ran["tokens"] // n)

    kernels = {str(n): profiled_round(n) for n in spec.get("kernel_streams", [])}
    return {"cases": cases, "kernels": kernels, "device": device_facts()}


# ----------------------------------------------------------------------------------- plugin


def run_plugin(spec: dict[str, Any]) -> dict[str, Any]:
    import sys

    if spec.get("plugin_tree"):  # this tree's vllm_metal; `bench` stays the suite's own
        sys.path.insert(0, spec["plugin_tree"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(spec.get("plugin_env", {}))
    timers = PhaseTimers()
    timers.install()
    from vllm import LLM, SamplingParams

    import vllm_metal

    biggest = max(spec["streams"])
    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", seed=spec["seed"], max_num_seqs=biggest,
              max_model_len=spec["input_len"] + spec["output_len"] + 16,
              enable_prefix_caching=False, kv_cache_memory_bytes=spec["kv_bytes"],
              disable_log_stats=False)  # fmt: skip
    engine_start_s = time.perf_counter() - started
    inputs = prompts(biggest, spec["input_len"], spec["vocab_size"], spec["seed"])

    def generate(n: int, max_tokens: int) -> dict[str, Any]:
        sampling = spec.get("sampling") or {"temperature": 0.0}
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling,
                                 seed=spec["seed"] + i if spec.get("seeded") else None,
                                 presence_penalty=spec.get("presence_penalty", 0.0))
                  for i in range(n)]  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in inputs[:n]], params, use_tqdm=False)
        tpot = []
        for o in outs:
            m, k = o.metrics, len(o.outputs[0].token_ids)
            tpot.append((m.last_token_ts - m.first_token_ts) / max(1, k - 1))
        return {"decode_tok_s": n / statistics.median(tpot),
                "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}  # fmt: skip

    generate(biggest, 8)  # warm-up
    generate(1, 8)
    cases = {}
    for n in spec["streams"]:
        timers.reset()
        cases[str(n)] = {**generate(n, spec["output_len"]), "phases": timers.summary()}
    profiles, kernels = {}, {}
    for n in spec["profile_streams"]:
        profiles[str(n)] = profiled(lambda n=n: generate(n, spec["profile_tokens"]))
    for n in spec.get("kernel_streams", []):
        timers.reset()
        kernels[str(n)] = kernel_profile(lambda n=n: generate(n, spec["profile_tokens"]),
                                         lambda: timers.steps)  # fmt: skip
    return {"cases": cases, "profiles": profiles, "kernels": kernels, "engine_start_s": round(engine_start_s, 1),
            "plugin_path": str(Path(vllm_metal.__file__).parent), "device": device_facts()}  # fmt: skip


# -------------------------------------------------------------------------------- attention


def run_attention(spec: dict[str, Any]) -> dict[str, Any]:
    """A decode step's attention alone, every layer of the checkpoint's shape at the run's last
    context (prompt + output): the plugin's pure-MLX paged attention and, on MLX's CUDA GPU, its
    CUDA decode kernel (`ops/attention/cuda.py`, with its largest difference from the pure-MLX
    op), against `mx.fast.scaled_dot_product_attention` over a contiguous cache (what mlx-lm
    runs), all `mx.compile`d; ms per step, the best of a few repetitions."""
    import math

    import mlx.core as mx
    import numpy as np

    if spec.get("plugin_tree"):
        sys.path.insert(0, spec["plugin_tree"])
    from vllm_metal.ops.attention import batched

    try:  # trees before the CUDA decode kernel
        from vllm_metal.ops.attention import cuda
    except ImportError:
        cuda = None

    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    context, block = spec["input_len"] + spec["output_len"], 16
    blocks = math.ceil(context / block)
    scale = dim**-0.5

    def best_ms(fn: Any) -> float:
        mx.eval(fn())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t0)
        return min(times) * 1000

    cases = {}
    for n in spec["streams"]:
        shape = (n * blocks + 1, block, kv_heads, dim)
        pools = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2 * layers)]
        tables = mx.array(1 + np.arange(n * blocks, dtype=np.int32).reshape(n, blocks))
        lens = mx.array(np.full(n, context, dtype=np.int32))
        q = mx.random.normal((n, heads, dim)).astype(mx.bfloat16)
        cache = [mx.random.normal((n, kv_heads, context, dim)).astype(mx.bfloat16)
                 for _ in range(2 * layers)]  # fmt: skip
        mx.eval(pools, cache, q)

        def paged(pools=pools, tables=tables, lens=lens, q=q):
            return [batched.decode_attention(q, pools[2 * i], pools[2 * i + 1], tables, lens,
                                             scale=scale) for i in range(layers)]  # fmt: skip

        def contiguous(cache=cache, q=q):
            return [mx.fast.scaled_dot_product_attention(q[:, :, None], cache[2 * i],
                                                         cache[2 * i + 1], scale=scale)
                    for i in range(layers)]  # fmt: skip

        cases[str(n)] = {"paged_ms": round(best_ms(mx.compile(paged)), 3),
                         "contiguous_ms": round(best_ms(mx.compile(contiguous)), 3)}  # fmt: skip
        if cuda is not None and cuda.available():

            def kernel(pools=pools, tables=tables, lens=lens, q=q):
                return [cuda.decode_attention(q, pools[2 * i], pools[2 * i + 1], tables, lens,
                                              scale=scale) for i in range(layers)]  # fmt: skip

            error = mx.max(mx.abs(kernel()[0].astype(mx.float32) - paged()[0].astype(mx.float32)))
            cases[str(n)]["cuda_kernel_ms"] = round(best_ms(mx.compile(kernel)), 3)
            cases[str(n)]["cuda_kernel_max_error"] = float(error.item())
        del pools, cache
    return {"cases": cases, "layers": layers, "context": context, "device": device_facts()}


ENGINES = {"mlx_lm": run_mlx_lm, "plugin": run_plugin, "attention": run_attention}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", choices=tuple(ENGINES), required=True)
    p.add_argument("--spec", required=True, help="JSON: model, streams, input/output lengths...")
    p.add_argument("--result", required=True, help="JSON file written at the end")
    args = p.parse_args(argv)
    spec = json.loads(args.spec)
    t0 = time.perf_counter()
    result = ENGINES[args.engine](spec)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
