"""Images on the MLX runner: the tiny random Idefics3 (`tests.fixtures.tiny_idefics3`) served by
one engine, its greedy tokens checked against transformers float32 row by row.

The engine prefills at most 24 tokens per step, so the 46-token prompt of a 64x64 image (4 tiles
and a global image: 34 placeholder positions, 20 of them image rows) is cut inside its image span
and the encoder output is read by two steps. vLLM's prefix caching keys blocks by the image's
content hash: the same image again reuses the prompt's blocks, another image behind the same text
reuses none of the blocks its image touches.
"""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import greedy, run_engine_job
from tests.fixtures.tiny_idefics3 import tiny_image
from tests.fixtures.vision_oracles import idefics3_generate, idefics3_prompt_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
BLOCK_SIZE = 16
ONE_IMAGE = "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:"
TWO_IMAGES = "<|im_start|>User:<image>and<image>Same?<end_of_utterance>\nAssistant:"
TEXT_ONLY = "<|im_start|>User:What is this?<end_of_utterance>\nAssistant:"

# (prompt, images as [seed, width, height]); the wide image's global tile is padded.
BATCH = [
    (ONE_IMAGE, [[0, 64, 64]]),
    (ONE_IMAGE, [[1, 64, 64]]),
    (TEXT_ONLY, []),
    (TWO_IMAGES, [[2, 64, 64], [3, 48, 32]]),
    (ONE_IMAGE, [[4, 64, 40]]),
]
AGAIN = (ONE_IMAGE, [[0, 64, 64]])  # the first row's image, again: a prefix-cache hit
OTHER = (ONE_IMAGE, [[5, 64, 64]])  # the same text with a new image


def _request(prompt: str, images: list[list[int]]) -> dict | str:
    return {"prompt": prompt, "images": images} if images else prompt


def _oracle(model_dir, prompt: str, images: list[list[int]]) -> list[int]:
    pictures = [tiny_image(seed, (w, h)) for seed, w, h in images]
    return idefics3_generate(model_dir, prompt, pictures, MAX_TOKENS)


@pytest.fixture(scope="module")
def results(tiny_idefics3_dir):
    jobs = [
        {"prompts": [_request(*row) for row in BATCH], "params": [greedy(MAX_TOKENS)]},
        {"prompts": [_request(*AGAIN)], "params": [greedy(MAX_TOKENS)]},
        {"prompts": [_request(*OTHER)], "params": [greedy(MAX_TOKENS)]},
    ]
    engine = {
        "max_num_batched_tokens": 24,
        "enable_prefix_caching": True,
        "block_size": BLOCK_SIZE,
        "limit_mm_per_prompt": {"image": 2},
    }
    return run_engine_job(tiny_idefics3_dir, jobs, engine=engine)


def _tokens(result: list[dict]) -> list[list[int]]:
    return [r["outputs"][0]["token_ids"] for r in result]


def test_a_mixed_batch_of_image_and_text_requests_matches_transformers(
    results, tiny_idefics3_dir
) -> None:
    got = _tokens(results[0])
    expected = [_oracle(tiny_idefics3_dir, *row) for row in BATCH]
    assert got == expected
    # The image decides the output: the two one-image rows differ only in their image.
    assert got[0] != got[1]
    assert len({tuple(t) for t in got}) == len(got)


def test_the_same_image_again_reuses_the_cached_prompt(results, tiny_idefics3_dir) -> None:
    (again,) = results[1]
    assert again["outputs"][0]["token_ids"] == _oracle(tiny_idefics3_dir, *AGAIN)
    prompt_len = len(idefics3_prompt_ids(tiny_idefics3_dir, ONE_IMAGE, [tiny_image(0)]))
    # Every full block of the prompt but the last token's is a hit.
    assert again["num_cached_tokens"] == (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_a_new_image_behind_the_same_text_reuses_no_image_block(results, tiny_idefics3_dir) -> None:
    (other,) = results[2]
    assert other["outputs"][0]["token_ids"] == _oracle(tiny_idefics3_dir, *OTHER)
    # The image starts within the first block, so no block can be shared.
    assert other["num_cached_tokens"] == 0
