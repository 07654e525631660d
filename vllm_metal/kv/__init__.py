"""KV and state memory of the MLX backend, keyed by vLLM's KV-cache specs.

`spec.py` turns a model's layer kinds into vLLM `KVCacheSpec`s; `pool.py` allocates the paged
K/V arrays vLLM's `KVCacheConfig` describes (one pair per memory region, shared by the cache
groups that alias it); `paged_cache.py` is what one attention layer sees as its cache during a
step. State slots for recurrent layers (Mamba/GDN) and offload tiers (host pool, disk) belong
here as their own modules.
"""
