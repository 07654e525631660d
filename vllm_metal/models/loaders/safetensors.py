"""Load a safetensors checkpoint (local directory or Hugging Face id) into an mlx-lm model.

vLLM has already parsed the config; this module fetches the weights when needed and builds the
mlx-lm model class for the architecture, with its floating weights in the compute dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from vllm_metal._logging import init_logger
from vllm_metal.models import hf_config
from vllm_metal.models.adapter import LayerRange, keep_layers
from vllm_metal.models.loaders import parameter_bytes

logger = init_logger(__name__)

_WEIGHT_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.py",
]


def resolve_model_path(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """A local checkpoint directory for `model`: the path itself, or a Hugging Face snapshot."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    # huggingface_hub shows its own progress bars and honours HF_HUB_OFFLINE / HF_TOKEN.
    path = snapshot_download(
        repo_id=model,
        revision=revision,
        cache_dir=download_dir,
        allow_patterns=_WEIGHT_PATTERNS,
    )
    return Path(path)


def tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of `directory` holding it (from the index where the
    checkpoint has one, else from each file's header), without reading any tensor."""
    import json

    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            files |= dict.fromkeys(f.keys(), path)
    return files


def load(
    model: str,
    compute_dtype: mx.Dtype,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
    dequantize: bool = False,
    lm_head: bool = True,
    layers: LayerRange | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model of the checkpoint (evaluated, in eval mode) and its config dict.

    With `dequantize`, MLX-quantized layers become dense layers in `compute_dtype` when that fits
    in half of the memory free now (see `_dequantize`). Without `lm_head` (pooling models) the
    model is built without its language-model head, and the checkpoint's head tensors
    (`lm_head.*`, a classifier's `score.*`) are left to the pooling heads that read them.
    With `layers` (a pipeline stage) only those decoder layers' weights are read.
    """
    from mlx_lm.utils import _get_classes, load_model

    from vllm_metal.models.families import family_classes

    # Model types and checkpoint layouts mlx-lm does not read as they are (Qwen3.5's text-only
    # model types, GPT-OSS dense experts): families.MLX_LM_MODULES and SANITIZERS.
    classes = family_classes(_get_classes)

    path = resolve_model_path(model, revision, download_dir)
    if not list(path.glob("*.safetensors")):
        raise ValueError(
            f"model={model!r}: no .safetensors weights in {path}; vllm-metal loads safetensors "
            "checkpoints (convert others with mlx_lm.convert)"
        )
    mlx_model, config = load_model(
        path,
        lazy=True,
        # transformers 5's names of keys mlx-lm reads (`rope_theta`, `num_experts`): hf_config.
        model_config=hf_config.checkpoint_overrides(path),
        trust_remote_code=trust_remote_code,
        get_model_classes=classes if lm_head else _headless(classes),
    )
    if layers is not None:
        keep_layers(mlx_model, layers)
    # Quantized checkpoints keep their packed integer weights; set_dtype only touches floats.
    mlx_model.set_dtype(compute_dtype)
    if dequantize:
        _dequantize(mlx_model, compute_dtype)
    mx.eval(mlx_model.parameters())
    mlx_model.eval()
    logger.info(
        "Loaded %s (%s) from %s in %s: %.1f MiB of weights",
        config.get("model_type"),
        type(mlx_model).__module__.rsplit(".", 1)[-1],
        path,
        compute_dtype,
        parameter_bytes(mlx_model) / 2**20,
    )
    return mlx_model, config


# Checkpoint tensors that only heads read: the LM head, and a sequence classifier's `score`.
HEAD_PREFIXES = ("lm_head.", "score.")


def _headless(get_classes):
    """mlx-lm's class lookup, returning a subclass built without `lm_head` that sets the head
    tensors aside, so the decoder still loads strictly (every other tensor must match)."""

    def get(config: dict) -> tuple[type, type]:
        model_class, args_class = get_classes(config)

        class Headless(model_class):
            def __init__(self, args):
                super().__init__(args)
                if "lm_head" in self:
                    del self["lm_head"]

            def sanitize(self, weights):
                weights = {k: v for k, v in weights.items() if not k.startswith(HEAD_PREFIXES)}
                return super().sanitize(weights) if hasattr(super(), "sanitize") else weights

        Headless.__name__ = Headless.__qualname__ = model_class.__name__
        Headless.__module__ = model_class.__module__
        return Headless, args_class

    return get


def _dequantize(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace quantized layers by dense ones (mlx-lm's own `dequantize_model`).

    On MLX's CPU device a quantized matmul runs MLX's own loops, about 10x slower than the dense
    BLAS matmul at batch 32, so a quantized checkpoint is served dense there when its dense
    weights take at most half of the free memory; otherwise it stays quantized (and slower).
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import dequantize_model

    from vllm_metal.host import available_memory_bytes

    # QuantizedSwitchLinear: a mixture of experts' stacked expert weights ([experts, out, in]).
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    quantized = [m for _, m in model.named_modules() if isinstance(m, kinds)]
    if not quantized:
        return
    dense_elements = sum(m.weight.size * 32 // m.bits for m in quantized)
    others = sum(v.size for _, v in tree_flatten(model.parameters()))
    dense_bytes = (dense_elements + others) * dtype.size
    free = available_memory_bytes()
    if dense_bytes > free // 2:
        logger.info(
            "Keeping %d quantized layers quantized: dense they would take %.1f GiB of %.1f GiB free",
            len(quantized),
            dense_bytes / 2**30,
            free / 2**30,
        )
        return
    dequantize_model(model)
    logger.info(
        "Dequantized %d layers to %s for the CPU's BLAS (%.1f MiB dense)",
        len(quantized),
        dtype,
        dense_bytes / 2**20,
    )
