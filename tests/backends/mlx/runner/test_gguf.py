"""GGUF files served by the engine as vLLM documents it (`model=FILE.gguf`, `tokenizer=...`): F16
gives transformers' own GGUF loading's greedy tokens and logprobs; Q8_0 and Q4_0 (MLX quantized
layers) agree with it except where its top two logits nearly tie."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.fixtures.oracles import hf_greedy, hf_logits
from tests.fixtures.tiny_gguf import write_tiny_gguf

NEW_TOKENS = 24
PROMPTS = random_prompts(11, [1, 6, 23, 50])


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-engine")


def divergence_gaps(model, prompts, ours, new_tokens) -> list[float]:
    """Per prompt, where our greedy tokens first differ from the float32 reference's: the
    reference's logit of its own choice minus its logit of ours at that step (0.0 when none
    differ). A quantization or kernel error flips clear choices; rounding only near-ties."""
    gaps = []
    for prompt, got, want in zip(prompts, ours, hf_greedy(model, prompts, new_tokens)):
        step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if step is None:
            gaps.append(0.0)
            continue
        logits = hf_logits(model, list(prompt) + got[:step])[-1]
        gaps.append(float(logits[want[step]] - logits[got[step]]))
    return gaps


@pytest.mark.slow
def test_f16_file_matches_transformers_gguf_loading(tiny_model_dir, gguf_dir):
    """Llama (llama.cpp permutes its q/k rows), the tokenizer from `--tokenizer`."""
    src = tiny_model_dir("llama")
    model = write_tiny_gguf(src, gguf_dir / "llama-f16.gguf", "F16")
    (batch,) = run_engine_job(
        model,
        [{"prompts": PROMPTS, "params": [greedy(NEW_TOKENS, logprobs=1)]}],
        engine={"tokenizer": str(src)},
    )
    assert tokens(batch) == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert_logprobs_match_hf(model, PROMPTS, batch)


@pytest.mark.full
def test_q8_0_file_in_its_own_dtype(tiny_model_dir, gguf_dir):
    """Qwen3 Q8_0 at vLLM's default dtype for it (float16, the type of its block scales)."""
    src = tiny_model_dir("qwen3", head_dim=128)  # transformers' GGUF config keeps head_dim 128
    model = write_tiny_gguf(src, gguf_dir / "qwen3-q8_0.gguf", "Q8_0")
    (batch,) = run_engine_job(
        model,
        [{"prompts": PROMPTS, "params": [greedy(NEW_TOKENS)]}],
        engine={"tokenizer": str(src), "dtype": "auto"},
    )
    gaps = divergence_gaps(model, PROMPTS, tokens(batch), NEW_TOKENS)
    assert max(gaps) < 0.05, gaps


@pytest.mark.slow
def test_q4_0_file_with_config_and_tokenizer_from_elsewhere(
    tiny_model_dir, tiny_quantized_dir, gguf_dir, tmp_path
):
    """Llama Q4_0 with `--hf-config-path` an MLX-quantized checkpoint (bfloat16) and no
    `--tokenizer`: text prompts are tokenized by the tokenizer rebuilt from the file's metadata,
    as the original tokenizer does (the reference runs on the original's token ids)."""
    from transformers import AutoTokenizer

    src = tiny_model_dir("llama")
    model = write_tiny_gguf(src, gguf_dir / "llama-q4_0.gguf", "Q4_0")
    config_dir = tiny_quantized_dir("llama", bits=4, group_size=64)
    texts = [
        "The old lighthouse stood at the edge of the cliff",
        "def fibonacci(n: int) -> list[int]:",
        "Mix 200 grams of flour, 2 eggs and a pinch of salt.",
    ]
    (batch,) = run_engine_job(
        model,
        [{"prompts": texts, "params": [greedy(NEW_TOKENS)]}],
        engine={"hf_config_path": str(config_dir), "dtype": "auto"},
        env={"VLLM_CACHE_ROOT": str(tmp_path)},
    )
    prompts = [AutoTokenizer.from_pretrained(src)(t).input_ids for t in texts]
    # The bfloat16 KV cache (8-bit mantissa) moves these logits by up to ~0.15 (in float32 the
    # tokens are the reference's); a wrong scale, bias or nibble order moves them by units.
    gaps = divergence_gaps(model, prompts, tokens(batch), NEW_TOKENS)
    assert max(gaps) < 0.3, gaps
    assert all(r["outputs"][0]["text"] for r in batch)
