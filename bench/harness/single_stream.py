"""Single-stream generation: raw mlx-lm `stream_generate` and the plugin through `vllm.LLM`.

Both get the same prompts (token ids) and output lengths, greedy, with EOS ignored, so the decode
work is identical; each prints TTFT, TPOT and decode tokens/s per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Prompt token ids: ordinary BPE pieces of the benchmark tokenizer, above its special tokens
# (ids 0-4) and below its markup tokens (762+), so no prompt holds a control token.
_PROMPT_ID_RANGE = (5, 700)


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` distinct random prompts of exactly ``length`` token ids."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(*_PROMPT_ID_RANGE, size=length).tolist() for _ in range(num)]


def _summarize(requests: list[dict[str, float]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in requests)

    return {
        "requests": requests,
        "median_ttft_ms": med("ttft_ms"),
        "median_tpot_ms": med("tpot_ms"),
        "median_decode_tok_s": med("decode_tok_s"),
        "median_e2e_s": med("e2e_s"),
    }


def _request_figures(ttft: float, decode: float, e2e: float, num_tokens: int) -> dict[str, float]:
    tpot = decode / max(1, num_tokens - 1)
    return {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "decode_tok_s": 1.0 / tpot if tpot > 0 else float("inf"),
        "e2e_s": e2e,
        "output_tokens": num_tokens,
    }


def _mlx_lm_requests(model: Any, tokenizer: Any, prompts: list[list[int]], args) -> dict:
    from mlx_lm import stream_generate

    for _ in stream_generate(model, tokenizer, prompts[0], max_tokens=min(4, args.output_len)):
        pass  # warm-up: first-call allocations and kernel setup
    requests = []
    for prompt in prompts[1:]:
        times = []
        start = time.perf_counter()
        for _ in stream_generate(model, tokenizer, prompt, max_tokens=args.output_len):
            times.append(time.perf_counter())
        requests.append(
            _request_figures(times[0] - start, times[-1] - times[0], times[-1] - start, len(times))
        )
    return _summarize(requests)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def run_mlx_lm(args: argparse.Namespace) -> dict[str, Any]:
    """mlx-lm as its users call it: `load` then `stream_generate`, one prompt at a time.

    With ``--also-float32`` the same model is then cast to float32 and measured again: the dtype
    the plugin computes in on MLX's CPU device, where float32 matmuls run on the BLAS and half
    precision ones on MLX's own loops.
    """
    # The plugin's import sets up MLX's CPU BLAS, which has to precede mlx.core: mlx-lm's float32
    # matmuls then run on the same library as the plugin's engine.
    import vllm_metal  # noqa: F401, I001
    from vllm_metal.backends.mlx import blas

    import mlx.core as mx
    from mlx_lm import load

    started = time.perf_counter()
    model, tokenizer = load(args.model)
    load_s = time.perf_counter() - started
    tokenizer.eos_token_ids = set()  # generate exactly output_len tokens, as ignore_eos does
    from mlx.utils import tree_flatten

    dtype = _dtype_name(tree_flatten(model.parameters())[0][1].dtype)

    prompts = make_prompts(args.num_prompts + 1, args.input_len, args.seed)
    out = _mlx_lm_requests(model, tokenizer, prompts, args)
    out.update(
        load_s=load_s,
        device=str(mx.default_device()),
        compute_dtype=dtype,
        cpu_blas=blas.setup_cpu_blas().describe(),
        mlx_cblas_sgemm=blas.mlx_sgemm_provider(),
    )
    if args.also_float32 and dtype != "float32":
        model.set_dtype(mx.float32)
        out["float32"] = {**_mlx_lm_requests(model, tokenizer, prompts, args),
                          "compute_dtype": "float32"}  # fmt: skip
    return out


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """The plugin through the offline `vllm.LLM` API, one prompt per `generate` call."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        seed=0,
        disable_log_stats=False,  # fills RequestOutput.metrics with engine timestamps
    )
    engine_start_s = time.perf_counter() - started
    from vllm.platforms import current_platform

    platform = type(current_platform).__name__
    compute = None
    if platform == "MetalPlatform":
        import mlx.core as mx

        from vllm_metal.backends.mlx.device import compute_dtype

        compute = _dtype_name(compute_dtype(getattr(mx, args.dtype)))

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    prompts = make_prompts(args.num_prompts + 1, args.input_len, args.seed)
    warm = SamplingParams(max_tokens=min(4, args.output_len), ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompts[0]}], warm, use_tqdm=False)

    requests = []
    for prompt in prompts[1:]:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        e2e = time.perf_counter() - start
        n = len(out.outputs[0].token_ids)
        m = out.metrics
        if m is None or not m.first_token_ts:
            raise RuntimeError("vLLM returned no request metrics; cannot split TTFT from decode")
        # first_token_latency is measured by the front end from arrival; the token timestamps
        # come from the engine core's clock.
        requests.append(
            _request_figures(m.first_token_latency, m.last_token_ts - m.first_token_ts, e2e, n)
        )
    out_summary = _summarize(requests)
    out_summary.update(engine_start_s=engine_start_s, platform=platform, compute_dtype=compute)
    return out_summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", choices=("mlx-lm", "vllm"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=64 * 2**20)
    p.add_argument(
        "--also-float32",
        action="store_true",
        help="mlx-lm: also measure the model cast to float32 (the plugin's CPU compute dtype)",
    )
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    result = run_mlx_lm(args) if args.engine == "mlx-lm" else run_vllm(args)
    result.update(input_len=args.input_len, output_len=args.output_len)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
