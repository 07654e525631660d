"""Qwen3-ASR on the MLX runner through vLLM's engine, against transformers float32.

Transcription-style prompts (the chat turns vLLM's transcription endpoint writes, one audio
placeholder each) run one by one, all at once (several clips encoded in one step, the prompts'
first blocks prefix-cache hits of the runs before) and with two clips in one prompt; a second
engine with a small token budget splits each prompt's audio span across prefill chunks. Greedy
tokens equal `Qwen3ASRForConditionalGeneration.generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.backends.mlx.runner.jobs import run_engine_job
from tests.fixtures.qwen3_asr_oracle import qwen3_asr_generate
from tests.fixtures.tiny_qwen3_asr import AUDIO_PAD, audio_clip, transcription_prompt

pytestmark = [pytest.mark.slow, pytest.mark.full]

CLIPS = [(0, 1.5), (2, 3.5), (3, 4.5)]  # (seed, seconds): 20 .. 59 audio tokens
MAX_TOKENS = 16
ENGINE = {"max_model_len": 1024}
# Two clips in one user turn.
TWO_CLIPS = transcription_prompt().replace(AUDIO_PAD, AUDIO_PAD + "\n" + AUDIO_PAD)


def _prompt(text: str, clips: list[tuple[int, float]]) -> dict:
    return {"prompt": text, "audios": [list(c) for c in clips]}


def _tokens(batch: list[dict]) -> list[list[int]]:
    return [r["outputs"][0]["token_ids"] for r in batch]


@pytest.fixture(scope="module")
def oracle(tiny_qwen3_asr_dir: Path) -> dict:
    one = [
        qwen3_asr_generate(tiny_qwen3_asr_dir, transcription_prompt(), [audio_clip(*c)], MAX_TOKENS)
        for c in CLIPS
    ]
    two = qwen3_asr_generate(
        tiny_qwen3_asr_dir, TWO_CLIPS, [audio_clip(*c) for c in CLIPS[:2]], MAX_TOKENS
    )
    return {"one": one, "two": two}


def _jobs() -> list[dict]:
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    single = [_prompt(transcription_prompt(), [c]) for c in CLIPS]
    jobs = [{"prompts": [p], "params": [greedy]} for p in single]
    jobs.append({"prompts": single, "params": [greedy]})
    jobs.append({"prompts": [_prompt(TWO_CLIPS, CLIPS[:2])], "params": [greedy]})
    return jobs


@pytest.fixture(scope="module")
def results(tiny_qwen3_asr_dir: Path) -> list:
    return run_engine_job(tiny_qwen3_asr_dir, _jobs(), engine=ENGINE)


@pytest.fixture(scope="module")
def chunked(tiny_qwen3_asr_dir: Path) -> list:
    engine = {**ENGINE, "max_num_batched_tokens": 24, "enable_chunked_prefill": True}
    # A spawned engine process, as on macOS: it must register the model classes vLLM inspects
    # itself (the parent's registry does not reach it).
    spawn = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    return run_engine_job(tiny_qwen3_asr_dir, _jobs()[len(CLIPS) :], engine=engine, env=spawn)


def test_one_by_one_equals_transformers(results, oracle) -> None:
    assert [_tokens(batch)[0] for batch in results[: len(CLIPS)]] == oracle["one"]


def test_concurrent_equals_transformers(results, oracle) -> None:
    assert _tokens(results[len(CLIPS)]) == oracle["one"]


def test_repeated_prompts_hit_the_prefix_cache(results) -> None:
    # The batch repeats the prompts sent one by one (same text, same clips): their cached blocks,
    # audio rows included, are reused, and the tokens above still equal transformers'.
    cached = [r["num_cached_tokens"] for r in results[len(CLIPS)]]
    assert all(n >= 16 for n in cached), cached


def test_two_clips_in_one_prompt(results, oracle) -> None:
    assert _tokens(results[len(CLIPS) + 1]) == [oracle["two"]]


def test_audio_split_across_prefill_chunks(chunked, oracle) -> None:
    assert _tokens(chunked[0]) == oracle["one"]
    assert _tokens(chunked[1]) == [oracle["two"]]


def test_clips_differ(oracle) -> None:
    # The checks above mean something only if the audio decides the tokens.
    assert len({tuple(t) for t in oracle["one"]}) == len(CLIPS)
