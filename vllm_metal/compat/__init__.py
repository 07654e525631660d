"""Every patch of vLLM (and mlx-lm, torch) internals, one entry each in `PATCHES`: the target as a
dotted path, why, the version it was written against and when it can go. The patch code lives in
this package, one module per target (`where`); tests/compat/test_targets.py checks that every
target still exists with the parameters it was written against, so a version bump fails there
first. Plain data only: importing this package imports nothing else.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

VLLM = "vllm 0.32.0"
MLX_LM = "mlx-lm 0.32.2"
TORCH = "torch 2.13.0"


@dataclass(frozen=True)
class Patch:
    target: str  # dotted path of what is replaced, wrapped or read
    why: str
    written_for: str
    remove_when: str
    where: str  # the code that patches it
    # Parameter names of the target as it was written against (None: not a callable, or its
    # parameters do not matter).
    params: tuple[str, ...] | None = None


_ATTENTION_CLASS = "attention class whose paged call replaces `__call__` for a paged cache"
_GGUF = "vLLM 0.32 reads no GGUF files"

PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.triton_utils.dispatcher.register_kernels",
        "its scan of loaded modules reads each attribute's vars(), which llvmlite's ffi.lib "
        "(loaded with numba) answers with a function wrapper: such modules are left out of it",
        VLLM,
        "when vLLM's scan passes over attributes whose vars() is no dict",
        "vllm_metal.compat.triton_dispatch.register_kernels",
        ("overrides",),
    ),
    # `get_config` is called from its own module (generation config) and through the name
    # vllm.config.model imported: both names are wrapped.
    *(
        Patch(
            f"{module}.get_config",
            "a `.gguf` path with --config-format auto picks the 'gguf' config parser",
            VLLM,
            f"{_GGUF}; goes when vLLM reads GGUF configs again",
            "vllm_metal.compat.vllm_config.install",
            (
                *("model", "trust_remote_code", "revision", "code_revision", "config_format"),
                *("hf_overrides_kw", "hf_overrides_fn", "kwargs"),
            ),
        )
        for module in ("vllm.transformers_utils.config", "vllm.config.model")
    ),
    Patch(
        "vllm.transformers_utils.config.register_config_parser",
        "registers the 'gguf' config parser (vLLM's API, the class contract below)",
        VLLM,
        f"{_GGUF}; with the entries above",
        "vllm_metal.compat.vllm_config.install",
        ("config_format",),
    ),
    Patch(
        "vllm.transformers_utils.config_parser_base.ConfigParserBase.parse",
        "the 'gguf' parser overrides it",
        VLLM,
        f"{_GGUF}; with the entries above",
        "vllm_metal.compat.vllm_config._parser_class",
        ("self", "model", "trust_remote_code", "revision", "code_revision", "kwargs"),
    ),
    Patch(
        "vllm.engine.arg_utils.maybe_override_with_speculators",
        "the speculators probe parses a `.gguf` file as JSON; skipped for one",
        VLLM,
        "when vLLM's probe skips non-JSON checkpoints",
        "vllm_metal.compat.vllm_config.install",
        (
            "model",
            "tokenizer",
            "trust_remote_code",
            "revision",
            "vllm_speculative_config",
            "hf_token",
            "kwargs",
        ),
    ),
    Patch(
        "vllm.entrypoints.openai.models.serving.OpenAIServingModels.load_lora_adapter",
        "an adapter the runner refuses is a 400, not vLLM's 500 (told by ADAPTER_REFUSAL)",
        VLLM,
        "when vLLM maps engine-side adapter errors to 400 itself",
        "vllm_metal.compat.openai_routes.install",
        ("self", "request", "base_model_name"),
    ),
    Patch(
        "vllm.entrypoints.openai.models.serving.OpenAIServingModels.unload_lora_adapter",
        "unloading also removes the adapter from the workers, freeing its memory",
        VLLM,
        "when vLLM's unload route calls engine_client.remove_lora",
        "vllm_metal.compat.openai_routes.install",
        ("self", "request"),
    ),
    # Qwen3.5's classes as vLLM sees them (`compat.vllm_models`): registered under the published
    # architecture names with vLLM's API, computing what vLLM's own classes compute with the
    # calculators below.
    Patch(
        "vllm.model_executor.models.registry._ModelRegistry.register_model",
        "Qwen3.5's architectures resolve to classes that import no torchvision-only code",
        VLLM,
        "when vLLM's qwen3_5 module imports on every host vLLM supports (torchvision optional)",
        "vllm_metal.compat.vllm_models.install",
        ("self", "model_arch", "model_cls"),
    ),
    Patch(
        "vllm.model_executor.layers.mamba.mamba_utils.MambaStateShapeCalculator"
        ".gated_delta_net_state_shape",
        "the Gated DeltaNet state shapes vLLM's Qwen3.5 classes give, computed the same way",
        VLLM,
        "with the entry above",
        "vllm_metal.compat.vllm_models.Qwen3_5Base",
        (
            *("tp_world_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"),
            *("conv_kernel_size", "num_spec"),
        ),
    ),
    Patch(
        "vllm.model_executor.layers.mamba.mamba_utils.MambaStateDtypeCalculator"
        ".gated_delta_net_state_dtype",
        "the Gated DeltaNet state dtypes vLLM's Qwen3.5 classes give, computed the same way",
        VLLM,
        "with the entry above",
        "vllm_metal.compat.vllm_models.Qwen3_5Base",
        ("model_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype"),
    ),
    Patch(
        "vllm.multimodal.registry._ProcessorFactories",
        "a wrapper's processor factories (vLLM's register_processor sets the same attribute)",
        VLLM,
        "with the entry above",
        "vllm_metal.compat.vllm_models._Qwen3_5Wrapper",
        ("info", "processor", "dummy_inputs"),
    ),
    # Qwen3-ASR as vLLM sees it (`compat.qwen3_asr`): its processor overrides these hooks of
    # vLLM's multimodal processor, and the class answers vLLM's transcription interface.
    *(
        Patch(
            f"vllm.multimodal.processing.BaseMultiModalProcessor.{name}",
            "Qwen3-ASR's processor, as vLLM's own qwen3_asr module (which needs torchvision) has it",
            VLLM,
            "when vLLM's qwen3_asr module imports on every host vLLM supports",
            "vllm_metal.compat.qwen3_asr._Processor",
            params,
        )
        for name, params in (
            ("_call_hf_processor", ("self", "hf_data", "hf_kwargs")),
            ("_get_hf_mm_text", ("self", "mm_counts")),
            (
                "_get_prompt_updates",
                ("self", "mm_items", "hf_processor_mm_kwargs", "out_mm_kwargs"),
            ),
        )
    ),
    Patch(
        "vllm.model_executor.models.interfaces.SupportsTranscription.get_generation_prompt",
        "Qwen3-ASR's transcription prompt, from the request's parameters",
        VLLM,
        "with the entries above",
        "vllm_metal.compat.qwen3_asr.Qwen3ASRForConditionalGeneration",
        ("stt_params",),
    ),
    Patch(
        "vllm.model_executor.layers.quantization.mxfp4.GptOssMxfp4Config.get_supported_act_dtypes",
        "GPT-OSS MXFP4 checkpoints are read by the MLX loader in any platform dtype",
        VLLM,
        "when vLLM asks the platform which dtypes a checkpoint format takes",
        "vllm_metal.compat.vllm_quantization.accept_act_dtypes",
        (),
    ),
    *(
        Patch(
            f"torch.accelerator.{name}",
            "vLLM's teardown and V1 runner call it; torch raises without an accelerator",
            TORCH,
            "when vLLM checks torch.accelerator.is_available() first",
            "vllm_metal.compat.torch_accelerator.tolerate_missing_accelerator",
            (),
        )
        for name in ("empty_cache", "synchronize")
    ),
    Patch(
        "vllm.v1.engine.utils.get_engine_process_shutdown_timeout",
        "with --shutdown-timeout 0 the engine core gets a teardown window before a kill (as ROCm)",
        VLLM,
        "when vLLM gives every platform a teardown window after an immediate abort",
        "vllm_metal.compat.engine_shutdown.install",
        ("request_timeout", "process_timeout"),
    ),
    Patch(
        "vllm.entrypoints.launchers.utils.server_utils.freeze_gc_heap",
        "the API server freezes the GC heap for good; unfrozen at exit so extensions free theirs",
        VLLM,
        "when vLLM's API server unfreezes the heap at shutdown",
        "vllm_metal.compat.engine_shutdown.install",
        (),
    ),
    Patch(
        "vllm.envs.environment_variables",
        "declares every VLLM_METAL_* variable so vLLM does not warn about them",
        VLLM,
        "when vLLM lets plugins declare their variables",
        "vllm_metal.envs.register_with_vllm",
    ),
    Patch(
        "vllm.triton_utils.dispatcher._registry",
        "read to register the torch rejection-sampler kernels once per process",
        VLLM,
        "when the dispatcher tells whether a kernel is registered",
        "vllm_metal.backends.mlx.runner.spec_decode.kernels",
    ),
    # Layers vLLM builds as ours (`register_oot`, vLLM's own mechanism), whose overrides rely on
    # the internals below.
    Patch(
        "vllm.model_executor.layers.mamba.short_conv.ShortConv.forward",
        "MetalShortConv replaces it: vLLM's runs Triton/CUDA kernels on an out-of-tree platform",
        VLLM,
        "when vLLM's ShortConv has a path for platforms without Triton",
        "vllm_metal.backends.torch.short_conv.register",
        ("self", "hidden_states", "output"),
    ),
    Patch(
        "vllm.model_executor.layers.rotary_embedding.RotaryEmbedding.forward_native",
        "MetalRotaryEmbedding.forward_oot takes its arguments, rotating in place",
        VLLM,
        "when vLLM's rotary embedding has a CPU-kernel path for out-of-tree platforms",
        "vllm_metal.backends.torch.rotary.register",
        ("self", "positions", "query", "key"),
    ),
    Patch(
        "vllm.model_executor.layers.rotary_embedding.RotaryEmbedding._match_cos_sin_cache_dtype",
        "read by MetalRotaryEmbedding.forward_oot (a private helper)",
        VLLM,
        "with the entry above",
        "vllm_metal.backends.torch.rotary.register",
        ("self", "query"),
    ),
    Patch(
        "mlx_lm.models.base.scaled_dot_product_attention",
        "each architecture module's copy is wrapped: a paged cache runs the paged ops",
        MLX_LM,
        "when mlx-lm takes an attention backend per cache",
        "vllm_metal.compat.mlx_lm_attention.route_module_sdpa",
        ("queries", "keys", "values", "cache", "scale", "mask", "sinks"),
    ),
    # The patched `__call__` passes (x, mask, cache) on by position.
    *(
        Patch(
            f"mlx_lm.models.{target}.__call__",
            _ATTENTION_CLASS,
            MLX_LM,
            "when mlx-lm takes an attention backend per cache",
            "vllm_metal.compat.mlx_lm_attention.patch_attention_class",
            ("self", first, "mask", "cache"),
        )
        for target, first in (
            ("gemma2.Attention", "x"),
            ("deepseek_v3.DeepseekV3Attention", "x"),
            ("glm4_moe_lite.Glm4MoeLiteAttention", "x"),
            ("qwen3_next.Qwen3NextGatedDeltaNet", "inputs"),
            ("granitemoehybrid.GraniteMoeHybridMamba2Mixer", "hidden_states"),
        )
    ),
)


def resolve(target: str) -> object:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = target.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def problems(patch: Patch) -> list[str]:
    """What no longer holds of `patch`'s target: it is gone, or its parameters changed."""
    try:
        obj = resolve(patch.target)
    except (ImportError, AttributeError) as exc:
        return [f"{patch.target}: not found ({exc})"]
    if patch.params is None:
        return []
    obj = getattr(obj, "__wrapped__", obj)
    try:
        found = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as exc:
        return [f"{patch.target}: no signature ({exc})"]
    if found != patch.params:
        return [f"{patch.target}: parameters {found}, written against {patch.params}"]
    return []
