"""Gemma 3, Qwen2.5-VL and Qwen3-VL with images through the engine: vLLM's own processor expands
each image marker and prepares the pixels, the scheduler batches, chunks (keeping a Gemma 3
image in one step) and caches prefixes, the MLX runner encodes and decodes; greedy tokens are
checked against transformers float32 row by row.

Runs where vLLM can build these families' configs: their processor modules import torchvision,
which does not load beside vLLM's Linux torch build, so this file runs in the macOS job and is
skipped on Linux, where the same runner path is checked step by step below vLLM's front end
(`test_gemma3_vl.py`, `test_qwen_vl.py`, `test_qwen_vl_video.py`).
"""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import greedy, run_engine_job
from tests.fixtures import vision_oracles
from tests.fixtures.tiny_idefics3 import tiny_image

MAX_TOKENS = 8
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# family -> (checkpoint fixture, image marker, image size, greedy oracle)
FAMILIES = {
    "gemma3": (
        "tiny_gemma3_dir",
        "<start_of_image>",
        (64, 64),
        vision_oracles.gemma3_generate,
    ),
    "qwen2_5_vl": ("tiny_qwen2_5_vl_dir", QWEN_IMAGE, (56, 56), vision_oracles.qwen2_5_vl_generate),
    "qwen3_vl": ("tiny_qwen3_vl_dir", QWEN_IMAGE, (64, 64), vision_oracles.qwen3_vl_generate),
}


def _vllm_builds_these_configs() -> bool:
    try:
        import torchvision  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # missing, or built for another torch
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not _vllm_builds_these_configs(),
        reason="vLLM's Gemma 3 / Qwen-VL processors import torchvision, which does not load here",
    ),
]


def _batch(marker: str, size: tuple[int, int]) -> list[tuple[str, list[list[int]]]]:
    """(prompt, images as [seed, width, height]): one image, another image, text only, two."""
    one = TURN.format(f"Look: {marker}What is it?")
    two = TURN.format(f"First {marker} then {marker}Same?")
    return [
        (one, [[0, *size]]),
        (one, [[1, *size]]),
        (TURN.format("What is the capital of Japan?"), []),
        (two, [[2, *size], [3, *size]]),
    ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_mixed_batch_matches_transformers(request, family) -> None:
    fixture, marker, size, generate = FAMILIES[family]
    model_dir = request.getfixturevalue(fixture)
    batch = _batch(marker, size)
    prompts = [{"prompt": p, "images": imgs} if imgs else p for p, imgs in batch]
    engine = {
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "limit_mm_per_prompt": {"image": 2},
    }
    jobs = [{"prompts": prompts, "params": [greedy(MAX_TOKENS)]}]
    (result,) = run_engine_job(model_dir, jobs, engine=engine)
    got = [r["outputs"][0]["token_ids"] for r in result]
    expected = [
        generate(model_dir, p, [tiny_image(s, (w, h)) for s, w, h in imgs], MAX_TOKENS)
        for p, imgs in batch
    ]
    assert got == expected
    assert got[0] != got[1]  # the image decides the output
