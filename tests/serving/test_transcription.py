"""Speech-to-text through `vllm serve` on the MLX runner: `/v1/audio/transcriptions` and
`/v1/audio/translations` with the official `openai` client, checked against transformers float32.

One server (the tiny random Whisper) answers: transcriptions one by one and concurrently, each
`response_format`, a translation, language detection (no `language`: vLLM's one-token request
constrained by `allowed_token_ids`), audio longer than 30 s (vLLM's front end splits it), and bad
uploads, each answered with a 4xx while the server keeps serving.

Oracle: `WhisperForConditionalGeneration.generate` with the decoder prompt vLLM sends, decoded
with the checkpoint's tokenizer without special tokens.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.fixtures.oracles import load_hf_whisper, whisper_features, whisper_generate
from tests.fixtures.tiny_whisper import (
    SAMPLE_RATE,
    audio_clip,
    decoder_prompt_ids,
    wav_bytes,
)

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

SERVED = "tiny-whisper"
MAX_TOKENS = 24
CLIPS = [(seed, 3.0 + 2.0 * seed) for seed in range(4)]


@pytest.fixture
def server(server_slot, tiny_whisper_dir):
    return server_slot.get(
        ("whisper", str(tiny_whisper_dir)),
        tiny_whisper_dir,
        served_name=SERVED,
        api_key=None,
        extra_args=["--max-model-len", "448"],
    )


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_whisper_dir):
    return AutoTokenizer.from_pretrained(tiny_whisper_dir)


def _text(text: str) -> str:
    """The random model emits byte tokens: vLLM's detokenizer holds back an incomplete UTF-8
    sequence at the end, where a one-shot decode writes replacement characters."""
    return text.rstrip("\ufffd").strip()


def _as_sent(clip: np.ndarray) -> np.ndarray:
    """The clip as the server decodes it from `wav_bytes` (16-bit PCM)."""
    import soundfile

    samples, _ = soundfile.read(io.BytesIO(wav_bytes(clip)), dtype="float32")
    return samples


def _oracle_text(model_dir, tokenizer, clip, language="en", task="transcribe") -> str:
    clip = _as_sent(clip)
    (tokens,) = whisper_generate(model_dir, [clip], decoder_prompt_ids(language, task), MAX_TOKENS)
    return _text(tokenizer.decode(tokens, skip_special_tokens=True))


def _transcribe(client, clip, **kwargs):
    return client.audio.transcriptions.create(
        model=SERVED,
        file=("clip.wav", wav_bytes(clip), "audio/wav"),
        temperature=0.0,
        extra_body={"max_completion_tokens": MAX_TOKENS},
        **kwargs,
    )


def _post_form(server, clip, **fields: str):
    """A transcription as a raw multipart form (what the openai client does not expose)."""
    data = {
        "model": SERVED,
        "language": "en",
        "temperature": "0",
        "max_completion_tokens": str(MAX_TOKENS),
        **fields,
    }
    files = {"file": ("clip.wav", wav_bytes(clip), "audio/wav")}
    return server.post("/v1/audio/transcriptions", None, files=files, data=data, stream=True)


def test_transcriptions_one_by_one_and_concurrently(client, tiny_whisper_dir, tokenizer):
    clips = [audio_clip(*c) for c in CLIPS]
    want = [_oracle_text(tiny_whisper_dir, tokenizer, c) for c in clips]
    assert len(set(want)) == len(clips)  # the audio decides the text
    one_by_one = [_text(_transcribe(client, c, language="en").text) for c in clips]
    assert one_by_one == want
    with ThreadPoolExecutor(len(clips)) as pool:
        concurrent = list(pool.map(lambda c: _transcribe(client, c, language="en"), clips))
    assert [_text(r.text) for r in concurrent] == want


def test_response_formats(client, server, tiny_whisper_dir, tokenizer):
    clip = audio_clip(*CLIPS[1])
    want = _oracle_text(tiny_whisper_dir, tokenizer, clip)
    # verbose_json asks for timestamps, and its text is made of timestamped segments: a random
    # model emits no timestamp tokens, so only the fields around them are checked.
    verbose = _transcribe(client, clip, language="en", response_format="verbose_json")
    assert verbose.language == "en"
    assert verbose.duration == pytest.approx(CLIPS[1][1], abs=0.01)
    assert isinstance(verbose.text, str)
    # vLLM answers response_format=text with a JSON body on every backend.
    response = _post_form(server, clip, response_format="text")
    assert response.status_code == 200, response.text
    assert _text(response.json()["text"]) == want


def test_translation(client, tiny_whisper_dir, tokenizer):
    clip = audio_clip(*CLIPS[2])
    want = _oracle_text(tiny_whisper_dir, tokenizer, clip, task="translate")
    assert want != _oracle_text(tiny_whisper_dir, tokenizer, clip)
    got = client.audio.translations.create(
        model=SERVED,
        file=("clip.wav", wav_bytes(clip), "audio/wav"),
        temperature=0.0,
        extra_body={"max_completion_tokens": MAX_TOKENS, "language": "en"},
    )
    assert _text(got.text) == want


def test_language_detection(client, tiny_whisper_dir, tokenizer):
    """No `language`: vLLM asks for one token among the language tokens (`allowed_token_ids`);
    the runner's masked greedy pick is the language transformers' logits rank first."""
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

    clip = audio_clip(*CLIPS[3])
    allowed = WhisperForConditionalGeneration.get_language_token_ids(tokenizer)
    model, _ = load_hf_whisper(tiny_whisper_dir)
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    with torch.no_grad():
        logits = model(
            input_features=whisper_features(tiny_whisper_dir, _as_sent(clip)),
            decoder_input_ids=torch.tensor([[start]]),
        ).logits[0, -1]
    best = allowed[int(torch.argmax(logits[allowed]))]
    language = tokenizer.convert_ids_to_tokens(best)[2:-2]

    assert language != "en"  # else the check below could pass without any detection
    verbose = _transcribe(client, clip, response_format="verbose_json")
    assert verbose.language == language
    text = _transcribe(client, clip).text
    assert _text(text) == _oracle_text(tiny_whisper_dir, tokenizer, clip, language)


def test_audio_longer_than_30_s_is_split(client, tiny_whisper_dir, tokenizer):
    from vllm.multimodal.audio import split_audio

    clip = audio_clip(7, 45.0)
    chunks = split_audio(
        audio_data=_as_sent(clip),
        sample_rate=SAMPLE_RATE,
        max_clip_duration_s=30,
        overlap_duration_s=1,
        min_energy_window_size=1600,
    )
    assert len(chunks) == 2
    parts = _transcribe(client, clip, language="en").text
    want = [_oracle_text(tiny_whisper_dir, tokenizer, c) for c in chunks]
    # Each chunk's text is held back at an incomplete UTF-8 end; the chunks join with a space.
    assert _text(parts).startswith(want[0])
    assert _text(parts).endswith(want[1])


@pytest.mark.parametrize(
    "upload",
    [
        pytest.param(("notes.txt", b"this is not audio at all", "text/plain"), id="not-audio"),
        pytest.param(("empty.wav", b"", "audio/wav"), id="empty"),
        pytest.param(("clip.wav", b"RIFF\x24\x00\x00\x00WAVEfmt ", "audio/wav"), id="truncated"),
    ],
)
def test_bad_audio_is_a_4xx_and_the_server_keeps_serving(client, server, upload):
    with pytest.raises(openai.APIStatusError) as err:
        client.audio.transcriptions.create(model=SERVED, file=upload, language="en")
    assert 400 <= err.value.status_code < 500, err.value
    assert server.alive()
    clip = audio_clip(*CLIPS[0])
    assert _transcribe(client, clip, language="en").text is not None


def test_unsupported_language_is_a_4xx(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        _transcribe(client, audio_clip(*CLIPS[0]), language="tlh")
    assert "language" in str(err.value).lower()
    assert server.alive()


def test_wav_at_another_rate_is_resampled(client, tiny_whisper_dir, tokenizer):
    """An 8 kHz upload goes through PyAV's resampler in vLLM's front end (the install provides
    it); the result is then the 16 kHz clip's transcription within resampling error, so only
    success and a non-empty answer are checked here."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, audio_clip(3, 4.0, sample_rate=8000), 8000, format="WAV")
    got = client.audio.transcriptions.create(
        model=SERVED,
        file=("clip8k.wav", buf.getvalue(), "audio/wav"),
        language="en",
        temperature=0.0,
        extra_body={"max_completion_tokens": MAX_TOKENS},
    )
    assert got.text.strip()


def test_streamed_transcription_equals_the_whole_one(client, server, tiny_whisper_dir, tokenizer):
    """`stream=true`: server-sent chunks whose deltas add up to the transcription."""
    import json

    clip = audio_clip(*CLIPS[2])
    response = _post_form(server, clip, stream="true")
    assert response.status_code == 200, response.text
    deltas = []
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        deltas.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    assert len(deltas) > 1
    assert _text("".join(deltas)) == _oracle_text(tiny_whisper_dir, tokenizer, clip)
