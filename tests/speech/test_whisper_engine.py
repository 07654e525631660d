"""Whisper on the MLX runner through vLLM's engine, against transformers float32.

One engine runs the clips one by one and all at once (one batch: several encoders in one step,
decoders batched over the paged self- and cross-attention), and a second engine with a pool too
small for three transcriptions preempts and resumes them (the encoder runs again). Each clip's
greedy tokens equal `WhisperForConditionalGeneration.generate` with the same forced prompt.
"""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import run_engine_job
from tests.fixtures.oracles import whisper_generate
from tests.fixtures.tiny_whisper import audio_clip, decoder_prompt, decoder_prompt_ids

pytestmark = pytest.mark.slow

CLIPS = [(seed, 2.0 + 3.0 * seed) for seed in range(4)]  # (seed, seconds): 2 s .. 11 s
MAX_TOKENS = 24
ENGINE = {"max_model_len": 448}
TRANSLATE = "translate"


def _prompt(clip, task="transcribe"):
    return {"audio": list(clip), "decoder_prompt": decoder_prompt("en", task)}


def _tokens(batch):
    return [r["outputs"][0]["token_ids"] for r in batch]


@pytest.fixture(scope="module")
def oracle(tiny_whisper_dir):
    clips = [audio_clip(*c) for c in CLIPS]
    return {
        task: whisper_generate(tiny_whisper_dir, clips, decoder_prompt_ids("en", task), MAX_TOKENS)
        for task in ("transcribe", TRANSLATE)
    }


@pytest.fixture(scope="module")
def results(tiny_whisper_dir):
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    jobs = [{"prompts": [_prompt(c)], "params": [greedy]} for c in CLIPS]
    jobs.append({"prompts": [_prompt(c) for c in CLIPS], "params": [greedy]})
    jobs.append({"prompts": [_prompt(c, TRANSLATE) for c in CLIPS[:2]], "params": [greedy]})
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": MAX_TOKENS}
    jobs.append({"prompts": [_prompt(CLIPS[0])] * 2, "params": [seeded, {**seeded, "seed": 8}]})
    jobs.append({"prompts": [_prompt(CLIPS[0])], "params": [seeded]})
    return run_engine_job(tiny_whisper_dir, jobs, engine=ENGINE)


def test_one_by_one_equals_transformers(results, oracle):
    got = [_tokens(batch)[0] for batch in results[: len(CLIPS)]]
    assert got == oracle["transcribe"]


def test_concurrent_equals_transformers(results, oracle):
    assert _tokens(results[len(CLIPS)]) == oracle["transcribe"]


def test_translation_prompt(results, oracle):
    assert _tokens(results[len(CLIPS) + 1]) == oracle[TRANSLATE][:2]


def test_sampling_follows_the_seed(results):
    """temperature > 0 samples (with vLLM's sampler): a seed repeats its tokens in another
    batch, and another seed gives others, so the tokens are drawn, not the argmax (the tiny
    model is sharp enough that one seed's draw may be the greedy transcription)."""
    seed7, seed8 = _tokens(results[len(CLIPS) + 2])
    (again,) = _tokens(results[len(CLIPS) + 3])
    assert seed7 == again
    assert seed7 != seed8


def test_clips_differ(oracle):
    # The check above means something only if the audio decides the tokens.
    assert len({tuple(t) for t in oracle["transcribe"]}) == len(CLIPS)


def test_preemption_recomputes_the_encoder(tiny_whisper_dir):
    """Three transcriptions whose cross-attention blocks (94 each) fit the pool but not once
    each has decoded 128 tokens: the scheduler preempts one and resumes it later, encoder
    included; tokens are those of an unconstrained run."""
    params = {"temperature": 0.0, "max_tokens": 128, "ignore_eos": True}
    job = {"prompts": [_prompt(c) for c in CLIPS[:3]], "params": [params]}
    # Tiny Whisper: 16 tokens x 2 heads x 64 x 4 bytes x K/V = 16 KiB per block and layer
    # region; two regions (self- and cross-attention layers alternate over them).
    # vLLM reserves cross-attention blocks for the encoder budget (max_num_batched_tokens).
    small = {
        **ENGINE,
        "max_num_batched_tokens": 1536,
        "kv_cache_memory_bytes": 300 * 2 * 16 * 2**10,
        "disable_log_stats": False,
    }
    (reference,) = run_engine_job(tiny_whisper_dir, [job], engine=ENGINE)
    (preempted,), metrics = run_engine_job(tiny_whisper_dir, [job], engine=small, with_metrics=True)
    assert metrics.get("vllm:num_preemptions", 0) > 0
    assert _tokens(preempted) == _tokens(reference)
    clips = [audio_clip(*c) for c in CLIPS[:3]]
    want = whisper_generate(tiny_whisper_dir, clips, decoder_prompt_ids(), MAX_TOKENS)
    for got, expected in zip(_tokens(preempted), want):
        assert got[: len(expected)] == expected


@pytest.mark.full
def test_vllm_cpu_backend_gives_the_same_tokens(tiny_whisper_dir, results):
    """vLLM's own CPU backend (torch, its Whisper class) on the same batch: same tokens."""
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    job = {"prompts": [_prompt(c) for c in CLIPS], "params": [greedy]}
    (theirs,) = run_engine_job(
        tiny_whisper_dir, [job], engine={**ENGINE, "enforce_eager": True}, backend="cpu"
    )
    assert _tokens(theirs) == _tokens(results[len(CLIPS)])
