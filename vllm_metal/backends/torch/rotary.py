"""vLLM's rotary embedding layer on the torch backend: query and key rotated in place by the fused
`rotary_embedding` op instead of vLLM's torch-native gather, split, multiply and concatenate (the
op's C++ kernel, csrc/ops/rope/, on `cpu`; its plain-torch body, torch_ops.py, on `mps`).

vLLM builds its plain `RotaryEmbedding` (the default RoPE of Llama, Qwen, Gemma, OLMo ...) through
`CustomOp`; registering `MetalRotaryEmbedding` out of tree makes vLLM instantiate it instead, and
an out-of-tree platform runs `forward_oot`. Scaled variants (YaRN, Llama 3, dynamic NTK) are
vLLM subclasses with their own names: they keep vLLM's torch-native forward.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from vllm_metal.backends.torch import kernels


class MetalRotaryEmbedding(RotaryEmbedding):
    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        tokens = positions.numel()
        kernels.rotary_embedding(
            positions.reshape(-1),
            query.view(tokens, -1, self.head_size),
            None if key is None else key.view(tokens, -1, self.head_size),
            cos_sin_cache,
            self.is_neox_style,
        )
        return query, key


def register() -> None:
    """Make vLLM build `MetalRotaryEmbedding` for `RotaryEmbedding` in this process (once)."""
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get(RotaryEmbedding.__name__) is not MetalRotaryEmbedding:
        RotaryEmbedding.register_oot(MetalRotaryEmbedding)
