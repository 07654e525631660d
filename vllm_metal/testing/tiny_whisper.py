"""A tiny random-weight Whisper checkpoint and synthetic audio for speech-to-text tests that cannot
download models.

The checkpoint is what transformers' `save_pretrained` writes for `WhisperForConditionalGeneration`,
`WhisperTokenizer` and `WhisperFeatureExtractor`: config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json and preprocessor_config.json (80 mel
bins, 16 kHz, 30 s windows); `WhisperProcessor` / `AutoProcessor` load it. The tokenizer
lays out its vocabulary as real multilingual Whisper (large-v3) does, only with a small byte-level
BPE trained on the corpus of `tiny_tokenizer.py` for the text tokens:

    text BPE | <|endoftext|> | <|startoftranscript|> | <|en|> ... <|yue|> | <|translate|>
    | <|transcribe|> | <|startoflm|> | <|startofprev|> | <|nospeech|> | <|notimestamps|>
    | <|0.00|> ... <|30.00|>

so the decoder prompts vLLM builds (`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`),
its language detection over `<|xx|>` tokens and transformers' own prefix logic (language id =
start-of-transcript id + 1 + index in `LANGUAGES`) all find their tokens. Timestamp tokens are
ordinary (non-special) added tokens with the highest ids, as vLLM's verbose_json segmenting expects.

Weights are redrawn wider than transformers' 0.02 init so that greedy tokens clearly depend on the
audio (see `WeightInit`): with the default seed, different clips give different transcripts, some
ending with `<|endoftext|>` after a few tokens and others running to the token limit, and never
special or timestamp tokens after `<|notimestamps|>`. The encoder keeps Whisper's fixed
sinusoidal position table.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import sys
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.tiny_tokenizer import _CORPUS

DTYPES = ("float32", "float16", "bfloat16")
SAMPLE_RATE = 16000
TEXT_VOCAB_SIZE = 512  # byte-level BPE: 256 bytes and 256 merges

EOT_TOKEN = "<|endoftext|>"
SOT_TOKEN = "<|startoftranscript|>"
TRANSLATE_TOKEN = "<|translate|>"
TRANSCRIBE_TOKEN = "<|transcribe|>"
SOT_LM_TOKEN = "<|startoflm|>"
SOT_PREV_TOKEN = "<|startofprev|>"
NO_SPEECH_TOKEN = "<|nospeech|>"
NO_TIMESTAMPS_TOKEN = "<|notimestamps|>"
NUM_TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|> in steps of 0.02 s


def _languages() -> tuple[str, ...]:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return tuple(LANGUAGES)


def special_tokens() -> list[str]:
    """The special tokens in id order, directly after the text BPE (as in Whisper large-v3)."""
    return [
        EOT_TOKEN,
        SOT_TOKEN,
        *(f"<|{lang}|>" for lang in _languages()),
        TRANSLATE_TOKEN,
        TRANSCRIBE_TOKEN,
        SOT_LM_TOKEN,
        SOT_PREV_TOKEN,
        NO_SPEECH_TOKEN,
        NO_TIMESTAMPS_TOKEN,
    ]


def timestamp_tokens() -> list[str]:
    """`<|0.00|>` ... `<|30.00|>`: ordinary added tokens after the special ones."""
    return [f"<|{i * 0.02:.2f}|>" for i in range(NUM_TIMESTAMPS)]


def token_ids() -> dict[str, int]:
    """Id of every special and timestamp token of the tiny Whisper tokenizer."""
    added = [*special_tokens(), *timestamp_tokens()]
    return {token: TEXT_VOCAB_SIZE + i for i, token in enumerate(added)}


def vocab_size() -> int:
    """Number of tokens: text BPE, special and timestamp tokens (the config's `vocab_size`)."""
    return TEXT_VOCAB_SIZE + len(special_tokens()) + NUM_TIMESTAMPS


def decoder_prompt(language: str = "en", task: str = "transcribe", previous: str = "") -> str:
    """The decoder prompt text of a transcription request, as Whisper's own decoding builds it:
    `<|startofprev|>` and the previous text first when given, then the start-of-transcript
    sequence. (vLLM 0.32's `get_generation_prompt` writes `<|prev|>` rather than `<|startofprev|>`
    before a request prompt; that string is no Whisper token and tokenizes as plain text.)"""
    prefix = f"{SOT_PREV_TOKEN}{previous}" if previous else ""
    return f"{prefix}{SOT_TOKEN}<|{language}|><|{task}|>{NO_TIMESTAMPS_TOKEN}"


def decoder_prompt_ids(language: str = "en", task: str = "transcribe") -> list[int]:
    """Ids of `decoder_prompt(language, task)` without a previous text."""
    ids = token_ids()
    return [ids[SOT_TOKEN], ids[f"<|{language}|>"], ids[f"<|{task}|>"], ids[NO_TIMESTAMPS_TOKEN]]


# --------------------------------------------------------------------------------------------------
# Tokenizer and feature extractor
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _text_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a byte-level BPE trained on the tiny tokenizer's corpus (the same
    corpus and settings always give the same result)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines(keepends=True) if line.strip()]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if len(model["vocab"]) != TEXT_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {len(model['vocab'])} tokens")
    return dict(model["vocab"]), merges  # type: ignore[return-value]


def build_processor() -> Any:
    """A `WhisperProcessor`: Whisper's feature extractor (80 mel bins, 16 kHz, 30 s) and a
    `WhisperTokenizer` over the tiny BPE with Whisper's special and timestamp tokens."""
    from tokenizers import AddedToken
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer

    vocab, merges = _text_bpe()
    tokenizer = WhisperTokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        unk_token=EOT_TOKEN,
        bos_token=EOT_TOKEN,
        eos_token=EOT_TOKEN,
        pad_token=EOT_TOKEN,
        model_max_length=448,
        clean_up_tokenization_spaces=False,
    )
    # In id order after <|endoftext|> (already added as eos): the specials, which
    # skip_special_tokens drops, then the timestamps, which it keeps (as in Whisper's tokenizer).
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens()[1:]})
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in timestamp_tokens()]
    )
    tokenizer.set_prefix_tokens()
    feature_extractor = WhisperFeatureExtractor(
        feature_size=80,
        sampling_rate=SAMPLE_RATE,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=False,
    )
    return WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer)


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def tiny_whisper_config(
    *,
    d_model: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_dim: int = 256,
) -> Any:
    """A `WhisperConfig` for the tiny tokenizer: ``num_layers`` encoder and decoder layers each,
    80 mel bins, 1500 encoder positions (30 s of audio), 448 decoder positions, tied output
    embedding and no token suppression."""
    from transformers import WhisperConfig

    ids = token_ids()
    return WhisperConfig(
        vocab_size=vocab_size(),
        num_mel_bins=80,
        d_model=d_model,
        encoder_layers=num_layers,
        decoder_layers=num_layers,
        encoder_attention_heads=num_heads,
        decoder_attention_heads=num_heads,
        encoder_ffn_dim=ffn_dim,
        decoder_ffn_dim=ffn_dim,
        max_source_positions=1500,
        max_target_positions=448,
        activation_function="gelu",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        scale_embedding=False,
        tie_word_embeddings=True,
        use_cache=True,
        bos_token_id=ids[EOT_TOKEN],
        eos_token_id=ids[EOT_TOKEN],
        pad_token_id=ids[EOT_TOKEN],
        decoder_start_token_id=ids[SOT_TOKEN],
        suppress_tokens=None,
        begin_suppress_tokens=None,
        forced_decoder_ids=None,
    )


def _generation_config(config: Any) -> Any:
    """Greedy decoding with Whisper's token bookkeeping (languages, tasks, no-timestamps token),
    so `model.generate(features, language="en")` works in transformers; no suppressed tokens."""
    from transformers import GenerationConfig

    ids = token_ids()
    return GenerationConfig(
        bos_token_id=ids[EOT_TOKEN],
        eos_token_id=ids[EOT_TOKEN],
        pad_token_id=ids[EOT_TOKEN],
        decoder_start_token_id=ids[SOT_TOKEN],
        max_length=config.max_target_positions,
        do_sample=False,
        is_multilingual=True,
        lang_to_id={f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in _languages()},
        task_to_id={"translate": ids[TRANSLATE_TOKEN], "transcribe": ids[TRANSCRIBE_TOKEN]},
        no_timestamps_token_id=ids[NO_TIMESTAMPS_TOKEN],
        prev_sot_token_id=ids[SOT_PREV_TOKEN],
        return_timestamps=False,
    )


@dataclass(frozen=True)
class WeightInit:
    """Spreads of the redrawn weights: normal around 0 (LayerNorm scales: around their mean).

    The output projection is the token embedding (tied), so a row's spread sets both how loud that
    token is as decoder input and how often greedy decoding picks it. Text rows are kept modest so
    the input token does not dominate the residual stream (a tiny model would repeat it), and the
    final LayerNorm is scaled up instead to spread the logits (clear greedy margins). The
    `<|endoftext|>` row is wider than the text rows, so some clips stop early and others run to
    the token limit; the other specials and the timestamps are narrower, so plain transcription
    (after `<|notimestamps|>`) never emits them.
    """

    matrix_std: float = 0.4  # linear and convolution weights
    bias_std: float = 0.1
    norm_std: float = 0.1  # LayerNorm scales ~ 1 + N(0, norm_std)
    final_norm_scale: float = 4.0  # mean of the decoder's final LayerNorm scale
    embed_std: float = 0.5  # text token rows and the decoder's learned positions
    eos_std: float = 1.5
    special_std: float = 0.2
    timestamp_std: float = 0.1


def _widen_weights(model: Any, seed: int, init: WeightInit) -> None:
    """Redraw every parameter of ``model`` from ``seed`` but the encoder's sinusoidal position
    table (fixed in every Whisper checkpoint); transformers' 0.02 init makes every clip alike."""
    import torch

    ids = token_ids()
    first_special, first_timestamp = ids[SOT_TOKEN], ids[timestamp_tokens()[0]]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.encoder.embed_positions.weight":
                continue
            noise = torch.randn(param.shape, generator=generator)
            if name == "model.decoder.layer_norm.weight":
                param.copy_(init.final_norm_scale * (1.0 + init.norm_std * noise))
            elif "layer_norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + init.norm_std * noise)
            elif name.endswith(".bias"):
                param.copy_(init.bias_std * noise)
            elif name == "model.decoder.embed_tokens.weight":
                row_std = torch.full((param.shape[0], 1), init.embed_std)
                row_std[ids[EOT_TOKEN]] = init.eos_std
                row_std[first_special:first_timestamp] = init.special_std
                row_std[first_timestamp:] = init.timestamp_std
                param.copy_(row_std * noise)
            elif name == "model.decoder.embed_positions.weight":
                param.copy_(init.embed_std * noise)
            else:
                param.copy_(init.matrix_std * noise)


def write_tiny_whisper(
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    d_model: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_dim: int = 256,
    init: WeightInit | None = None,
) -> Path:
    """Write a random-weight Whisper checkpoint in HF layout to ``out_dir`` and return it.

    Files: config.json, generation_config.json, model.safetensors (``dtype`` weights drawn in
    float32 from ``seed`` with the spreads of ``init``, default `WeightInit()`),
    preprocessor_config.json, tokenizer.json and tokenizer_config.json. The same arguments always
    give the same weights and tokenizer. ``num_layers`` encoder and decoder layers each, with
    ``num_heads`` heads of ``d_model / num_heads`` dimensions and ``ffn_dim`` wide MLPs.
    """
    import torch
    from transformers import WhisperForConditionalGeneration

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    config = tiny_whisper_config(
        d_model=d_model, num_layers=num_layers, num_heads=num_heads, ffn_dim=ffn_dim
    )
    model = WhisperForConditionalGeneration(config)
    _widen_weights(model, seed, WeightInit() if init is None else init)
    model.generation_config = _generation_config(config)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    processor = build_processor()
    processor.tokenizer.save_pretrained(out)
    # preprocessor_config.json, the file every published Whisper checkpoint carries (transformers
    # 5's `WhisperProcessor.save_pretrained` would nest it in processor_config.json instead).
    processor.feature_extractor.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------------------
# Audio
# --------------------------------------------------------------------------------------------------


def audio_clip(seed: int, seconds: float, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A deterministic mono float32 clip in [-1, 1], clearly different for each ``seed``: three
    tones (80 Hz - 4 kHz, one gliding), each under its own slow amplitude envelope, plus noise."""
    rng = np.random.default_rng([seed, 0x5EED])
    n = round(seconds * sample_rate)
    t = np.arange(n, dtype=np.float64) / sample_rate
    signal = np.zeros(n)
    for i in range(3):
        f0 = 80.0 * 50.0 ** rng.random()  # log-uniform in 80 Hz .. 4 kHz
        glide = rng.uniform(-0.5, 0.5) * f0 if i == 0 else 0.0  # Hz per second
        phase = 2 * np.pi * (f0 * t + 0.5 * glide * t * t) + rng.uniform(0, 2 * np.pi)
        rate, offset = rng.uniform(0.3, 3.0), rng.uniform(0, 2 * np.pi)
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rate * t + offset)
        signal += rng.uniform(0.3, 1.0) * envelope * np.sin(phase)
    signal += rng.uniform(0.02, 0.2) * rng.standard_normal(n)
    peak = np.max(np.abs(signal)) if n else 1.0
    return (0.8 * signal / peak).astype(np.float32)


def wav_bytes(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """``samples`` (mono floats in [-1, 1]) as a 16-bit PCM WAV file."""
    pcm = np.clip(np.asarray(samples, dtype=np.float64), -1.0, 1.0)
    data = np.round(pcm * 32767.0).astype("<i2").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(sample_rate)
        writer.writeframes(data)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_metal.testing.tiny_whisper",
        description="Write a tiny random-weight Whisper checkpoint and print its path.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--wav", type=Path, default=None, help="also write a 5 s clip (seed --seed) to this file"
    )
    args = parser.parse_args(argv)
    print(write_tiny_whisper(args.out, dtype=args.dtype, seed=args.seed).resolve())
    if args.wav is not None:
        args.wav.write_bytes(wav_bytes(audio_clip(args.seed, 5.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
