"""The startup sequence `MetalPlatform.check_and_update_config` runs while vLLM builds its config,
before any model is loaded: rewrites that decide what is served, the capability table, the device
limits, then the settings the device needs and the backend's own configure hooks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from vllm_metal import envs
from vllm_metal._logging import init_logger
from vllm_metal.backends import get_backend
from vllm_metal.config.errors import MetalConfigError
from vllm_metal.config.kinds import kind_of
from vllm_metal.config.table import refuse_unsupported

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.protocol import Backend

logger = init_logger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WORKER_QUALNAME = "vllm_metal.worker.MetalWorker"
# `additional_config` key: engine processes on this host (`record_memory_share`).
MEMORY_SHARE_KEY = "vllm_metal_processes_per_host"
# Speculative methods served beside a TurboQuant cache: n-gram drafts have no pages; a draft
# model's, an MTP head's and an EAGLE-3 head's pages take the target's format, as vLLM's draft
# layers inherit `--kv-cache-dtype` and its skip list (`PagedDrafter.first_layer_index`).
TURBOQUANT_DRAFTERS = ("ngram", "draft_model", "mtp", "eagle3")
# The state layers' recurrent state is kept in float32 (`kv/state.py`).
STATE_SSM_DTYPES = ("auto", "float32")


def check_and_update(vllm_config: VllmConfig) -> None:
    # Imported here: the platform module imports this one while vLLM resolves its platform.
    from vllm_metal.config import gguf, kv_offload, multimodal

    envs.validate()
    multimodal.rewrite(vllm_config)
    backend = check_config(vllm_config)
    apply_config(vllm_config, backend)
    model = vllm_config.model_config
    if model is not None and model.is_hybrid:
        check_state_dtypes(vllm_config)
        backend.configure_hybrid(vllm_config)
    kv_offload.configure(vllm_config)
    gguf.use_file_tokenizer(vllm_config)


def selected_backend() -> Backend:
    """The backend VLLM_METAL_BACKEND names, its device available; refused by name otherwise."""
    try:
        backend = get_backend()
        backend.device_description()
    except ValueError as exc:
        raise MetalConfigError(str(exc)) from None
    return backend


def check_config(vllm_config: VllmConfig) -> Backend:
    """Refuse, with the setting's name and what to use instead, anything this plugin cannot run;
    the backend that serves the rest."""
    backend = selected_backend()
    refuse_unsupported(vllm_config, backend.name)
    refuse_ray(vllm_config)
    model = vllm_config.model_config
    if model is not None:
        if model.dtype not in SUPPORTED_DTYPES:
            raise MetalConfigError(
                f"vllm-metal: dtype={model.dtype} is not supported; use one of "
                "float16, bfloat16, float32 (--dtype)"
            )
        _warn_about_head_sizes(vllm_config, backend)
    cache = vllm_config.cache_config
    _check_kv_cache_dtype(vllm_config)
    align = backend.block_size_multiple()
    if cache.block_size is not None and cache.block_size % align != 0:
        raise MetalConfigError(
            f"vllm-metal: block_size={cache.block_size} is not supported; use a multiple of "
            f"{align} (e.g. 16 or 32)"
        )
    return backend


def _check_kv_cache_dtype(vllm_config: VllmConfig) -> None:
    """The cache dtypes served: the model's ('auto', a float name) and, where the capability table
    serves quantized KV caches, fp8 / fp8_e4m3 / fp8_e5m2 and int8 / fp8 / int4_per_token_head
    (`kv.quant`); every other format is refused by name. A drafter with KV memory of its own (a
    draft model, an MTP head, an EAGLE-3 head) keeps its pages in the target's format, as vLLM's
    draft layers inherit `--kv-cache-dtype`; a speculative config naming another
    `kv_cache_dtype` is refused."""
    from vllm_metal.kv.quant import requested

    dtype = vllm_config.cache_config.cache_dtype
    _check_draft_cache_dtype(vllm_config)
    _check_dflash_cache_dtype(vllm_config)
    if requested(dtype):
        return
    if dtype in ("auto", None) or str(dtype).startswith(("bfloat16", "float16", "float32")):
        return
    if _turboquant_served(vllm_config):
        return
    raise MetalConfigError(
        f"vllm-metal: kv_cache_dtype={dtype!r} is not supported (the NVFP4 and other "
        "quantized formats are not built); use 'auto', or 'fp8' / 'fp8_e4m3' / 'fp8_e5m2' / "
        "'int8_per_token_head' / 'fp8_per_token_head' / 'int4_per_token_head' / a TurboQuant "
        "preset (turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc) on "
        "the MLX backend"
    )


def _check_draft_cache_dtype(vllm_config: VllmConfig) -> None:
    """A draft whose `kv_cache_dtype` differs from the target's would put pages of two formats
    in one KV-cache group (the drafter's layers share the target's block tables): refused."""
    spec = vllm_config.speculative_config
    draft = None if spec is None else getattr(spec, "kv_cache_dtype", None)
    dtype = vllm_config.cache_config.cache_dtype
    if draft is not None and draft != dtype:
        raise MetalConfigError(
            f"vllm-metal: --speculative-config kv_cache_dtype={draft!r} differs from "
            f"--kv-cache-dtype {dtype} (a drafter's pages share the target's KV-cache group, in "
            "its format); leave the draft's kv_cache_dtype unset"
        )


def _check_dflash_cache_dtype(vllm_config: VllmConfig) -> None:
    """A DFlash head's query block attends over its context pages both ways (`key_ends`), which
    TurboQuant's read of the slots does not take: refused beside a TurboQuant cache (the fp8 and
    per-token-head ops take `key_ends`, as Gemma 3's image rows read them)."""
    from vllm_metal.kv import turboquant

    spec = vllm_config.speculative_config
    dtype = vllm_config.cache_config.cache_dtype
    if spec is not None and spec.method == "dflash" and turboquant.requested(dtype):
        raise MetalConfigError(
            f"vllm-metal: --speculative-config method='dflash' is not supported with "
            f"--kv-cache-dtype {dtype} (a DFlash head's block attends over its context both "
            "ways, which the TurboQuant read of the slots does not take); use --kv-cache-dtype "
            "fp8 or a per-token-head format, or auto"
        )


def _turboquant_served(vllm_config: VllmConfig) -> bool:
    """Whether the cache dtype is a TurboQuant preset (`kv.turboquant`) served with this config;
    False for any other name. Refuses, by name, what TurboQuant pages are not built for:
    speculative methods but `TURBOQUANT_DRAFTERS`, head sizes the format cannot pack (any of the
    target's layers or a drafter's), and prefix-LM models taking media (their image rows attend
    both ways, which the TurboQuant read does not); the capability table refuses the model kinds
    and backends it does not serve. KV offload tiers carry the slots' bytes as they are
    (`kv.offload.transfer`)."""
    from vllm_metal.kv import turboquant

    dtype = vllm_config.cache_config.cache_dtype
    if not turboquant.requested(dtype):
        return False
    refused = None
    spec = vllm_config.speculative_config
    has_draft = spec is not None and spec.method in ("draft_model", "eagle3")
    draft = spec.draft_model_config if has_draft else None
    mm = vllm_config.model_config.multimodal_config
    if mm is not None and not mm.language_model_only and vllm_config.model_config.is_mm_prefix_lm:
        refused = (
            (
                f"a prefix-LM model taking media ({vllm_config.model_config.model}: the tokens "
                "of one image attend to each other both ways, which TurboQuant's read of the "
                "slots does not take)"
            ),
            "use --kv-cache-dtype fp8",
        )
    elif spec is not None and spec.method not in TURBOQUANT_DRAFTERS:
        refused = (
            f"--speculative-config method={spec.method!r}",
            (
                f"use method {' / '.join(map(repr, TURBOQUANT_DRAFTERS))} (the drafters whose "
                "pages are built in TurboQuant slots)"
            ),
        )
    else:
        for model in (vllm_config.model_config, draft):
            if model is None:
                continue
            for size in _head_sizes(model):
                problem = turboquant.head_size_problem(dtype, size)
                if problem is not None:
                    refused = (
                        f"a model whose {problem} ({model.model})",
                        "use --kv-cache-dtype turboquant_k8v4 or fp8",
                    )
                    break
            if refused is not None:
                break
    if refused is not None:
        raise MetalConfigError(
            f"vllm-metal: --kv-cache-dtype {dtype} is not supported with {refused[0]}; "
            f"{refused[1]}, or --kv-cache-dtype auto"
        )
    return True


def _head_sizes(model) -> list[int]:
    """The head sizes of a model's attention layers: vLLM's, and Gemma 4's full-attention
    layers' (`global_head_dim`, or `per_layer_config` in transformers 5: `hf_config`)."""
    from vllm_metal.models.hf_config import global_attention

    config = model.hf_text_config.to_dict()
    full = global_attention(config).get("global_head_dim", config.get("global_head_dim"))
    return sorted(size for size in {model.get_head_size(), full} if size)


def refuse_ray(vllm_config: VllmConfig) -> None:
    """Ray serves pipeline stages (`--distributed-executor-backend ray`, each worker on a Ray
    "GPU", `MetalPlatform.ray_device_key`); Ray-managed data-parallel engines are not tested and
    are refused by their flag."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_backend == "ray":
        raise MetalConfigError(
            "vllm-metal: --data-parallel-backend ray is not supported; use mp (the default): "
            "data-parallel replicas as processes, across Macs with --data-parallel-address"
        )


def _warn_about_head_sizes(vllm_config: VllmConfig, backend: Backend) -> None:
    model = vllm_config.model_config
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config if spec is not None and spec.uses_draft_model() else None
    head_sizes = backend.head_sizes()
    # Encoder-only pooling models attend without the paged kernels (no KV cache); MLA models
    # attend over latent rows (`ops.mla_attention`, any width), whatever head size vLLM reports.
    latent = kind_of(vllm_config).name == "latent_attention"
    paged = [
        m
        for m in (model, draft)
        if m is not None and m.attn_type != "encoder_only" and not (m is model and latent)
    ]
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


def check_state_dtypes(vllm_config: VllmConfig) -> None:
    """A hybrid's convolution windows are kept in the model dtype and (state-layer hybrids) the
    recurrent state in float32; other requested dtypes are refused by their flag."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    kind = kind_of(vllm_config).name
    if (
        kind in ("state_hybrid", "vision_state_hybrid", "latent_state_hybrid")
        and cache.mamba_ssm_cache_dtype not in STATE_SSM_DTYPES
    ):
        raise MetalConfigError(
            f"vllm-metal: --mamba-ssm-cache-dtype {cache.mamba_ssm_cache_dtype} is not supported: "
            "state layers keep their recurrent state in float32; use 'auto' or 'float32'"
        )
    dtype = str(model.dtype).removeprefix("torch.")
    if cache.mamba_cache_dtype not in ("auto", dtype):
        raise MetalConfigError(
            f"vllm-metal: --mamba-cache-dtype {cache.mamba_cache_dtype} is not supported: the "
            f"convolution windows are kept in the model dtype ({dtype}); use 'auto'"
        )


def record_memory_share(vllm_config: VllmConfig) -> None:
    """Record how many engine processes this host runs (data-parallel replicas x pipeline stages
    here), so each worker sizes its KV cache from its share of the utilization budget
    (`worker.memory_share`). vLLM turns each dense DP replica into a DP=1 engine before its
    worker starts, so the count is taken here, where the whole deployment is still visible."""
    parallel = vllm_config.parallel_config
    if not isinstance(vllm_config.additional_config, dict):
        return
    if MEMORY_SHARE_KEY in vllm_config.additional_config:
        return  # recorded when the API server built the config
    replicas = parallel.data_parallel_size_local or 1
    stages_here = max(1, parallel.world_size // max(1, parallel.nnodes))
    if parallel.distributed_executor_backend == "ray":
        stages_here = 1  # one stage per Ray GPU, which each Mac declares once (docs/parallel.md)
    vllm_config.additional_config[MEMORY_SHARE_KEY] = replicas * stages_here


def apply_config(vllm_config: VllmConfig, backend: Backend) -> None:
    """Choose the worker and executor and turn off what only CUDA graphs/torch.compile use."""
    from vllm.config import CompilationMode, CUDAGraphMode

    parallel = vllm_config.parallel_config
    if parallel.worker_cls == "auto":
        parallel.worker_cls = WORKER_QUALNAME
    if parallel.distributed_executor_backend in (None, "auto"):
        parallel.distributed_executor_backend = "uni"
    parallel.disable_custom_all_reduce = True
    record_memory_share(vllm_config)
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
    if not backend.async_scheduling and scheduler.async_scheduling:
        logger.info("vllm-metal: the %s backend runs with async scheduling off", backend.name)
        scheduler.async_scheduling = False
    spec = vllm_config.speculative_config
    if spec is not None and scheduler.async_scheduling and not _drafts_under_async(vllm_config):
        logger.info(
            "vllm-metal: speculative decoding with method %r runs with async scheduling off",
            spec.method,
        )
        scheduler.async_scheduling = False

    if vllm_config.lora_config is not None:
        from vllm_metal.compat import openai_routes

        openai_routes.install()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


def _drafts_under_async(vllm_config: VllmConfig) -> bool:
    """Whether the runner serves the speculative method under async scheduling (the drafts it
    proposed put in for the scheduler's placeholders: docs/speculative-decoding.md): a draft
    model, an EAGLE-3 or DFlash head, a target's own MTP head and an MTP assistant (Gemma 4's)
    are. vLLM keeps it off for n-gram itself."""
    return vllm_config.speculative_config.method in ("draft_model", "eagle3", "dflash", "mtp")
