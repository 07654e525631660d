"""Reading a Hugging Face PEFT LoRA adapter for the MLX runner.

vLLM's own helpers resolve the path (`get_adapter_absolute_path`), read and validate
`adapter_config.json` (`PEFTHelper`: rank limit, DoRA, biases and other features vLLM does not
implement), parse tensor names and compute each module's scaling (`alpha / r`, rsLoRA's
`alpha / sqrt(r)`, `rank_pattern` / `alpha_pattern`). What is checked here is what depends on the
served model: every module the adapter changes must be one of the linear projections the runner
wrapped, with the shapes of that projection.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.request import LoRARequest

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Modules whose deltas the runner does not apply: the input embeddings and the output head.
UNSUPPORTED_MODULES = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")


class AdapterError(ValueError):
    """An adapter this model cannot serve (the message names the adapter and the cause)."""


@dataclass(frozen=True)
class ModuleDelta:
    """One projection's update `x @ a @ b`, the scaling folded into `b`."""

    a: np.ndarray  # [in, r] float32
    b: np.ndarray  # [r, out] float32


@dataclass(frozen=True)
class Adapter:
    lora_id: int
    name: str
    path: str
    deltas: dict[str, ModuleDelta]  # module path in the MLX model -> its update

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.deltas.values())


def read_adapter(
    request: LoRARequest,
    lora_config: LoRAConfig,
    shapes: dict[str, tuple[int, int]],
    *,
    max_position_embeddings: int | None = None,
) -> Adapter:
    """Read `request`'s adapter for a model whose wrapped projections have `shapes`
    (module path -> (in_features, out_features)).

    Raises vLLM's `LoRAAdapterNotFoundError` for a missing adapter (the server answers 404) and
    `AdapterError` for one this model cannot serve.
    """
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import get_adapter_absolute_path

    name = request.lora_name
    path = get_adapter_absolute_path(request.lora_path)
    weights_file = next(
        (os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))),
        None,
    )
    if not os.path.isfile(os.path.join(path, "adapter_config.json")) or weights_file is None:
        raise LoRAAdapterNotFoundError(name, request.lora_path)
    try:
        peft = PEFTHelper.from_local_dir(path, max_position_embeddings)
        peft.validate_legal(lora_config)
    except ValueError as e:
        raise AdapterError(f"LoRA adapter {name!r}: {e}") from e
    _refuse_unsupported_targets(name, peft)

    pairs = _read_pairs(name, weights_file)
    deltas = {}
    for module, (a, b) in sorted(pairs.items()):
        if module not in shapes:
            raise AdapterError(
                f"LoRA adapter {name!r}: module {module!r} is not a linear projection of this "
                f"model (is the adapter for another architecture?)"
            )
        in_features, out_features = shapes[module]
        rank, scaling = peft.get_rank_and_scaling(module)
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterError(
                f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, but the model's projection is "
                f"{in_features} -> {out_features} with rank {rank} "
                f"(is the adapter for another model?)"
            )
        deltas[module] = ModuleDelta(
            a=np.ascontiguousarray(a.T, dtype=np.float32),
            b=np.ascontiguousarray(b.T * np.float32(scaling), dtype=np.float32),
        )
    if not deltas:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return Adapter(request.lora_int_id, name, path, deltas)


def _refuse_unsupported_targets(name: str, peft) -> None:
    targets = peft.target_modules
    targets = [targets] if isinstance(targets, str) else list(targets or ())
    for module in [*targets, *(peft.modules_to_save or ())]:
        if module.split(".")[-1] in UNSUPPORTED_MODULES or module in ("score", "classifier"):
            raise AdapterError(
                f"LoRA adapter {name!r}: module {module!r} (embeddings, output head or "
                "modules_to_save) is not supported; adapters may change the linear projections "
                "of attention and MLP layers"
            )


def _read_pairs(name: str, weights_file: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module path -> (lora_A [r, in], lora_B [out, r]) as float32 numpy."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    tensors = _load_tensors(weights_file)
    halves: dict[str, dict[bool, np.ndarray]] = {}
    for key, value in tensors.items():
        try:
            module, is_a = parse_fine_tuned_lora_name(key)
        except ValueError as e:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not supported") from e
        if "lora_embedding" in key or module.split(".")[-1] in UNSUPPORTED_MODULES:
            raise AdapterError(
                f"LoRA adapter {name!r}: tensor {key!r} changes the embeddings or the output "
                "head, which is not supported"
            )
        halves.setdefault(module, {})[is_a] = value
    pairs = {}
    for module, half in halves.items():
        if set(half) != {True, False}:
            raise AdapterError(
                f"LoRA adapter {name!r}: module {module!r} lacks its "
                f"{'lora_B' if True in half else 'lora_A'} weight"
            )
        pairs[module] = (half[True], half[False])
    return pairs


def _load_tensors(weights_file: str) -> dict[str, np.ndarray]:
    import torch

    if weights_file.endswith(".safetensors"):
        from safetensors.torch import load_file

        raw = load_file(weights_file)
    else:
        raw = torch.load(weights_file, map_location="cpu", weights_only=True)
    return {k: v.to(torch.float32).numpy() for k, v in raw.items()}
