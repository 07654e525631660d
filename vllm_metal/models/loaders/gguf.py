"""Load a GGUF file (llama.cpp's format) into an mlx-lm model.

The model is built from the Hugging Face config (vLLM's, which `compat.vllm_config` reads from the
file's metadata through transformers, or `--hf-config-path`). Tensors are read with the `gguf`
package and named with its tensor-name maps; transformers' GGUF tensor processors undo llama.cpp's
conversions (the rotary q/k row permutation of Llama-family files, Gemma's `1 + weight` norms).
Q8_0, Q4_0 and Q4_1 are affine with groups of 32, which is MLX's quantization, so they become
`QuantizedLinear` / `QuantizedEmbedding` layers holding the same numbers; K-quants and float
tensors are decoded with `gguf.quants.dequantize` into the compute dtype.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from vllm_metal._logging import init_logger
from vllm_metal.models.loaders import parameter_bytes

logger = init_logger(__name__)

# GGUF `general.architecture` values served (llama.cpp writes Mistral as "llama").
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
# GGML types that are MLX's affine quantization with group 32: bits per value.
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
DEQUANTIZED = ("Q4_K", "Q5_K", "Q6_K")
FLOATS = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOATS + tuple(EXACT_BITS) + DEQUANTIZED
GROUP_SIZE = 32


class GGUFError(ValueError):
    """A GGUF file this loader cannot serve; the message names the file and the tensor or type."""


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def open_reader(path: Path) -> Any:
    """`gguf.GGUFReader` over the file, or a GGUFError saying what is wrong with it."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises whatever numpy or struct raise
        raise GGUFError(f"{path}: not a readable GGUF file: {_diagnose(path) or exc}") from exc


def _diagnose(path: Path) -> str | None:
    """The first tensor whose data lies past the end of the file, when the header parses."""
    try:
        from transformers.integrations.gguf.reader import GgufHeader

        header = GgufHeader.from_file(str(path))
    except Exception:  # noqa: BLE001 - no better diagnosis than the reader's own error
        return None
    size = path.stat().st_size
    for info in header.tensors:
        end = header.data_start + info.offset + info.nbytes
        if end > size:
            return (
                f"tensor {info.name!r} ends at byte {end} but the file has {size} bytes "
                "(truncated?)"
            )
    return None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: Any, path: Path) -> str:
    """The file's `general.architecture`, if this loader serves it and the file is whole."""
    if (splits := _field(reader, "split.count", 1)) > 1:
        raise GGUFError(
            f"{path}: one of {splits} split GGUF files; merge them first "
            "(llama.cpp's `llama-gguf-split --merge`) and serve the merged file"
        )
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported; vllm-metal loads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3)"
        )
    return arch


def read_config(path: str | Path) -> dict[str, Any]:
    """The Hugging Face config of the GGUF file, as transformers reads it from the metadata
    (`PretrainedConfig.get_config_dict(dir, gguf_file=name)`), with what that leaves out:

    - `architectures`: the causal-LM class of the model type (the file names none);
    - `dtype`: the file's half type for float files, float16 for quantized ones (the type of
      their block scales; bfloat16 for Gemma);
    - bos/eos/pad ids from the tokenizer metadata (not the config class's defaults);
    - Qwen3's `head_dim` from `attention.key_length` (transformers keeps the class default);
    - Mistral's sliding window and Gemma 2's soft-capping values as the file states them.

    Gemma's metadata lacks settings transformers then takes from its defaults: a warning says so.
    """
    from transformers import PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path).expanduser()
    reader = open_reader(path)
    arch = architecture(reader, path)
    config, _ = PretrainedConfig.get_config_dict(str(path.parent), gguf_file=path.name)
    model_type = config["model_type"]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GGUFError(f"{path}: no causal-LM class for model_type {model_type!r}")
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    types = {t.tensor_type.name for t in reader.tensors}
    if types <= set(FLOATS):
        config["dtype"] = (
            "bfloat16" if "BF16" in types else "float16" if "F16" in types else "float32"
        )
    else:  # Gemma's activations overflow float16 (vLLM refuses it for Gemma 3)
        config["dtype"] = "bfloat16" if arch.startswith("gemma") else "float16"
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        config[f"{name}_token_id"] = _field(reader, f"tokenizer.ggml.{key}_token_id")
    if arch == "qwen3" and (head_dim := _field(reader, "qwen3.attention.key_length")):
        config["head_dim"] = int(head_dim)
    if model_type == "mistral":
        # The file states a window when it has one; transformers would apply MistralConfig's
        # default (4096) to every Mistral file, llama.cpp none.
        config["sliding_window"] = _field(reader, "llama.attention.sliding_window")
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (value := _field(reader, f"gemma2.{key}")) is not None:
                config[key] = float(value)
    if arch in _INCOMPLETE_METADATA:
        logger.warning(
            "%s: %s; its config takes transformers' defaults for them. Pass --hf-config-path "
            "with the original model for its own values.",
            path,
            _INCOMPLETE_METADATA[arch],
        )
    return config


# What llama.cpp's metadata of an architecture does not state (its converter derives or drops it).
_INCOMPLETE_METADATA = {
    "gemma2": "Gemma 2 GGUF metadata has no query_pre_attn_scalar or sliding-window pattern",
    "gemma3": "Gemma 3 GGUF metadata has no query_pre_attn_scalar, sliding-window pattern or "
    "local RoPE base",
}


# --------------------------------------------------------------------------------------------------
# Exact mapping onto MLX's affine quantization
# --------------------------------------------------------------------------------------------------


def to_mlx_affine(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks [rows, row_bytes] of Q4_0 / Q4_1 / Q8_0 -> MLX affine (group 32) weights:
    packed uint32 [rows, cols * bits / 32], scales and biases float32 [rows, cols / 32].

    MLX's value is `scale * q + bias` with unsigned q, packed from the lowest bits of each
    little-endian uint32 word up. Q4_0 `d * (q - 8)`: scale d, bias -8d. Q4_1 `d * q + m`: scale d,
    bias m. Q8_0 `d * q` with signed q: q + 128, scale d, bias -128d. The fp16 d and m are held
    exactly by float32 (and float16) scales and biases.
    """
    rows = raw.shape[0]
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, block_bytes)

    def half(lo: int) -> np.ndarray:
        return np.ascontiguousarray(blocks[..., lo : lo + 2]).view("<f2")[..., 0].astype(np.float32)

    d = half(0)
    if type_name == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        packed = q.reshape(rows, -1)
        bias = -128.0 * d
    else:
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        # Block element i is the low nibble of byte i, element i + 16 its high nibble.
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        bias = half(2) if type_name == "Q4_1" else -8.0 * d
    words = np.ascontiguousarray(packed).view("<u4").astype(np.uint32)
    return words, d, bias


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def load(
    model: str | Path,
    compute_dtype: mx.Dtype,
    *,
    config: dict[str, Any] | None = None,
    dequantize: bool = False,
    lm_head: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model of the GGUF file `model` (evaluated, in eval mode) and its config dict.

    `config`: the Hugging Face config to build it from (vLLM's); None reads it from the file
    (`read_config`). Every tensor of the file must have a place in the model and every parameter of
    the model a tensor. With `dequantize`, MLX-quantized layers become dense as in the safetensors
    loader (`safetensors._dequantize`).
    """
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.tensor_mapping import get_tensor_name_map
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from vllm_metal.models.hf_config import mlx_lm_overrides
    from vllm_metal.models.loaders import safetensors

    path = Path(model).expanduser()
    reader = open_reader(path)
    arch = architecture(reader, path)
    config = dict(config if config is not None else read_config(path))

    get_classes = _get_classes if lm_head else safetensors._headless(_get_classes)
    model_class, args_class = get_classes(config)
    config.update(mlx_lm_overrides(config, args_class))  # transformers 5 nests rope_theta
    mlx_model = model_class(args_class.from_dict(config))
    modules = dict(mlx_model.named_modules())
    params = dict(tree_flatten(mlx_model.parameters()))

    # GGUF name -> parameter, through the gguf package's map of HF names (as transformers does).
    import gguf

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    to_param: dict[str, str] = {}
    for param in params:
        base, suffix = param.rsplit(".", 1)
        if (gguf_base := name_map.get_name(base)) is not None:
            to_param[f"{gguf_base}.{suffix}"] = param
    head_names = {"output.weight"} if not lm_head else set()

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    weights: dict[str, mx.array] = {}
    quantized_bits: dict[str, int] = {}
    handled: Counter[tuple[str, str]] = Counter()
    for tensor in reader.tensors:
        name, type_name = tensor.name, tensor.tensor_type.name
        if name in head_names:
            continue
        param = to_param.get(name)
        if param is None:
            raise GGUFError(
                f"{path}: tensor {name!r} has no place in the {config['model_type']} model "
                f"(mlx-lm {type(mlx_model).__module__.rsplit('.', 1)[-1]})"
            )
        if type_name not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{path}: tensor {name!r} has GGML type {type_name}, which is not supported; "
                f"vllm-metal reads {', '.join(SUPPORTED_TYPES)}"
            )
        module_path, leaf = param.rsplit(".", 1)
        module = modules.get(module_path)
        exact = (
            type_name in EXACT_BITS
            and leaf == "weight"
            and isinstance(module, (nn.Linear, nn.Embedding))
            and tensor.data.ndim == 2
        )
        try:
            if exact:
                raw = processor.process(weights=np.asarray(tensor.data), name=name).weights
                words, scales, biases = to_mlx_affine(raw, type_name)
                weights[param] = mx.array(words)
                weights[f"{module_path}.scales"] = mx.array(scales).astype(compute_dtype)
                weights[f"{module_path}.biases"] = mx.array(biases).astype(compute_dtype)
                quantized_bits[module_path] = EXACT_BITS[type_name]
                how = f"MLX {EXACT_BITS[type_name]}-bit affine, group {GROUP_SIZE}"
                if compute_dtype == mx.bfloat16:
                    how += " (fp16 scales rounded to bfloat16)"
            else:
                values = gguf_dequantize(tensor.data, tensor.tensor_type)
                values = processor.process(weights=values, name=name).weights
                weights[param] = mx.array(np.ascontiguousarray(values)).astype(compute_dtype)
                verb = "as" if type_name in FLOATS else "dequantized to"
                how = f"{verb} {_dtype_name(compute_dtype)}"
        except Exception as exc:  # name the tensor, whatever went wrong in it
            raise GGUFError(
                f"{path}: tensor {name!r} ({type_name}) could not be read: {exc}"
            ) from exc
        rows, cols = weights[param].shape[0], weights[param].shape[-1]
        got = (rows, cols * 32 // quantized_bits[module_path]) if exact else weights[param].shape
        expected = params[param].shape
        if tuple(expected) != tuple(got):
            raise GGUFError(
                f"{path}: tensor {name!r} has shape {list(got)} but the model's {param} has "
                f"{list(expected)} (does the config match the file?)"
            )
        handled[(type_name, how)] += 1

    if hasattr(mlx_model, "sanitize"):  # e.g. Gemma 3 ties its head when the file has none
        weights = mlx_model.sanitize(weights)
        params = dict(tree_flatten(mlx_model.parameters()))
    missing = sorted(set(params) - set(weights))
    if missing:
        raise GGUFError(f"{path}: no tensor in the file for {', '.join(missing)}")

    if quantized_bits:
        nn.quantize(
            mlx_model,
            class_predicate=lambda p, _: (
                {"group_size": GROUP_SIZE, "bits": quantized_bits[p], "mode": "affine"}
                if p in quantized_bits
                else False
            ),
        )
    mlx_model.load_weights(list(weights.items()), strict=True)
    for (type_name, how), count in sorted(handled.items()):
        logger.info("%s: %s (%d tensors)", type_name, how, count)
    if dequantize:
        safetensors._dequantize(mlx_model, compute_dtype)
    mx.eval(mlx_model.parameters())
    mlx_model.eval()
    logger.info(
        "Loaded %s (%s) from %s (GGUF %s) in %s: %.1f MiB of weights",
        config.get("model_type"),
        type(mlx_model).__module__.rsplit(".", 1)[-1],
        path,
        arch,
        compute_dtype,
        parameter_bytes(mlx_model) / 2**20,
    )
    return mlx_model, config
