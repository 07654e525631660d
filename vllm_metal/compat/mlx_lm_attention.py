"""Patches of mlx-lm's attention: an architecture's attention runs the paged ops when its cache is
a paged view.

Most mlx-lm architectures call their module's `scaled_dot_product_attention(q, k, v, cache=...)`
after `cache.update_and_fetch`; wrapping that one function per module is enough. Attention sinks
passed to it (`sinks=`, GPT-OSS) go to the paged op too. Only calls that carry a
`PagedLayerCache` change, so plain mlx-lm use in the same process is unaffected.
Families that compute attention by hand patch their attention class instead
(`patch_attention_class`, called from `models/families/`).
"""

from __future__ import annotations

import sys
from functools import wraps
from typing import Any

from vllm_metal.kv.paged_cache import PagedLayerCache

_MARK = "__vllm_metal_paged__"


def _paged_sdpa(original: Any):
    @wraps(original)
    def scaled_dot_product_attention(
        queries, keys, values, cache, scale, mask=None, sinks=None, **kwargs
    ):
        if isinstance(cache, PagedLayerCache):
            return cache.attend(queries, scale, sinks)
        return original(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kwargs
        )

    setattr(scaled_dot_product_attention, _MARK, True)
    return scaled_dot_product_attention


def route_module_sdpa(model: Any) -> None:
    """Wrap the `scaled_dot_product_attention` of the module that defines `model`'s class."""
    module = sys.modules[type(model).__module__]
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is None:
        raise ValueError(
            f"{module.__name__}: this mlx-lm architecture computes attention without "
            "scaled_dot_product_attention and is not supported by vllm-metal yet"
        )
    if not getattr(current, _MARK, False):
        module.scaled_dot_product_attention = _paged_sdpa(current)


def patch_attention_class(
    attention_cls: type, paged_call: Any, cache_cls: type = PagedLayerCache
) -> None:
    """Make `attention_cls(x, mask, cache)` run `paged_call` when `cache` is a paged view (a
    `cache_cls`: `PagedLayerCache`, or `kv.latent.LatentLayerCache` for MLA)."""
    if getattr(attention_cls, _MARK, False):
        return
    original = attention_cls.__call__

    @wraps(original)
    def __call__(self, x, mask=None, cache=None, **kwargs):
        if isinstance(cache, cache_cls):
            return paged_call(self, x, cache)
        return original(self, x, mask, cache, **kwargs)

    attention_cls.__call__ = __call__
    setattr(attention_cls, _MARK, True)
