"""vLLM platform for Apple Silicon: device facts (from the selected backend), the config checks
that decide at startup whether this plugin can serve what was asked, and the settings it applies.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_metal import envs
from vllm_metal._logging import init_logger
from vllm_metal.backends import backend_name, get_backend
from vllm_metal.capabilities import MetalConfigError, refuse_unsupported
from vllm_metal.host import chip_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WORKER_QUALNAME = "vllm_metal.worker.MetalWorker"


def _tolerate_missing_torch_accelerator() -> None:
    """vLLM's teardown calls torch.accelerator.empty_cache() on every non-CPU platform (its V1
    runner also synchronize()); torch raises there when it has no accelerator (either backend
    off-Mac), so make them no-ops then."""
    accel = getattr(torch, "accelerator", None)
    if accel is None or accel.is_available():
        return
    for name in ("empty_cache", "empty_host_cache", "synchronize"):
        if hasattr(accel, name):
            setattr(accel, name, lambda: None)


_tolerate_missing_torch_accelerator()

# The attention backend vLLM's layers use on the torch backend (`backends/torch/attention.py`).
TORCH_ATTENTION_BACKEND = "vllm_metal.backends.torch.attention.MetalPagedAttentionBackend"


def _torch_device_type() -> str:
    """The torch device vLLM's tensors live on: the torch backend's (`mps` on a Mac); with the
    MLX backend the host (`cpu`), since MLX owns the accelerator."""
    if backend_name() == "mps":
        from vllm_metal.backends.torch.device import device_type

        return device_type()
    return "cpu"


class MetalPlatform(Platform):
    _enum = PlatformEnum.OOT
    # vLLM builds torch devices from these names.
    device_name: str = _torch_device_type()
    device_type: str = _torch_device_type()
    dispatch_key: str = _torch_device_type().upper()
    dist_backend: str = "gloo"
    device_control_env_var: str = "VLLM_METAL_VISIBLE_DEVICES"
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return list(SUPPORTED_DTYPES)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        try:
            device = get_backend().device_description()
        except Exception:
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
        # A checkpoint format the MLX loader reads (GPT-OSS MXFP4) in any of our dtypes.
        from vllm_metal.quantization import accept_checkpoint_quantization

        accept_checkpoint_quantization(quant)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if backend_name() == "mps":
            # Importing it registers its name with vLLM's backend enum in this process.
            importlib.import_module(TORCH_ATTENTION_BACKEND.rsplit(".", 1)[0])
            return TORCH_ATTENTION_BACKEND
        # vLLM asks while it builds its config; the MLX runner runs no vLLM attention layer, so
        # this only has to name a backend that imports on this host.
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return AttentionBackendEnum.CPU_ATTN.get_path()

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
        # The torch backend runs eagerly: its attention layers call the backend directly
        # rather than through vLLM's custom op (registered for one dispatch key).
        return backend_name() != "mps"

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        if backend_name() == "mps":
            from vllm_metal.backends.torch.model_runner import register_kernel_overrides

            register_kernel_overrides()

    @classmethod
    def import_kernels(cls) -> None:
        # The MLX runner and the torch backend on `mps` use none of vLLM's compiled ops (the
        # native extension is loaded by vllm_metal.ops when first needed). The torch backend on
        # the cpu device takes vLLM's CPU GEMMs (backends/torch/cpu_gemm.py), so it loads
        # vLLM's CPU kernels the way vLLM's CPU platform does.
        if cls.device_type == "cpu" and backend_name() == "mps":
            from vllm.platforms.cpu import CpuPlatform

            CpuPlatform.import_kernels()

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        # Requests the MLX runner cannot run become a 400 before they reach the engine.
        from vllm_metal.request_validation import validate_request

        validate_request(processed_inputs, params)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        # vLLM 0.32 reads no GGUF files; this makes a `.gguf` model path build its config from
        # the file (vllm_metal.gguf_frontend). Runs before vLLM builds the model config.
        from vllm_metal import gguf_frontend

        gguf_frontend.install()

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        envs.validate()
        from vllm_metal import mm_frontend

        mm_frontend.serve_language_model_only(vllm_config)
        mm_frontend.limit_to_encoded_modalities(vllm_config)
        mm_frontend.keep_media_spans_whole(vllm_config)
        check_config(vllm_config)
        apply_config(vllm_config)
        if vllm_config.model_config is not None and vllm_config.model_config.is_hybrid:
            if backend_name() == "mps":
                # vLLM's runner keeps the state pages; vLLM sizes the blocks for them.
                from vllm_metal.backends.torch import short_conv

                short_conv.configure(vllm_config)
            else:
                from vllm_metal.kv import state

                state.align_block_size(vllm_config)
        from vllm_metal.kv.offload import config as kv_offload

        kv_offload.configure(vllm_config)
        from vllm_metal import gguf_frontend

        gguf_frontend.use_file_tokenizer(vllm_config)


def check_config(vllm_config: VllmConfig) -> None:
    """Refuse, with the setting's name and what to use instead, anything this plugin cannot run."""
    try:
        backend = get_backend()
    except ValueError as exc:
        raise MetalConfigError(str(exc)) from None
    refuse_unsupported(vllm_config, backend.name)
    model = vllm_config.model_config
    if model is not None:
        if model.dtype not in SUPPORTED_DTYPES:
            raise MetalConfigError(
                f"vllm-metal: dtype={model.dtype} is not supported; use one of "
                "float16, bfloat16, float32 (--dtype)"
            )
        spec = vllm_config.speculative_config
        draft = spec.draft_model_config if spec is not None and spec.uses_draft_model() else None
        head_sizes = backend.head_sizes()
        # Encoder-only pooling models attend without the paged kernels (no KV cache).
        paged = [m for m in (model, draft) if m is not None and m.attn_type != "encoder_only"]
        for checked in paged:
            if checked.get_head_size() not in head_sizes:
                logger.warning(
                    "attention head size %d of model=%r has no Metal kernel (they are built for "
                    "%s): its paged attention runs the generic path, the C++ body on the CPU and "
                    "MLX's reference ops on the GPU, which is slower there",
                    checked.get_head_size(),
                    checked.model,
                    ", ".join(map(str, sorted(head_sizes))),
                )
    cache = vllm_config.cache_config
    if cache.cache_dtype not in ("auto", None) and not str(cache.cache_dtype).startswith(
        ("bfloat16", "float16", "float32")
    ):
        raise MetalConfigError(
            f"vllm-metal: kv_cache_dtype={cache.cache_dtype!r} is not supported; use 'auto'"
        )
    align = backend.block_size_multiple()
    if cache.block_size is not None and cache.block_size % align != 0:
        raise MetalConfigError(
            f"vllm-metal: block_size={cache.block_size} is not supported; use a multiple of "
            f"{align} (e.g. 16 or 32)"
        )


def apply_config(vllm_config: VllmConfig) -> None:
    """Choose the worker and executor and turn off what only CUDA graphs/torch.compile use."""
    from vllm.config import CompilationMode, CUDAGraphMode

    parallel = vllm_config.parallel_config
    if parallel.worker_cls == "auto":
        parallel.worker_cls = WORKER_QUALNAME
    if parallel.distributed_executor_backend in (None, "auto"):
        parallel.distributed_executor_backend = "uni"
    parallel.disable_custom_all_reduce = True
    if getattr(parallel, "enable_dbo", False):
        parallel.enable_dbo = False

    compilation = vllm_config.compilation_config
    compilation.mode = CompilationMode.NONE
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    compilation.cudagraph_capture_sizes = []
    compilation.max_cudagraph_capture_size = 0

    cache = vllm_config.cache_config
    if not cache.user_specified_block_size:
        cache.block_size = 16

    scheduler = vllm_config.scheduler_config
    if backend_name() == "mps" and scheduler.async_scheduling:
        logger.info("vllm-metal: the torch backend runs with async scheduling off")
        scheduler.async_scheduling = False
    if vllm_config.speculative_config is not None and scheduler.async_scheduling:
        # The runner proposes drafts after sampling each step; the async scheduler would send
        # placeholders for drafts the runner has not made yet.
        logger.info("vllm-metal: speculative decoding runs with async scheduling off")
        scheduler.async_scheduling = False

    if vllm_config.lora_config is not None:
        from vllm_metal import lora_frontend

        lora_frontend.install()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
