"""Gemma 2: mlx-lm computes its soft-capped attention by hand, so the paged path replaces the
attention module's call when it is given a PagedLayerCache."""

from __future__ import annotations

from types import ModuleType

from vllm_metal.runner.paged import PagedLayerCache


def install(module: ModuleType) -> None:
    attention_cls = module.Attention
    if getattr(attention_cls, "__vllm_metal_paged__", False):
        return
    original = attention_cls.__call__

    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, PagedLayerCache):
            return original(self, x, mask, cache)
        b, length, _ = x.shape
        queries = self.q_proj(x).reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        cache.update_and_fetch(keys, values)
        out = cache.attend(queries, self.scale, None, softcap=self.attn_logit_softcapping)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    attention_cls.__call__ = __call__
    attention_cls.__vllm_metal_paged__ = True
