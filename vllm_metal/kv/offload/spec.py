"""The `OffloadingSpec` vLLM's `OffloadingConnector` loads for this platform (by the `spec_name`
and `spec_module_path` that `config.py` puts in `kv_connector_extra_config`).

It keeps vLLM's CPU spec for what is platform-neutral (host pool sizing from
`cpu_bytes_to_use`, the LRU/ARC policies) and replaces the two device-bound parts: the
scheduler's manager also knows the disk tier (`manager.py`), and the transfer worker copies
blocks to and from the MLX KV pool (`transfer.py`). vLLM's connector worker would build that
worker from torch views of the KV cache; the MLX pool has no stable torch storage (every step
replaces its arrays), so the MLX runner binds the worker to the pool itself (`bind_pool`).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from vllm_metal.kv.offload.disk import DiskTier
from vllm_metal.kv.offload.manager import DISK_HITS, HOST_HITS, HostDiskManager

if TYPE_CHECKING:
    from vllm_metal.kv.offload.transfer import MLXTransfer
    from vllm_metal.kv.pool import KVPool

# kv_connector_extra_config keys written by config.py.
DISK_DIR = "vllm_metal_disk_dir"
DISK_BYTES = "vllm_metal_disk_bytes"
MODEL_FINGERPRINT = "vllm_metal_model_fingerprint"
MIN_CHUNKS = "vllm_metal_min_chunks"  # host chunks one request of max_model_len needs


class MetalOffloadingSpec(CPUOffloadingSpec):
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            **super().build_metric_definitions(extra_config),
            HOST_HITS: OffloadingCounterMetadata(
                documentation="KV blocks loaded from the host tier of the KV offload."
            ),
            DISK_HITS: OffloadingCounterMetadata(
                documentation="KV blocks loaded from the disk tier of the KV offload."
            ),
        }

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError(
                f"vllm-metal KV offload: blocks_per_chunk={self.blocks_per_chunk} "
                "(kv_connector_extra_config 'block_size'/'blocks_per_chunk') is not supported; "
                "offload whole KV blocks (leave both unset)"
            )
        needed = int(self.extra_config.get(MIN_CHUNKS, 1))
        if 0 < self.num_chunks < needed or (self.num_chunks == 0 and config.groups):
            raise ValueError(_too_small(self.num_chunks, needed, self.kv_bytes_per_chunk))
        self.disk_dir: str | None = self.extra_config.get(DISK_DIR)
        self.disk_bytes = int(self.extra_config.get(DISK_BYTES, 0))
        self._transfer: MLXTransfer | None = None

    @property
    def disk_namespace(self) -> str:
        """Directory of this model's blocks: the checkpoint and the KV layout, so a block file
        is only ever read back by a server whose KV bytes it matches."""
        facts = {
            "model": self.extra_config.get(MODEL_FINGERPRINT, self.config.model.name),
            "kv_dtype": self.config.model.dtype,
            "tokens_per_block": self.tokens_per_block,
            "tokens_per_hash": self.tokens_per_hash,
            "bytes_per_block": self.config.worker_kv_bytes_per_block,
            "groups": [list(group.layer_names) for group in self.config.groups],
        }
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]

    def _disk(self, *, writer: bool) -> DiskTier | None:
        if not self.disk_dir:
            return None
        return DiskTier(self.disk_dir, self.disk_namespace, self.disk_bytes, writer=writer)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = HostDiskManager(
                disk=self._disk(writer=False),
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        raise RuntimeError(
            "vllm-metal KV offload: the transfer worker is bound to the MLX KV pool by the "
            "model runner (MetalOffloadingSpec.bind_pool), not built from torch KV tensors"
        )

    def bind_pool(self, pool: KVPool, group_ids: list[int]) -> MLXTransfer:
        """The transfer worker for `pool` (created once; later calls rebind a new pool)."""
        from vllm_metal.kv.offload.transfer import MLXTransfer

        if self._transfer is None:
            self._transfer = MLXTransfer(
                pool, group_ids, self.num_chunks, disk=self._disk(writer=True)
            )
        else:
            self._transfer.pool = pool
        return self._transfer


def _too_small(num_chunks: int, needed: int, chunk_bytes: int) -> str:
    from vllm_metal.host import available_memory_bytes, memory_pressure

    paging = (
        f"the machine is paging ({available_memory_bytes() / 2**30:.2f} GiB free), so "
        if memory_pressure()
        else ""
    )
    return (
        f"vllm-metal KV offload: {paging}the host tier holds {num_chunks} blocks of "
        f"{chunk_bytes / 2**20:.2f} MiB, fewer than the {needed} one request of max_model_len "
        f"needs; set --kv-offloading-size to at least {needed * chunk_bytes / 2**30:.2f} GiB, "
        "or free memory"
    )
