"""KV and state memory of the MLX backend, keyed by vLLM's KV-cache specs.

`spec.py` turns a model's layer kinds into vLLM `KVCacheSpec`s; `pool.py` allocates the paged
K/V arrays vLLM's `KVCacheConfig` describes (one pair per memory region, shared by the cache
groups that alias it); `paged_cache.py` is what one attention layer sees as its cache during a
step. State slots for recurrent layers (Mamba/GDN) and offload tiers (host pool, disk) belong
here as their own modules.
"""

# vLLM's name for the page layout both backends declare (`KVCacheLayout`): layer-compact, each
# block one contiguous page holding its tokens' heads. The MLX pool keeps K and V in separate
# arrays of `[blocks, tokens, heads, head_dim]`; the torch backend views each page as K rows then
# V rows of that shape. The engine resolves one layout from what workers and backends declare.
KV_CACHE_LAYOUT = "LBNHC"
