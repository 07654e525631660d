"""vLLM's model classes for the Qwen3.5 architectures (and their MTP drafters) and Gemma 4's
vision-language wrapper, as the MLX runner serves them: their static interface only, registered
with vLLM's `ModelRegistry` under the published architecture names.

vLLM 0.32 resolves and inspects a checkpoint's architecture by importing its model module before
any platform code runs. `vllm.model_executor.models.qwen3_5` imports `qwen3_vl`, and
`gemma4_mm` imports transformers' `Gemma4Processor`; both reach transformers' torchvision-only
image processors, so where torchvision does not load (Linux beside torch 2.13.0+cpu) vLLM refuses
every such checkpoint ("failed to be inspected"). The MLX
runner never builds vLLM's model: vLLM reads from the class only what it is (a generating model,
a hybrid with inner state, multimodal or not) and the shapes and dtypes of its Gated DeltaNet
states, which it sizes its state pages by. The classes below answer exactly that, through vLLM's
own calculators, the same on Linux and macOS.

The wrappers (`*ForConditionalGeneration`) are multimodal to vLLM, as published. Where vLLM's
own module of the family imports (macOS, whose torch and torchvision match), they take its
processor (the import is tried when vLLM first builds a wrapper's processor, and only where
torchvision is installed) and the runner runs the towers (`models/families/qwen3_5_vl.py`,
`models/families/gemma4_vl.py`). Elsewhere the runner serves their language model
(`config.multimodal` sets vLLM's `language_model_only`), and their processor is the item-count
check alone, so a request with an image or video gets vLLM's 400 naming the modality ("At most
0 image(s) ..."). Installed by
the platform before vLLM builds its model config (`MetalPlatform.pre_register_and_update`), so
only where vllm-metal is vLLM's platform.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMultiModal
from vllm.multimodal.processing import BaseProcessingInfo
from vllm.multimodal.registry import _ProcessorFactories

_INSTALLED = "_vllm_metal_models"


class Qwen3_5Base(nn.Module, HasInnerState, IsHybrid):
    """A Qwen3.5 text model as vLLM sees it: Gated DeltaNet layers between gated full-attention
    layers (run by the MLX runner, `models/families/qwen3_5.py`)."""

    is_hybrid: ClassVar[Literal[True]] = True
    has_inner_state: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        raise NotImplementedError(
            f"{type(self).__name__} is served by vllm-metal's MLX runner; vLLM's own model class "
            "is not built on this platform"
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    # vLLM's Qwen3.5 classes define these three, computed the same way.

    @classmethod
    def get_mamba_state_dtype_from_config(
        cls, vllm_config: VllmConfig
    ) -> tuple[torch.dtype, torch.dtype]:
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        )

    @classmethod
    def get_mamba_state_shape_from_config(
        cls, vllm_config: VllmConfig
    ) -> tuple[tuple[int, int], tuple[int, int, int]]:
        text = vllm_config.model_config.hf_text_config
        spec = vllm_config.speculative_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            text.linear_num_key_heads,
            text.linear_num_value_heads,
            text.linear_key_head_dim,
            text.linear_value_head_dim,
            text.linear_conv_kernel_dim,
            spec.num_speculative_tokens if spec else 0,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()


class Qwen3_5ForCausalLM(Qwen3_5Base):
    pass


class Qwen3_5MoeForCausalLM(Qwen3_5Base):
    pass


class _MediaInfo(BaseProcessingInfo):
    """The media a wrapper's vLLM processor takes (Qwen3-VL's: images and video, any number)."""

    modalities: ClassVar[tuple[str, ...]] = ("image", "video")

    def get_supported_mm_limits(self) -> dict[str, int | None]:
        return dict.fromkeys(self.modalities)


class _Gemma4MediaInfo(_MediaInfo):
    """Gemma 4's: images, video and (the models with an audio tower) audio."""

    modalities = ("image", "video", "audio")


class _ItemCountCheck:
    """The processor vLLM's chat front end builds for a wrapper: it counts a request's media items
    against the per-prompt limits (`info.validate_num_items`), which are 0 while the towers do
    not run (`config.multimodal` sets `language_model_only`), so every image or video is refused
    with a 400 naming its modality before anything would process it. With all limits 0 vLLM
    builds no other processor (its front end runs text-only)."""

    def __init__(self, info: _MediaInfo, dummy_inputs: object = None, **_: object) -> None:
        self.info = info


# The vLLM model module of each wrapper.
_MODULES = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Gemma4ForConditionalGeneration": "gemma4_mm",
}


@cache
def _vllm_module(name: str) -> Any:
    """vLLM's own model module `name`, or None where it does not import (no working
    torchvision). Tried only where torchvision is installed, and only once a wrapper is served."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        return importlib.import_module(f"vllm.model_executor.models.{name}")
    except (ImportError, RuntimeError):  # torchvision built for another torch
        return None


def uses_vllm_processor(module: str) -> bool:
    """Whether the wrappers of vLLM's model module `module` take vLLM's processor here (and the
    runner their towers)."""
    return _vllm_module(module) is not None


def _real(name: str) -> Any:
    """vLLM's class `name`, where its module imports."""
    module = _vllm_module(_MODULES[name])
    return None if module is None else getattr(module, name)


def _processor_factory(name: str, media: type[_MediaInfo] = _MediaInfo) -> _ProcessorFactories:
    """The processor factories of wrapper `name`: vLLM's own where its module imports (decided
    when vLLM first builds a processor, so no other model pays for the import), else the item
    count check over the modalities of `media`."""

    def info(ctx: Any) -> Any:
        real = _real(name)
        return media(ctx) if real is None else real._processor_factory.info(ctx)

    def dummy_inputs(info: Any) -> Any:
        return (
            None
            if isinstance(info, _MediaInfo)
            else _real(name)._processor_factory.dummy_inputs(info)
        )

    def processor(info: Any, dummy_inputs: Any = None, **kwargs: Any) -> Any:
        if isinstance(info, _MediaInfo):
            return _ItemCountCheck(info)
        return _real(name)._processor_factory.processor(info, dummy_inputs, **kwargs)

    return _ProcessorFactories(info=info, processor=processor, dummy_inputs=dummy_inputs)


class _Qwen3_5Wrapper(Qwen3_5Base, SupportsMultiModal):
    """The published vision-language wrapper: multimodal to vLLM, with vLLM's processor where it
    imports and the item count check elsewhere."""

    supports_multimodal: ClassVar[Literal[True]] = True

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        real = _real(cls.__name__)
        # Without vLLM's processor no item passes the count check.
        return None if real is None else real.get_placeholder_str(modality, i)


class Qwen3_5ForConditionalGeneration(_Qwen3_5Wrapper):
    _processor_factory = _processor_factory("Qwen3_5ForConditionalGeneration")


class Qwen3_5MoeForConditionalGeneration(_Qwen3_5Wrapper):
    _processor_factory = _processor_factory("Qwen3_5MoeForConditionalGeneration")


class Gemma4ForConditionalGeneration(nn.Module, SupportsMultiModal):
    """Gemma 4's vision-language wrapper: multimodal to vLLM, with vLLM's processor where its
    module imports and the item count check elsewhere (`models/families/gemma4_vl.py`)."""

    supports_multimodal: ClassVar[Literal[True]] = True
    _processor_factory = _processor_factory("Gemma4ForConditionalGeneration", _Gemma4MediaInfo)
    __init__ = Qwen3_5Base.__init__
    embed_input_ids = Qwen3_5Base.embed_input_ids
    forward = Qwen3_5Base.forward
    compute_logits = Qwen3_5Base.compute_logits
    get_placeholder_str = _Qwen3_5Wrapper.get_placeholder_str


class Qwen3_5MTP(nn.Module, SupportsMultiModal):
    """Qwen3.5's multi-token-prediction drafter (`--speculative-config '{"method": "mtp"}'`) as
    vLLM inspects it: a generating model that takes the target's merged embeddings (multimodal,
    with no processor of its own, as vLLM's class). vLLM builds the draft config from it; the
    platform then decides whether the method is served (`config.startup`)."""

    supports_multimodal: ClassVar[Literal[True]] = True
    __init__ = Qwen3_5Base.__init__
    embed_input_ids = Qwen3_5Base.embed_input_ids
    forward = Qwen3_5Base.forward
    compute_logits = Qwen3_5Base.compute_logits


class Qwen3_5MoeMTP(Qwen3_5MTP):
    pass


CLASSES: tuple[type[nn.Module], ...] = (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MTP,
    Qwen3_5MoeMTP,
    Gemma4ForConditionalGeneration,
)


def _classes() -> tuple[type[nn.Module], ...]:
    # Qwen3-ASR's class lives in its own module (`compat/qwen3_asr.py`).
    from vllm_metal.compat.qwen3_asr import Qwen3ASRForConditionalGeneration

    return (*CLASSES, Qwen3ASRForConditionalGeneration)


def install() -> None:
    """Register the classes with vLLM's `ModelRegistry` under their names (idempotent)."""
    from vllm.model_executor.models.registry import ModelRegistry

    if getattr(ModelRegistry, _INSTALLED, False):
        return
    for cls in _classes():
        ModelRegistry.register_model(cls.__name__, cls)
    setattr(ModelRegistry, _INSTALLED, True)
