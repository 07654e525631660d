"""Scheduler-side bookkeeping of the host and disk tiers.

vLLM's `CPUOffloadingManager` keeps the host pool (which block hash sits in which host chunk,
LRU eviction, reference counts while a transfer runs). This subclass adds the disk tier under
it: a block the host pool no longer holds is still a hit when its file is on disk, and its load
names the file instead of a host chunk. Every spec it hands the worker carries the blocks' keys,
so the worker can name the disk files it writes and reads.

The disk tier is written through (every block stored to the host pool is also written to disk in
the background), so a block evicted from the host pool, or lost with a restart, is still on disk.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_metal.kv.offload.disk import DiskTier

# Host chunk id of a block that is loaded from its disk file.
ON_DISK = -1

HOST_HITS = "vllm:kv_offload_host_hit_blocks"
DISK_HITS = "vllm:kv_offload_disk_hit_blocks"


class TierSpec(CPULoadStoreSpec):
    """Host chunk ids (`ON_DISK` for a block read from its file) and the blocks' keys."""

    def __init__(self, chunk_ids: Sequence[int], keys: Sequence[OffloadKey]):
        super().__init__(list(chunk_ids))
        assert len(keys) == len(self.block_ids)
        self.keys: list[OffloadKey] = list(keys)

    def __repr__(self) -> str:
        return f"TierSpec(chunks={self.block_ids.tolist()})"


class HostDiskManager(CPUOffloadingManager):
    def __init__(self, *, disk: DiskTier | None, **host: Any):
        super().__init__(**host)
        self.disk = disk
        # req_id -> keys prepared for loading from disk and not completed yet.
        self._disk_loads: dict[str, Counter[OffloadKey]] = {}
        self._hits = Counter[str]()

    def _on_host(self, key: OffloadKey, req_context: ReqContext) -> bool:
        return super().lookup(key, req_context) is not LookupResult.MISS

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = super().lookup(key, req_context)
        if found is LookupResult.MISS and self.disk is not None and self.disk.contains(key):
            return LookupResult.HIT
        return found

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST if self._on_host(key, req_context) else CacheHitSource.DISK

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        on_host = [self._on_host(key, req_context) for key in keys]
        host_keys = [key for key, host in zip(keys, on_host) if host]
        host_chunks = iter(
            super().prepare_load(host_keys, req_context).block_ids.tolist() if host_keys else []
        )
        disk_keys = [key for key, host in zip(keys, on_host) if not host]
        if disk_keys:
            self._disk_loads.setdefault(req_context.req_id, Counter()).update(disk_keys)
        self._hits[HOST_HITS] += len(host_keys)
        self._hits[DISK_HITS] += len(disk_keys)
        return TierSpec([next(host_chunks) if host else ON_DISK for host in on_host], keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().touch([key for key in keys if self._on_host(key, req_context)], req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        pending = self._disk_loads.get(req_context.req_id)
        host_keys = []
        for key in keys:
            if pending and pending[key] > 0:
                pending[key] -= 1
            else:
                host_keys.append(key)
        if pending is not None and not +pending:
            del self._disk_loads[req_context.req_id]
        super().complete_load(host_keys, req_context)

    def reset_cache(self) -> None:
        """vLLM's prefix-cache reset with the connector (e.g. after new weights were loaded):
        the disk tier's blocks go too, so none computed before it is ever loaded after it."""
        super().reset_cache()
        self._disk_loads.clear()
        if self.disk is not None:
            self.disk.clear()

    def _get_load_store_spec(self, keys: Iterable[OffloadKey], chunks: Iterable) -> TierSpec:
        return TierSpec([chunk.chunk_id for chunk in chunks], list(keys))

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = super().get_stats() or OffloadingConnectorStats()
        for name in (HOST_HITS, DISK_HITS):
            stats.increase_counter(name, self._hits.pop(name, 0))
        return stats
