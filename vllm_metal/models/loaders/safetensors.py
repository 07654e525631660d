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


def load(
    model: str,
    compute_dtype: mx.Dtype,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model of the checkpoint (evaluated, in eval mode) and its config dict."""
    from mlx_lm.utils import load_model

    path = resolve_model_path(model, revision, download_dir)
    if not list(path.glob("*.safetensors")):
        raise ValueError(
            f"model={model!r}: no .safetensors weights in {path}; vllm-metal loads safetensors "
            "checkpoints (convert others with mlx_lm.convert)"
        )
    mlx_model, config = load_model(path, lazy=True, trust_remote_code=trust_remote_code)
    # Quantized checkpoints keep their packed integer weights; set_dtype only touches floats.
    mlx_model.set_dtype(compute_dtype)
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
