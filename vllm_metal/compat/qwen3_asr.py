"""vLLM's view of Qwen3-ASR (`Qwen3ASRForConditionalGeneration`) as the MLX runner serves it:
its static interface (multimodal with audio, a transcription model) and its processor, registered
under the published architecture name by `compat.vllm_models.install`.

vLLM 0.32's own `qwen3_asr` module imports `qwen2_5_omni_thinker`, which reaches transformers'
torchvision-only Qwen2-VL image processor, so where torchvision does not load (Linux beside torch
2.13.0+cpu) vLLM cannot inspect the architecture at all. The runner never builds vLLM's model
(`models/families/qwen3_asr.py` runs it in MLX), so this class carries only what vLLM reads from
it: the transcription prompt, the speech-to-text settings, the output post-processing, and the
processor that turns one clip into log-mel features and the prompt's audio placeholder into one
token per encoder row. It is used on every host, so the plugin serves the model the same way.

The processor calls transformers' `Qwen3ASRProcessor` one clip at a time (batch padding would
change a shorter clip's features) and keeps each clip's valid frames only: an item's tensors are
`input_audio_features [num_mel_bins, frames]` and `audio_feature_lengths` (frames).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from transformers.feature_extraction_utils import BatchFeature
from vllm.config import ModelConfig, SpeechToTextConfig
from vllm.inputs import TokensPrompt
from vllm.model_executor.models.interfaces import (
    StreamingTranscriptionPostProcessor,
    SupportsMultiModal,
    SupportsTranscription,
)
from vllm.model_executor.models.whisper import ISO639_1_SUPPORTED_LANGS
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems, MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)

from vllm_metal.models.families.qwen3_asr import output_length

AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
ASR_TEXT_TAG = "<asr_text>"
# ChatML-like control tokens a request's own text must not smuggle into the prompt.
_CONTROL = re.compile(r"<\|[^|]+\|>")
# The answer's header, `language <Name><asr_text>`: its first word, and how long it may grow
# before a stream gives up waiting for the tag.
_HEADER_START = "language "
_HEADER_MAX_CHARS = 50


class _Info(BaseProcessingInfo):
    def get_hf_processor(self, **kwargs: object) -> Any:
        from transformers import Qwen3ASRProcessor

        return self.ctx.get_hf_processor(Qwen3ASRProcessor, **kwargs)

    def get_feature_extractor(self, **kwargs: object) -> Any:
        return self.get_hf_processor(**kwargs).feature_extractor

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"audio": None}

    def get_data_parser(self) -> MultiModalDataParser:
        return MultiModalDataParser(target_sr=self.get_feature_extractor().sampling_rate)


class _DummyInputs(BaseDummyInputsBuilder[_Info]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().audio_token * mm_counts.get("audio", 0)

    def get_dummy_mm_data(
        self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Mapping[str, Any]
    ) -> dict[str, Any]:
        extractor = self.info.get_feature_extractor()
        # The longest clip a transcription request hands the model.
        length = extractor.chunk_length * extractor.sampling_rate
        audios = self._get_dummy_audios(
            length=length,
            num_audios=mm_counts.get("audio", 0),
            overrides=mm_options.get("audio"),
        )
        return {"audio": audios}


def _fields(hf_inputs: Mapping[str, torch.Tensor]) -> dict[str, MultiModalFieldConfig]:
    lengths = hf_inputs.get("audio_feature_lengths", torch.empty(0, dtype=torch.long))
    return {
        "input_audio_features": MultiModalFieldConfig.flat_from_sizes("audio", lengths, dim=1),
        "audio_feature_lengths": MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
    }


class _Processor(BaseMultiModalProcessor[_Info]):
    def _get_hf_mm_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.dummy_inputs.get_dummy_text(mm_counts)

    def _call_hf_processor(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        audios = hf_data.get("audio") or []
        if not isinstance(audios, (list, tuple)):
            audios = [audios]
        token = self.info.get_hf_processor().audio_token
        features, lengths = [], []
        for audio in audios:
            one = {**hf_data, "text": [token], "audio": [audio]}
            out = super()._call_hf_processor(one, hf_kwargs)
            valid = out["input_features_mask"][0].bool()
            features.append(out["input_features"][0][:, valid])
            lengths.append(int(valid.sum()))
        if not features:
            return BatchFeature()
        return BatchFeature(
            {
                "input_audio_features": torch.cat(features, dim=1),
                "audio_feature_lengths": torch.tensor(lengths, dtype=torch.long),
            }
        )

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return _fields(hf_inputs)

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, Any],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        token_id = self.info.get_tokenizer().get_vocab()[processor.audio_token]
        lengths = out_mm_kwargs.get_data().get("audio_feature_lengths")
        frames = [] if lengths is None else [int(n) for n in lengths]
        n_window = getattr(processor.feature_extractor, "n_window", 50)

        def rows(item: int) -> list[int]:
            count = output_length(frames[item], n_window)
            if count == 0:
                raise ValueError(f"audio item {item} is too short for the model to encode")
            return [token_id] * count

        return [PromptReplacement(modality="audio", target=[token_id], replacement=rows)]


def _plain(text: str | None) -> str:
    """`text` without control tokens or the transcript tag, removed until none is left (a removal
    may join the pieces of another)."""
    previous = None
    text = text or ""
    while text != previous:
        previous = text
        text = _CONTROL.sub("", text).replace(ASR_TEXT_TAG, "")
    return text


class _StreamedTranscript(StreamingTranscriptionPostProcessor):
    """A streamed answer without its header: deltas are held back while the answer so far may
    still be a `language <Name>` header, then sent from after its `<asr_text>` tag (from the
    start where the answer has no header)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of `text` already handled
        self.start: int | None = None  # where the transcript begins, once known

    def _maybe_header(self) -> bool:
        head = self.text.lstrip()
        if _HEADER_START.startswith(head):
            return True
        return head.startswith(_HEADER_START) and len(head) < _HEADER_MAX_CHARS and "\n" not in head

    def process_delta(self, text_delta: str, finished: bool) -> str:
        self.text += text_delta
        if self.start is None:
            if ASR_TEXT_TAG in self.text:
                self.start = self.text.index(ASR_TEXT_TAG) + len(ASR_TEXT_TAG)
            elif self._maybe_header() and not finished:
                return ""
            else:
                self.start = 0
        out = self.text[max(self.start, self.sent) :]
        self.sent = len(self.text)
        return out


@MULTIMODAL_REGISTRY.register_processor(_Processor, info=_Info, dummy_inputs=_DummyInputs)
class Qwen3ASRForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsTranscription):
    """Qwen3-ASR as vLLM inspects it; the MLX runner runs it (`models/families/qwen3_asr.py`)."""

    supports_multimodal: ClassVar[Literal[True]] = True
    supported_languages = ISO639_1_SUPPORTED_LANGS

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        raise NotImplementedError(
            "Qwen3ASRForConditionalGeneration is served by vllm-metal's MLX runner; vLLM's own "
            "model class is not built on this platform"
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("audio"):
            return AUDIO_PLACEHOLDER
        raise ValueError(f"Qwen3-ASR takes audio, not {modality}")

    @classmethod
    def get_speech_to_text_config(
        cls, model_config: ModelConfig, task_type: str
    ) -> SpeechToTextConfig:
        from vllm.transformers_utils.processor import cached_processor_from_config

        extractor = cached_processor_from_config(model_config).feature_extractor
        return SpeechToTextConfig(
            max_audio_clip_s=extractor.chunk_length, sample_rate=extractor.sampling_rate
        )

    @classmethod
    def get_generation_prompt(cls, stt_params: Any) -> TokensPrompt:
        """The Qwen3-ASR chat turns of one clip: an optional system turn with the request's
        prompt as context, the user turn holding the audio, and the assistant turn, opened with
        `language <Name><asr_text>` when the language is given (the target language when
        translating)."""
        from vllm.tokenizers import cached_tokenizer_from_config

        if stt_params.task_type not in ("transcribe", "translate"):
            raise ValueError(f"Qwen3-ASR has no task {stt_params.task_type!r}")
        context = _plain(stt_params.request_prompt)
        text = f"<|im_start|>system\n{context}<|im_end|>\n" if context else ""
        text += f"<|im_start|>user\n{AUDIO_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
        translate = stt_params.task_type == "translate"
        code = stt_params.to_language if translate else stt_params.language
        if code is not None:
            text += f"language {cls.supported_languages.get(code, code)}{ASR_TEXT_TAG}"
        tokenizer = cached_tokenizer_from_config(stt_params.model_config)
        return TokensPrompt(
            prompt_token_ids=tokenizer.encode(text, add_special_tokens=True),
            multi_modal_data={"audio": stt_params.audio},
        )

    @classmethod
    def get_streaming_post_processor_cls(cls) -> type[StreamingTranscriptionPostProcessor]:
        return _StreamedTranscript

    @classmethod
    def post_process_output(cls, text: str) -> str:
        """The transcript after the model's `language <Name><asr_text>` header, if it wrote one."""
        return text.rsplit(ASR_TEXT_TAG, 1)[1] if ASR_TEXT_TAG in text else text
