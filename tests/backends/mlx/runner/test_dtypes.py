"""Half-precision runs track transformers float32; MLX-quantized checkpoints match stock mlx-lm."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import greedy, run_engine_job, tokens
from tests.fixtures.oracles import hf_logprobs, mlx_lm_greedy

pytestmark = pytest.mark.slow

PROMPTS = [list(range(5, 5 + n)) for n in (3, 30, 60)]


def _mlx_lm_logprobs(model_dir, seq: list[int]) -> np.ndarray:
    """Stock mlx-lm forward over `seq` in the checkpoint's dtype (no cache, no paging)."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(model_dir))
    logits = model(mx.array([seq]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


# (arch, dtype): vLLM refuses float16 for Gemma 3, so float16 runs on Llama. CI runs one case of
# each dtype; the others are in the `full` tier.
CASES = [
    ("qwen3", "bfloat16"),
    pytest.param("gemma3", "bfloat16", marks=pytest.mark.full),
    ("llama", "float16"),
    pytest.param("qwen3", "float16", marks=pytest.mark.full),
]


@pytest.mark.parametrize("arch,dtype", CASES)
def test_half_precision_is_as_accurate_as_stock_mlx_lm(tiny_model_dir, arch, dtype):
    """Against transformers float32, the paged runner's half-precision logprobs are no further off
    than stock mlx-lm's own forward in the same dtype (a wrong mask or head mapping is whole
    units off; rounding is hundredths)."""
    model = tiny_model_dir(arch, dtype)
    (batch,) = run_engine_job(
        model, [{"prompts": PROMPTS, "params": [greedy(24, logprobs=1)]}], engine={"dtype": dtype}
    )
    for prompt, result in zip(PROMPTS, batch):
        sample = result["outputs"][0]
        toks = sample["token_ids"]
        seq = prompt + toks
        rows = slice(len(prompt) - 1, len(seq) - 1)
        ref = hf_logprobs(model, seq)[rows]
        stock = _mlx_lm_logprobs(model, seq)[rows]
        ours = np.array([sample["logprobs"][i][str(t)] for i, t in enumerate(toks)])
        idx = np.arange(len(toks))
        ours_err = np.abs(ours - ref[idx, toks])
        stock_err = np.abs(stock[idx, toks] - ref[idx, toks])
        assert ours_err.mean() <= max(1.5 * stock_err.mean(), 0.02), (ours_err, stock_err)
        assert ours_err.max() <= max(2.0 * stock_err.max(), 0.05), (ours_err, stock_err)


@pytest.mark.parametrize("bits,group_size", [(4, 64), pytest.param(8, 32, marks=pytest.mark.full)])
def test_quantized_checkpoint_matches_mlx_lm(tiny_quantized_dir, bits, group_size):
    model = tiny_quantized_dir("qwen3", bits=bits, group_size=group_size)
    (batch,) = run_engine_job(model, [{"prompts": PROMPTS, "params": [greedy(16)]}])
    assert tokens(batch) == mlx_lm_greedy(model, PROMPTS, 16, dtype="float32")
