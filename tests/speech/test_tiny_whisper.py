"""Proves the tiny Whisper checkpoint is a sound fixture: transformers loads it as model and
processor, its tokenizer reads the decoder prompts vLLM writes, and the float32 oracle's greedy
tokens depend on the audio. No engine; a few seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import runpy
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures import oracles
from tests.fixtures.tiny_whisper import (
    EOT_TOKEN,
    NO_TIMESTAMPS_TOKEN,
    SAMPLE_RATE,
    SOT_PREV_TOKEN,
    SOT_TOKEN,
    TEXT_VOCAB_SIZE,
    audio_clip,
    decoder_prompt,
    decoder_prompt_ids,
    special_tokens,
    timestamp_tokens,
    token_ids,
    vocab_size,
    wav_bytes,
    write_tiny_whisper,
)

CLIPS = [(0, 2.0), (1, 5.0), (2, 8.0), (3, 11.0)]  # (seed, seconds)
NEW_TOKENS = 16


def _vllm_languages() -> list[str]:
    """vLLM's `WhisperForConditionalGeneration.supported_languages`, read from its source file
    (a plain dict) without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "model_executor" / "models" / "whisper_utils.py"
    return list(runpy.run_path(str(path))["ISO639_1_SUPPORTED_LANGS"])


@pytest.fixture(scope="module")
def processor(tiny_whisper_dir: Path) -> Any:
    from transformers import WhisperProcessor

    return WhisperProcessor.from_pretrained(tiny_whisper_dir)


@pytest.fixture(scope="module")
def transcripts(tiny_whisper_dir: Path) -> list[list[int]]:
    clips = [audio_clip(*c) for c in CLIPS]
    return oracles.whisper_generate(tiny_whisper_dir, clips, decoder_prompt_ids(), NEW_TOKENS)


# ------------------------------------------------------------------------------------------------
# Files, config and processor
# ------------------------------------------------------------------------------------------------


def test_config_matches_tokenizer(tiny_whisper_dir: Path, processor: Any) -> None:
    config = json.loads((tiny_whisper_dir / "config.json").read_text())
    ids = token_ids()
    assert config["architectures"] == ["WhisperForConditionalGeneration"]
    assert config["vocab_size"] == vocab_size() == len(processor.tokenizer)
    assert config["decoder_start_token_id"] == ids[SOT_TOKEN]
    assert config["eos_token_id"] == config["bos_token_id"] == config["pad_token_id"]
    assert config["eos_token_id"] == ids[EOT_TOKEN] == processor.tokenizer.eos_token_id
    assert (config["d_model"], config["encoder_layers"], config["decoder_layers"]) == (128, 2, 2)
    assert (config["num_mel_bins"], config["max_source_positions"]) == (80, 1500)
    assert config["max_target_positions"] == 448
    for name in ("config.json", "generation_config.json"):
        content = json.loads((tiny_whisper_dir / name).read_text())
        assert not content.get("suppress_tokens") and not content.get("begin_suppress_tokens")


def test_processor_loads(tiny_whisper_dir: Path, processor: Any) -> None:
    from transformers import AutoProcessor, WhisperFeatureExtractor, WhisperTokenizer

    auto = AutoProcessor.from_pretrained(tiny_whisper_dir)
    assert type(auto) is type(processor)
    assert isinstance(processor.tokenizer, WhisperTokenizer)
    fe = processor.feature_extractor
    assert isinstance(fe, WhisperFeatureExtractor)
    assert (fe.feature_size, fe.sampling_rate, fe.chunk_length) == (80, SAMPLE_RATE, 30)
    assert (fe.hop_length, fe.n_fft) == (160, 400)
    features = processor(audio=audio_clip(0, 2.0), sampling_rate=SAMPLE_RATE, return_tensors="np")
    assert features["input_features"].shape == (1, 80, 3000)


def test_model_loads_with_tied_output(tiny_whisper_dir: Path) -> None:
    model, _ = oracles.load_hf_whisper(tiny_whisper_dir)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    # The encoder's position table is Whisper's fixed sinusoids (vLLM recomputes the same).
    from transformers.models.whisper.modeling_whisper import sinusoids

    table = model.model.encoder.embed_positions.weight
    assert np.allclose(table.detach().numpy(), sinusoids(*table.shape).numpy(), atol=1e-6)


def test_same_arguments_same_checkpoint(tmp_path: Path, tiny_whisper_dir: Path) -> None:
    again = write_tiny_whisper(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        digests = {
            hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (tiny_whisper_dir, again)
        }
        assert len(digests) == 1, name


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def test_vocabulary_layout() -> None:
    ids = token_ids()
    assert ids[EOT_TOKEN] == TEXT_VOCAB_SIZE
    assert [ids[t] for t in special_tokens()] == list(
        range(TEXT_VOCAB_SIZE, ids[NO_TIMESTAMPS_TOKEN] + 1)
    )
    # Timestamps follow <|notimestamps|> and are the highest ids, as vLLM's segmenting assumes.
    assert ids["<|0.00|>"] == ids[NO_TIMESTAMPS_TOKEN] + 1
    assert ids["<|30.00|>"] == vocab_size() - 1 == ids[timestamp_tokens()[-1]]


@pytest.mark.parametrize(
    ("language", "task"), [("en", "transcribe"), ("de", "translate"), ("yue", "transcribe")]
)
def test_tokenizer_reads_vllm_decoder_prompt(processor: Any, language: str, task: str) -> None:
    tokenizer = processor.tokenizer
    ids = token_ids()
    text = f"<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"  # vLLM's prompt
    assert decoder_prompt(language, task) == text
    want = [ids[SOT_TOKEN], ids[f"<|{language}|>"], ids[f"<|{task}|>"], ids[NO_TIMESTAMPS_TOKEN]]
    assert tokenizer(text, add_special_tokens=False).input_ids == want
    assert decoder_prompt_ids(language, task) == want
    # transformers' own prefix logic (language id = start-of-transcript + 1 + LANGUAGES index).
    tokenizer.set_prefix_tokens(language=language, task=task, predict_timestamps=False)
    try:
        assert tokenizer.prefix_tokens == want
    finally:
        tokenizer.set_prefix_tokens(language=None, task=None)


def test_language_tokens_for_vllm_detection(processor: Any) -> None:
    """What `get_language_token_ids` and `parse_language_detection_output` do with the tokenizer."""
    tokenizer = processor.tokenizer
    languages = _vllm_languages()
    lang_ids = [tokenizer.convert_tokens_to_ids(f"<|{code}|>") for code in languages]
    assert len(set(lang_ids)) == len(languages)
    assert all(token_ids()[f"<|{code}|>"] == i for code, i in zip(languages, lang_ids, strict=True))
    for code, i in zip(languages, lang_ids, strict=True):
        assert tokenizer.decode([i], skip_special_tokens=False) == f"<|{code}|>"


def test_text_and_previous_text(processor: Any) -> None:
    tokenizer = processor.tokenizer
    text = " The weather in Paris is sunny."
    text_ids = tokenizer(text, add_special_tokens=False).input_ids
    assert text_ids and max(text_ids) < TEXT_VOCAB_SIZE
    assert tokenizer.decode(text_ids) == text
    prompt = tokenizer(decoder_prompt(previous=text), add_special_tokens=False).input_ids
    assert prompt == [token_ids()[SOT_PREV_TOKEN], *text_ids, *decoder_prompt_ids()]
    assert tokenizer.decode(prompt) == decoder_prompt(previous=text)
    assert tokenizer("<|1.50|>", add_special_tokens=False).input_ids == [token_ids()["<|1.50|>"]]


# ------------------------------------------------------------------------------------------------
# Audio and oracle
# ------------------------------------------------------------------------------------------------


def test_audio_clip_and_wav() -> None:
    clip = audio_clip(3, 1.25)
    assert clip.dtype == np.float32 and clip.shape == (20000,)
    assert 0.5 < np.max(np.abs(clip)) <= 1.0
    assert np.array_equal(clip, audio_clip(3, 1.25))
    assert not np.allclose(clip, audio_clip(4, 1.25), atol=0.1)
    with wave.open(io.BytesIO(wav_bytes(clip)), "rb") as reader:
        assert (reader.getnchannels(), reader.getsampwidth()) == (1, 2)
        assert reader.getframerate() == SAMPLE_RATE
        pcm = np.frombuffer(reader.readframes(reader.getnframes()), dtype="<i2")
    assert np.allclose(pcm / 32767.0, clip, atol=1e-4)


def test_transcripts_depend_on_audio(transcripts: list[list[int]]) -> None:
    eos = token_ids()[EOT_TOKEN]
    assert all(len(t) >= 2 and t[0] != eos for t in transcripts)
    assert len({tuple(t) for t in transcripts}) == len(transcripts)
    assert len({t[0] for t in transcripts}) >= 2
    # Plain transcription emits text tokens (and end-of-text), never other specials or timestamps.
    assert all(token <= eos for t in transcripts for token in t)
    # EOS only ever last; lengths are at most the limit.
    assert all(eos not in t[:-1] and len(t) <= NEW_TOKENS for t in transcripts)


def test_prompt_changes_transcript(tiny_whisper_dir: Path, transcripts: list[list[int]]) -> None:
    clip = audio_clip(*CLIPS[2])
    (translated,) = oracles.whisper_generate(
        tiny_whisper_dir, [clip], decoder_prompt_ids("de", "translate"), NEW_TOKENS
    )
    assert translated != transcripts[2]


def test_oracle_equals_plain_greedy_loop(
    tiny_whisper_dir: Path, transcripts: list[list[int]]
) -> None:
    """Whisper's own `generate` adds nothing to a forced prompt: argmax step by step agrees."""
    import torch

    model, _ = oracles.load_hf_whisper(tiny_whisper_dir)
    features = oracles.whisper_features(tiny_whisper_dir, audio_clip(*CLIPS[1]))
    tokens = decoder_prompt_ids()
    steps = 8
    with torch.no_grad(), oracles._one_torch_thread():
        encoded = model.model.encoder(features)
        for _ in range(steps):
            logits = model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([tokens])).logits
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == token_ids()[EOT_TOKEN]:
                break
    assert tokens[len(decoder_prompt_ids()) :] == transcripts[1][:steps]
