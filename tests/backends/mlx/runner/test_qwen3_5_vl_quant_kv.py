"""Quantized KV caches under Qwen3.5 with images (its published form: a Gated DeltaNet hybrid with
a vision tower, kind `vision_state_hybrid`), driven step by step as `test_qwen3_5_vl.py` drives
it (vLLM's Qwen3.5 processor needs torchvision, which does not load here): the full-attention
layers' pages in the format, the state pages float, in chunks of 5 tokens that cut every image
span. Oracle: transformers float32 whose language model reads K/V through the float64 port of
the format (`test_vision_quant_kv._language_model_reads`; its vision tower untouched)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner import test_qwen3_5_vl as qwen3_5_vl
from tests.backends.mlx.runner.media_steps import run_greedy
from tests.backends.mlx.runner.qwen_vl_steps import NEW_TOKENS, cached_request
from tests.backends.mlx.runner.test_qwen3_5_vl import CASES, _video
from tests.backends.mlx.runner.test_vision_quant_kv import _language_model_reads
from tests.fixtures import qwen3_5_vl_oracle as oracle
from tests.fixtures.tiny_idefics3 import tiny_image

pytestmark = [pytest.mark.slow, pytest.mark.full]

family = qwen3_5_vl.family  # the tiny Qwen3.5 with its tower, loaded once per module
# A block's attention page must hold a state page (35,840 bytes): 1,024 tokens of fp8 K/V (128
# bytes a token) or of int4 rows with their scales (72), as the platform sizes it.
BLOCK_SIZE = 1024


def _greedy(family, case: str, quant) -> tuple[list[int], np.ndarray]:
    prompt, images, videos = CASES[case]
    pictures = [tiny_image(seed, size) for seed, size in images]
    clips = [_video(seed, size) for seed, size in videos]
    inputs = oracle.qwen3_5_inputs(family.dir, prompt, pictures, clips)
    names = {"image": [f"image-{i}" for i in range(len(images))], "video": []}
    state = cached_request(family, inputs, names)
    options = {"chunk": 5, "new_tokens": NEW_TOKENS, "block_size": BLOCK_SIZE}
    return run_greedy(family.adapter, {"r": state}, quant=quant, **options)["r"]


@pytest.mark.parametrize("dtype", ["fp8", "int4_per_token_head"])
@pytest.mark.parametrize("case", ["two-images", "text-only"])
def test_images_over_quantized_attention_pages(family, case, dtype) -> None:
    """Greedy tokens equal the oracle's and the last prompt logits are within 1e-3 of it; the
    format moves those logits by more than 5e-3 (the pages are read quantized; measured 0.011 /
    0.042 with two images, 0.023 / 0.107 text-only, fp8 / int4)."""
    from vllm_metal.kv.quant import kv_cache_quant

    quant = kv_cache_quant(dtype, len(family.adapter.layer_kinds()))
    tokens, logits = _greedy(family, case, quant)
    _, plain_logits = _greedy(family, case, None)
    prompt, images, _ = CASES[case]
    with _language_model_reads(dtype, "qwen3_5"):
        expected, expected_logits = oracle.qwen3_5_generate(
            family.dir, prompt, [tiny_image(seed, size) for seed, size in images], NEW_TOKENS
        )
    assert tokens == expected
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-3, atol=1e-3)
    moved = float(np.abs(logits - plain_logits).max())
    print(f"qwen3.5 {dtype} {case}: the format moves the last prompt logits by up to {moved:.3f}")
    assert moved > 5e-3


@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_images_over_turboquant_slots(family, name) -> None:
    """Every attention layer stores slots (vLLM keeps no boundary layers in a hybrid). In chunks
    of 5 the first chunk attends over its rows unquantized and every later chunk, as every decode
    row, reads its keys from the slots (vLLM's rule for chunks under 128 rows), so the oracle is
    teacher-forced over the engine's tokens with its first 5 rows unquantized: each greedy token
    is the oracle's top token, and the last prompt logits are within 1e-3 of its row."""
    import sys

    from tests.fixtures.turboquant_reference import attention_through_slots
    from vllm_metal.kv.turboquant import TurboQuantCache

    kinds = family.adapter.layer_kinds()
    quant = TurboQuantCache(name, tuple(not kind.is_state for kind in kinds))
    case = "two-images"
    tokens, logits = _greedy(family, case, quant)
    prompt, images, _ = CASES[case]
    pictures = [tiny_image(seed, size) for seed, size in images]
    module = sys.modules["transformers.models.qwen3_5.modeling_qwen3_5"]
    with attention_through_slots(module, name, 5, skip=()):
        rows = oracle.qwen3_5_forced_logits(family.dir, prompt, pictures, tokens)
    plain = oracle.qwen3_5_forced_logits(family.dir, prompt, pictures, tokens)
    np.testing.assert_allclose(logits, rows[0], rtol=1e-3, atol=1e-3)
    margins = rows[:-1].max(-1) - rows[np.arange(len(tokens)), tokens]
    assert margins.max() <= 1e-3, margins  # each token the oracle's choice, up to a near-tie
    moved = float(np.abs(rows[0] - plain[0]).max())
    print(f"qwen3.5 {name}: the format moves the last prompt logits by up to {moved:.3f}")
    assert moved > 5e-3
