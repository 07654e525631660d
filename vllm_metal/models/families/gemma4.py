"""Gemma 4 text (`Gemma4ForCausalLM`, and the language model of `Gemma4ForConditionalGeneration`):
what sets it apart from Gemma 3 for the runner, all in mlx-lm 0.32.2's `gemma4_text` classes,
whose layers run here on the paged pool.

- Sliding layers and full-attention layers have their own KV heads and head size (the full ones
  `global_head_dim`, 512 as published, and `num_global_key_value_heads` where their values are
  their keys, `attention_k_eq_v`): each layer reports its shape (`LayerKind.num_kv_heads /
  head_dim`), vLLM puts the two kinds in their own KV-cache groups and unifies their page sizes by
  giving the narrower rows more tokens per block, and each layer reads its pages in its shape.
- The last `num_kv_shared_layers` layers (E2B, E4B) compute no keys or values: each attends over
  the K/V of the last earlier layer of its kind (`LayerKind.kv_source`), whose pages it reads.
- E2B / E4B add a per-layer input to every layer: a per-layer embedding of the token
  (`embed_tokens_per_layer`) mixed with a projection of the scaled input embedding, which needs the
  step's token ids (`takes_token_ids`).
- Queries and keys are RMS-normed per head (attention scale 1), values normed without a scale;
  the full layers rotate a quarter of each head ("proportional" RoPE); logits are softcapped.
mlx-lm's decoder builds masks and passes K/V between layers by position in a list, so its
`__call__` is replaced by `forward` below; its decoder layers run as they are.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.gemma4_text import Attention

from vllm_metal.compat import mlx_lm_attention as attention
from vllm_metal.kv.paged_cache import PagedLayerCache
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.layers import LayerKind

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("gemma4_text",)
KIND = "text"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    takes_token_ids = True

    def layer_kinds(self) -> list[LayerKind]:
        window = int(self.decoder.window_size)
        kinds = []
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            kinds.append(
                LayerKind(
                    sliding_window=window if attn.is_sliding else None,
                    num_kv_heads=attn.n_kv_heads,
                    head_dim=attn.head_dim,
                    kv_source=None if attn.has_kv else self.decoder.previous_kvs[i],
                )
            )
        return kinds

    def install_paged_attention(self) -> None:
        attention.patch_attention_class(Attention, _paged_attention)

    def embed(self, token_ids: mx.array) -> mx.array:
        # Scaled here, not in the decoder, so that media rows merged later are not.
        embeds = self.decoder.embed_tokens(token_ids)
        return embeds * mx.array(self.decoder.embed_scale, dtype=embeds.dtype)

    def forward(
        self, input_embeds: mx.array, caches: list[Any], token_ids: mx.array | None = None
    ) -> mx.array:
        """Gemma4TextModel.__call__ over packed rows: `input_embeds` already scaled (`embed`),
        `token_ids` ([T, 1]) for the per-layer inputs."""
        decoder = self.decoder
        per_layer: list[mx.array | None] = [None] * len(decoder.layers)
        if decoder.hidden_size_per_layer_input:
            if token_ids is None:
                raise ValueError(f"{self.model_type}: per-layer inputs need the token ids")
            inputs = decoder._project_per_layer_inputs(
                input_embeds, decoder._get_per_layer_inputs(token_ids)
            )
            per_layer = [inputs[:, :, i, :] for i in range(len(decoder.layers))]
        h = input_embeds
        for layer, cache, layer_input in zip(decoder.layers, caches, per_layer):
            h, _, _ = layer(h, None, cache, per_layer_input=layer_input)
        return decoder.norm(h)


def _paged_attention(self: Attention, x: mx.array, cache: PagedLayerCache) -> tuple:
    """`Attention.__call__` over packed rows (`[T, 1, hidden]`) on the paged pool; a layer
    without K/V of its own (`has_kv`) attends over its source layer's pages, which its cache
    reads. Returns what mlx-lm's decoder layer unpacks (the shared K/V and offset it passes on
    are not used here)."""
    t = x.shape[0]
    queries = self.q_norm(self.q_proj(x).reshape(t, 1, self.n_heads, self.head_dim))
    queries = self.rope(queries.transpose(0, 2, 1, 3), offset=cache.offset)
    if self.has_kv:
        keys = self.k_proj(x).reshape(t, 1, self.n_kv_heads, self.head_dim)
        values = keys if self.use_k_eq_v else self.v_proj(x).reshape(keys.shape)
        keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=cache.offset)
        cache.update_and_fetch(keys, self.v_norm(values).transpose(0, 2, 1, 3))
    out = cache.attend(queries, self.scale, None)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(t, 1, -1)), None, None
