"""Gemma 2: mlx-lm computes its soft-capped attention by hand, ignores the sliding window of
alternate layers and takes no input embeddings. Mirrors mlx-lm 0.32.2 (`models/gemma2.py`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vllm_metal.compat import mlx_lm_attention as attention
from vllm_metal.kv.paged_cache import PagedLayerCache
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.layers import LayerKind, kinds_from_config

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("gemma2",)
KIND = "text"
MODALITIES: tuple[str, ...] = ()


def _paged_attention_call(self: Any, x: mx.array, cache: PagedLayerCache) -> mx.array:
    b, length, _ = x.shape
    queries = self.q_proj(x).reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = self.k_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = self.v_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    cache.update_and_fetch(keys, values)
    out = cache.attend(queries, self.scale, None, softcap=self.attn_logit_softcapping)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


class Adapter(ModelAdapter):
    def layer_kinds(self) -> list[LayerKind]:
        return kinds_from_config(self.config, self.num_layers)

    def install_paged_attention(self) -> None:
        module = type(self.model.layers[0].self_attn)
        attention.patch_attention_class(module, _paged_attention_call)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        # GemmaModel.__call__, which scales the embeddings first.
        return self.decode_layers(input_embeds * (self.decoder.args.hidden_size**0.5), caches)
