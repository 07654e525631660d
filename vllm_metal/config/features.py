"""The second axis of the capability table: what a config asks for beside its model.

A feature's `requested(config)` is the setting that asks for it as the user wrote it
("--enable-lora", "tensor_parallel_size=2"), or None; `advice` is what to change where it is not
served. `FEATURES` is in the order a refusal is looked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_metal.config.kinds import model_attr
from vllm_metal.kv.offload import CONNECTOR

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Formats vLLM names as quantization methods that the MLX loader reads itself (GPT-OSS's MXFP4
# experts, `models/families/gpt_oss.py`): a checkpoint format, not a vLLM kernel to refuse.
CHECKPOINT_QUANTIZATIONS = frozenset({"gpt_oss_mxfp4"})


@dataclass(frozen=True)
class Feature:
    name: str
    what: str  # what the user asked for, in words
    advice: str  # the setting to change
    requested: Callable[[VllmConfig], str | None]


def offload_setting(config: VllmConfig) -> str | None:
    """The setting that turns KV offloading on (`config.kv_offload`), if any."""
    from vllm_metal import envs

    transfer = config.kv_transfer_config
    if config.cache_config.kv_offloading_size is not None:
        return f"kv_offloading_size={config.cache_config.kv_offloading_size}"
    if transfer is not None and transfer.kv_connector == CONNECTOR:
        return f"--kv-transfer-config kv_connector={CONNECTOR!r}"
    if envs.VLLM_METAL_SSD_CACHE_DIR is not None:
        return f"VLLM_METAL_SSD_CACHE_DIR={envs.VLLM_METAL_SSD_CACHE_DIR!r}"
    return None


def _parallel(name: str) -> Callable[[VllmConfig], str | None]:
    def requested(config: VllmConfig) -> str | None:
        size = getattr(config.parallel_config, name)
        return f"{name}={size}" if size > 1 else None

    return requested


def _mlx_quantized(config: VllmConfig) -> str | None:
    """An MLX-quantized checkpoint (mlx_lm.convert -q)."""
    quant = getattr(model_attr(config, "hf_config"), "quantization", None)
    if isinstance(quant, dict) and "bits" in quant:
        return f"an MLX-quantized checkpoint ({quant['bits']} bits)"
    return None


def _gguf(config: VllmConfig) -> str | None:
    from vllm_metal.models.loaders import is_gguf

    return "a GGUF file" if is_gguf(model_attr(config, "model")) else None


def _vllm_quantization(config: VllmConfig) -> str | None:
    quant = model_attr(config, "quantization")
    if quant is None or quant in CHECKPOINT_QUANTIZATIONS:
        return None
    return f"quantization={quant!r}"


def _fp8_kv_cache(config: VllmConfig) -> str | None:
    from vllm_metal.kv.quant import requested

    dtype = getattr(config.cache_config, "cache_dtype", None)
    return f"--kv-cache-dtype {dtype}" if requested(dtype) else None


def _turboquant_kv_cache(config: VllmConfig) -> str | None:
    from vllm_metal.kv.turboquant import requested

    dtype = getattr(config.cache_config, "cache_dtype", None)
    return f"--kv-cache-dtype {dtype}" if requested(dtype) else None


def _kv_connector(config: VllmConfig) -> str | None:
    connector = getattr(config.kv_transfer_config, "kv_connector", None)
    if connector in (None, CONNECTOR):
        return None
    return f"--kv-transfer-config kv_connector={connector!r}"


def _speculative(config: VllmConfig) -> str | None:
    spec = config.speculative_config
    return None if spec is None else f"--speculative-config method={spec.method!r}"


NO_OFFLOAD = "remove --kv-offloading-size / VLLM_METAL_SSD_CACHE_DIR"

FEATURES: tuple[Feature, ...] = (
    Feature(
        "tensor_parallel",
        "tensor parallelism (a Mac is one device, and no link between Macs is fast enough for "
        "the all-reduce every layer of a tensor-parallel step needs)",
        "use --tensor-parallel-size 1; spread a model's layers over processes or Macs with "
        "--pipeline-parallel-size, or its traffic with --data-parallel-size",
        _parallel("tensor_parallel_size"),
    ),
    Feature(
        "pipeline_parallel",
        "pipeline parallelism",
        "use --pipeline-parallel-size 1",
        _parallel("pipeline_parallel_size"),
    ),
    Feature(
        "data_parallel",
        "data parallelism",
        "use --data-parallel-size 1",
        _parallel("data_parallel_size"),
    ),
    Feature(
        "lora",
        "LoRA adapters",
        "remove --enable-lora",
        lambda c: "--enable-lora" if c.lora_config is not None else None,
    ),
    Feature(
        "speculative_decoding",
        "speculative decoding",
        "remove --speculative-config",
        _speculative,
    ),
    Feature(
        "pooling",
        "pooling (embeddings, classification, scoring)",
        "serve it with --runner generate",
        lambda c: "runner='pooling'" if model_attr(c, "runner_type") == "pooling" else None,
    ),
    Feature(
        "mm_embeds",
        "embedding inputs",
        "remove --enable-mm-embeds",
        lambda c: (
            "--enable-mm-embeds"
            if getattr(model_attr(c, "multimodal_config"), "enable_mm_embeds", False)
            else None
        ),
    ),
    Feature("kv_offload", "KV offloading", NO_OFFLOAD, offload_setting),
    Feature(
        "mlx_quantized",
        "MLX-quantized checkpoints",
        "serve the unquantized checkpoint, or use the MLX backend (VLLM_METAL_BACKEND=mlx)",
        _mlx_quantized,
    ),
    Feature(
        "gguf",
        "GGUF checkpoints",
        "serve a safetensors checkpoint, or use the MLX backend (VLLM_METAL_BACKEND=mlx)",
        _gguf,
    ),
    Feature(
        "sleep_mode",
        "sleep mode",
        "remove --enable-sleep-mode",
        lambda c: "--enable-sleep-mode" if model_attr(c, "enable_sleep_mode", False) else None,
    ),
    Feature(
        "vllm_quantization",
        "vLLM quantization methods",
        "serve an MLX-quantized checkpoint (mlx_lm.convert -q) instead of --quantization",
        _vllm_quantization,
    ),
    Feature(
        "fp8_kv_cache",
        "quantized KV caches",
        "use --kv-cache-dtype auto",
        _fp8_kv_cache,
    ),
    Feature(
        "turboquant_kv_cache",
        "TurboQuant KV caches",
        "use --kv-cache-dtype auto",
        _turboquant_kv_cache,
    ),
    Feature(
        "kv_connector",
        "KV connectors other than vLLM's offloading connector",
        "use --kv-offloading-size (the native OffloadingConnector)",
        _kv_connector,
    ),
)

BY_NAME = {feature.name: feature for feature in FEATURES}
