"""vLLM platform for Apple Silicon: device facts from the selected backend; what is served and
the settings applied are decided by `vllm_metal.config` (the startup sequence, the capability
table), and vLLM internals are patched only through `vllm_metal.compat`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_metal.backends import backend_name, get_backend
from vllm_metal.compat.torch_accelerator import tolerate_missing_accelerator
from vllm_metal.config.startup import SUPPORTED_DTYPES
from vllm_metal.host import chip_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig

tolerate_missing_accelerator()


def _torch_device_type() -> str:
    """The torch device vLLM's tensors live on, as the backend says; `cpu` for a backend this
    build lacks (refused by name at startup)."""
    try:
        return get_backend().torch_device_type()
    except ValueError:
        return "cpu"


class MetalPlatform(Platform):
    _enum = PlatformEnum.OOT
    # vLLM builds torch devices from these names.
    device_name: str = _torch_device_type()
    device_type: str = _torch_device_type()
    dispatch_key: str = _torch_device_type().upper()
    dist_backend: str = "gloo"
    device_control_env_var: str = "VLLM_METAL_VISIBLE_DEVICES"
    # vLLM's Ray executor places one worker per Ray "GPU": a Mac's GPU, which Ray does not detect
    # on macOS, so each node declares it (`ray start --num-gpus 1`, docs/parallel.md).
    ray_device_key: str = "GPU"
    simple_compile_backend: str = "eager"
    supported_quantization: ClassVar[list[str]] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return list(SUPPORTED_DTYPES)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        try:
            device = get_backend().device_description()
        except Exception:  # noqa: BLE001 - a name for logs never stops the engine's start
            device = f"{backend_name()} unavailable"
        return f"{chip_name()} ({device})"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return get_backend().total_memory_bytes()

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(get_backend().active_memory_bytes())

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        get_backend().seed(seed)

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        super().verify_quantization(quant)
        from vllm_metal.config.features import CHECKPOINT_QUANTIZATIONS

        if quant in CHECKPOINT_QUANTIZATIONS:
            # A checkpoint format the MLX loader reads (GPT-OSS MXFP4) in any of our dtypes.
            from vllm_metal.compat.vllm_quantization import accept_act_dtypes

            accept_act_dtypes(quant, SUPPORTED_DTYPES)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        return get_backend().attention_backend()

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def supports_structured_output(cls) -> bool:
        return True

    @classmethod
    def is_sleep_mode_available(cls) -> bool:
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # Sliding-window and full-attention layers keep separate KV-cache groups, so vLLM frees
        # the blocks that fall out of a window (vllm_metal.kv).
        return True

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return get_backend().opaque_attention_op

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        get_backend().register_kernel_overrides()

    @classmethod
    def import_kernels(cls) -> None:
        get_backend().import_kernels()

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        # Requests the runners cannot run become a 400 before they reach the engine.
        from vllm_metal.config.requests import validate_request

        validate_request(processed_inputs, params)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        # Runs before vLLM builds the model config. vLLM 0.32 reads no GGUF files; this makes a
        # `.gguf` model path build its config from the file. Qwen3.5's vLLM classes import
        # torchvision-only code; vLLM inspects ours instead (`compat.vllm_models`).
        from vllm_metal.compat import vllm_config, vllm_models

        vllm_config.install()
        vllm_models.install()

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm_metal.compat import engine_shutdown
        from vllm_metal.config import startup

        engine_shutdown.install()  # this process may be the API server, which stops the engine
        startup.check_and_update(vllm_config)
