"""The GPU-proxy suite's engines, one per process (`bench/suites/gpu_proxy.py` starts them):

    python -m bench.suites.gpu_proxy_worker --engine mlx_lm|plugin|attention --spec JSON --result FILE

`mlx_lm`: stock mlx-lm, `stream_generate` for one stream and `batch_generate` for several.
`plugin`: `vllm.LLM` on the vllm-metal of the spec's `plugin_tree` (else the one on the path),
its engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that the phase
timers (`PhaseTimers`) see the runner, and a cProfile pass after the timed rounds.
Both: greedy, EOS ignored, the same random prompts; decode tok/s leaves prefill out
(mlx-lm's own `generation_tps`; the plugin's streams / median TPOT from vLLM's metrics).
`attention`: a decode step's attention alone, the plugin's pure-MLX paged version against
attention over a contiguous cache (`run_attention`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any


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

    model, tokenizer = load(spec["model"])
    tokenizer.eos_token_ids = []  # EOS ignored, as for the plugin
    inputs = prompts(max(spec["streams"]), spec["input_len"], spec["vocab_size"], spec["seed"])

    def single(max_tokens: int) -> dict[str, Any]:
        last = None
        for last in stream_generate(model, tokenizer, inputs[0], max_tokens=max_tokens):
            pass
        return {"decode_tok_s": last.generation_tps, "tokens": last.generation_tokens}

    def batch(n: int, max_tokens: int) -> dict[str, Any]:
        out = batch_generate(model, tokenizer, inputs[:n], max_tokens=max_tokens,
                             completion_batch_size=n, prefill_batch_size=min(n, 8))  # fmt: skip
        return {"decode_tok_s": out.stats.generation_tps, "tokens": out.stats.generation_tokens}

    single(8)  # warm-up
    batch(max(spec["streams"]), 8)
    cases = {}
    for n in spec["streams"]:
        cases[str(n)] = single(spec["output_len"]) if n == 1 else batch(n, spec["output_len"])
        cases[str(n)]["how"] = "stream_generate" if n == 1 else "batch_generate"
    return {"cases": cases, "device": device_facts()}


# ----------------------------------------------------------------------------------- plugin


class PhaseTimers:
    """Wall time of a step's phases, by wrapping the runner's and engine's methods: graph build
    (the model state's `hidden_states` and `logits`: the forward's own Python), host other (the
    rest of `execute_model`: request state, packing, metadata), submit (`mx.async_eval`), wait
    (the logits, or the tokens sampled on the device, reaching the host), sampling (vLLM's sampler and the write-back: the
    rest of `sample_step`) and the engine around them (scheduler, output processing: the rest of
    `LLMEngine.step`). Under async scheduling `execute_model` first samples the step before it;
    that sampling counts as sampling, not as the step's build."""

    def __init__(self) -> None:
        self.records: dict[str, float] = {}
        self.steps = 0
        self._depth: list[str] = []

    def timed(self, name: str, fn: Any) -> Any:
        timers = self

        def call(*args: Any, **kwargs: Any) -> Any:
            timers._depth.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                timers._depth.pop()
                timers.records[name] = timers.records.get(name, 0.0) + seconds
                if name == "sample_step" and "execute_model" in timers._depth:
                    key = "sample_step_in_execute"
                    timers.records[key] = timers.records.get(key, 0.0) + seconds
                if name == "execute_model":
                    timers.steps += 1

        return call

    def install(self) -> None:
        import mlx.core as mx
        from vllm.v1.engine.llm_engine import LLMEngine

        from vllm_metal.backends.mlx.runner import model_runner, sample
        from vllm_metal.backends.mlx.runner.model_states import decoder, interface

        LLMEngine.step = self.timed("engine_step", LLMEngine.step)
        sample.sample_step = self.timed("sample_step", sample.sample_step)
        sample.to_torch = self.timed("wait", sample.to_torch)
        if hasattr(sample, "to_host"):  # the tokens of a step sampled on the device
            sample.to_host = self.timed("wait", sample.to_host)
        runner = model_runner.MLXModelRunner
        runner.execute_model = self.timed("execute_model", runner.execute_model)
        submit = self.timed("submit", mx.async_eval)
        plain = mx.async_eval
        mx.async_eval = lambda *a: (submit if "execute_model" in self._depth else plain)(*a)
        for cls in (interface.ModelState, decoder.DecoderState):
            for attr in ("hidden_states", "logits"):
                if attr in vars(cls):
                    setattr(cls, attr, self.timed("graph", vars(cls)[attr]))

    def reset(self) -> None:
        self.records, self.steps = {}, 0

    def summary(self) -> dict[str, float]:
        """Mean ms per model step of each phase over a round (its prefill steps included: one or
        two of the round's hundreds)."""
        r = {k: v * 1e3 / max(1, self.steps) for k, v in self.records.items()}
        get = lambda k: r.get(k, 0.0)
        graph = get("graph")
        build = get("execute_model") - get("submit") - get("sample_step_in_execute")
        return {
            "graph_build_ms": round(graph, 3),
            "host_other_ms": round(build - graph, 3),
            "submit_ms": round(get("submit"), 3),
            "wait_ms": round(get("wait"), 3),
            "sample_ms": round(get("sample_step") - get("wait"), 3),
            "engine_other_ms": round(
                get("engine_step") - build - get("submit") - get("sample_step"), 3
            ),
            "step_ms": round(get("engine_step"), 3),
            "steps": self.steps,
        }


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
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
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
    profiles = {}
    for n in spec["profile_streams"]:
        profiler = cProfile.Profile()
        profiler.enable()
        generate(n, spec["profile_tokens"])
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(45)
        profiles[str(n)] = text.getvalue()
    return {"cases": cases, "profiles": profiles, "engine_start_s": round(engine_start_s, 1),
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
