"""TurboQuant KV caches on models of sliding-window and full-attention layers (Gemma 3, GPT-OSS,
Gemma 4). vLLM keeps the boundary layers at the model's dtype and groups each kind of layer
apart, so one region holds float pages and TurboQuant slots of several groups, padded to the
largest page (`kv.pool`); Gemma 4 adds two head sizes and layers reading earlier layers' slots
(in their writer's format).

Oracle: transformers float32 whose quantized layers read keys and values through the float64
port of vLLM's store -> decode rules (`tests/fixtures/turboquant_reference.py`; prompt rows over
the unquantized step, decode rows over the slots). On these checkpoints a last-bit difference of
a key moves an fp8 or 4-bit level now and then (1e-5 relative noise on the oracle's own keys
moves Gemma 3's `turboquant_k8v4` logprobs by 0.03 on average), so the engine is held to a mean
well under what the format moves and a bound on any token; a page read through another layer's
layout is NaN or nats off."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    errors_and_shift,
    greedy,
    random_prompts,
    run_engine_job,
)
from tests.fixtures.turboquant_reference import hf_turboquant_logprobs

pytestmark = pytest.mark.slow

# Longer than Gemma 3's window (32), chunked into one prefill step with the short ones.
PROMPTS = random_prompts(43, [5, 40, 90, 17])
MAX_TOKENS = 24
MAX_MEAN, MAX_ERROR = 1e-2, 0.2


def errors_against_the_oracle(model, name, skip=None, env=None) -> tuple[np.ndarray, np.ndarray]:
    """|engine - oracle| and |engine - unquantized model| of every sampled token's logprob."""
    jobs = [{"prompts": PROMPTS, "params": [greedy(MAX_TOKENS, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": name}, env=env)
    options = {} if skip is None else {"skip": skip}

    def oracle(prompt, ids):
        return hf_turboquant_logprobs(model, ids, name, len(prompt), **options)

    errors, moved = errors_and_shift(model, PROMPTS, batch, oracle)
    print(f"{name}: |logprob - oracle| mean {errors.mean():.2e} max {errors.max():.2e}; "
          f"the format moves them by {moved.mean():.2e}")  # fmt: skip
    return errors, moved


def assert_follows_the_oracle(errors: np.ndarray, moved: np.ndarray) -> None:
    assert np.isfinite(errors).all()
    assert errors.mean() <= MAX_MEAN and errors.max() <= MAX_ERROR
    assert errors.mean() * 10 <= moved.mean()


@pytest.fixture(scope="module")
def gemma3(tiny_model_dir):
    """Six layers alternating sliding (window 32) and full: vLLM quantizes layers 2 and 3."""
    return tiny_model_dir("gemma3", num_layers=6)


def test_gemma3_float_pages_and_slots_share_regions(gemma3) -> None:
    """Measured: mean 5.3e-5, max 8.2e-4; the format moves the logprobs by 1.29."""
    assert_follows_the_oracle(*errors_against_the_oracle(gemma3, "turboquant_3bit_nc"))


@pytest.mark.full
def test_gemma3_fp8_keys(gemma3) -> None:
    """Measured: mean 7.8e-3, max 0.11 (fp8 keys without a scale flip at last-bit key
    differences); the format moves the logprobs by 0.30."""
    assert_follows_the_oracle(*errors_against_the_oracle(gemma3, "turboquant_k8v4"))


@pytest.mark.full
def test_mlx_ops_read_no_page_a_window_has_passed(gemma3) -> None:
    """MLX's own ops (no native extension) gather whole block tables and mask what a window has
    passed; a block vLLM freed there may hold another group's pages in another layout, whose
    bytes read as slots can be NaN, and a masked NaN still poisons the sum. The tables name the
    null block instead (`batch._tables_and_slots`); without that the 90-token prompt's logprobs
    turned NaN after 8 tokens. Measured: mean 1.5e-3, max 2.6e-2."""
    env = {"VLLM_METAL_USE_REFERENCE_OPS": "1"}
    assert_follows_the_oracle(*errors_against_the_oracle(gemma3, "turboquant_k8v4", env=env))


@pytest.mark.full
@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_gpt_oss_windows_and_sinks(tmp_path_factory, name) -> None:
    """GPT-OSS: sliding (window 16) and full layers with sinks, and MoE routing, whose choice a
    last-bit difference can flip. Measured: mean 7.5e-4 / 1.1e-3, max 4.5e-2 / 2.1e-2."""
    from tests.fixtures.tiny_gpt_oss import write_tiny_gpt_oss

    model = write_tiny_gpt_oss(
        tmp_path_factory.mktemp("gpt-oss") / "six", sliding_window=16, num_layers=6
    )
    assert_follows_the_oracle(*errors_against_the_oracle(model, name))


@pytest.mark.full
@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_gemma4_two_head_sizes_and_shared_layers(tiny_gemma4_dir, name) -> None:
    """Gemma 4: slots of head sizes 32 and 64 and float pages in one region; its last two layers
    (vLLM's boundary layers by index) read layers 3 and 2's slots, so they read them in the
    writers' format: the oracle keeps layers 0 and 1 unquantized only. Measured: mean 2.5e-4 /
    1.9e-4, max 1.6e-2."""
    assert_follows_the_oracle(*errors_against_the_oracle(tiny_gemma4_dir, name, skip={0, 1}))
