"""Load a vision-language checkpoint (Hugging Face layout or mlx-vlm's converted one) into
mlx-vlm's model classes.

mlx-vlm reads the checkpoint's config.json itself, sanitizes the tensor names and applies MLX
quantization where the checkpoint is quantized; this module resolves the directory, puts the
floating weights in the compute dtype and corrects the one config key mlx-vlm misreads: a
checkpoint saved by transformers 5 keeps the language model's RoPE base only inside
`text_config.rope_parameters`, where mlx-vlm does not look (it would silently use its default).
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
from mlx import nn

from vllm_metal._logging import init_logger
from vllm_metal.models.loaders import parameter_bytes
from vllm_metal.models.loaders.safetensors import resolve_model_path

logger = init_logger(__name__)

# The mlx-vlm release whose classes this module loads. install.sh and the Homebrew formula install
# it without its declared dependencies (`python -m vllm_metal.models.loaders.mlx_vlm --requirement`
# prints it); one of them, opencv-python, clashes with vLLM's opencv-python-headless.
REQUIREMENT = "mlx-vlm==0.7.10"


def load(
    model: str,
    compute_dtype: mx.Dtype,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-vlm model of the checkpoint (evaluated, in eval mode) and its config dict."""
    try:
        from mlx_vlm.utils import load_model
    except ImportError as e:
        raise ValueError(
            f"model={model!r} is a vision-language model, which needs {REQUIREMENT}: "
            f"pip install --no-deps {REQUIREMENT!r} ({e})"
        ) from e

    path = resolve_model_path(model, revision, download_dir)
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"model={model!r}: no .safetensors weights in {path}")
    config = json.loads((path / "config.json").read_text())
    mlx_model = load_model(path, lazy=True)
    _use_rope_base(mlx_model, config.get("text_config") or {})
    mlx_model.set_dtype(compute_dtype)
    mx.eval(mlx_model.parameters())
    mlx_model.eval()
    logger.info(
        "Loaded %s (mlx-vlm) from %s in %s: %.1f MiB of weights",
        config.get("model_type"),
        path,
        compute_dtype,
        parameter_bytes(mlx_model) / 2**20,
    )
    return mlx_model, config


def _use_rope_base(model: nn.Module, text_config: dict[str, Any]) -> None:
    """Give the language model's rotary layers the base stated only in `rope_parameters`."""
    rope = text_config.get("rope_parameters")
    if "rope_theta" in text_config or not isinstance(rope, dict) or "rope_theta" not in rope:
        return
    base = float(rope["rope_theta"])
    for layer in model.language_model.layers:
        attn = getattr(layer, "self_attn", None)
        current = getattr(attn, "rope", None)
        if type(current) is not nn.RoPE:
            raise ValueError(
                f"{text_config.get('model_type')}: the RoPE base is given only in "
                "text_config.rope_parameters, which this model's mlx-vlm class does not read; "
                "add text_config.rope_theta to config.json"
            )
        if current.base != base:
            attn.rope = nn.RoPE(
                current.dims, traditional=current.traditional, base=base, scale=current.scale
            )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--requirement"]:
        sys.exit("usage: python -m vllm_metal.models.loaders.mlx_vlm --requirement")
    print(REQUIREMENT)
