"""KV offload tiers: a host pool and a disk tier behind vLLM's OffloadingConnector.

vLLM's scheduler decides what to store and what to load (`OffloadingConnector`, with its
`CPUOffloadingManager` bookkeeping); this package supplies the parts that touch memory:
- `config.py` turns `--kv-offloading-size` and `VLLM_METAL_SSD_CACHE_DIR` into vLLM's connector
  config at startup, sizing the host pool and refusing settings that cannot work;
- `spec.py` is the `OffloadingSpec` vLLM loads by name, `manager.py` its scheduler-side manager
  (the host LRU plus the disk tier's lookups);
- `transfer.py` copies blocks between the MLX KV pool and the host pool and writes/reads the disk
  tier on a background thread; `disk.py` is the disk tier's file store.
"""

# vLLM's connector that `--kv-offloading-size` turns on.
CONNECTOR = "OffloadingConnector"
# vLLM loads the spec by these names (`kv_connector_extra_config`).
SPEC_NAME = "MetalOffloadingSpec"
SPEC_MODULE = "vllm_metal.kv.offload.spec"
