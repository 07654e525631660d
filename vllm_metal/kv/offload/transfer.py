"""Block copies between the MLX KV pool and the host pool, and the disk tier's I/O.

vLLM's connector worker calls `submit_store` / `submit_load` at the start of a step and
`get_finished` after it. One offloaded block (a host "chunk") of KV-cache group g holds, for the
block's tokens, the K and V pages of every memory region g's layers use, as raw bytes.

- A store gathers its device blocks with one MLX op per group and evaluates it on the runner
  thread (a copy of just those blocks, before the step's forward is queued, so the pool stays
  donatable to the forward's cache writes). Copying the bytes into the host pool, and writing the
  blocks' disk files, run on background threads; the job finishes when the host copy is in.
- A load reads its blocks from host chunks or disk files on a background thread (a file that
  fails its checksum is never used: its device blocks are reported as load errors, so vLLM
  recomputes them). The bytes go into the pool on the runner thread in `get_finished`, after this
  step's forward was built; the request waits for the load, so nothing reads those blocks before.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from vllm_metal._logging import init_logger
from vllm_metal.kv.offload.disk import DiskTier
from vllm_metal.kv.offload.manager import ON_DISK, TierSpec
from vllm_metal.kv.pool import KVPool

logger = init_logger(__name__)

# Disk writes waiting in memory beyond this are dropped (the block stays in the host tier only):
# a slow disk must not hold an unbounded copy of the KV stream.
MAX_PENDING_DISK_BYTES = 1 << 30
SUMMARY_INTERVAL_S = 30.0


@dataclass
class _Job:
    job_id: int
    started: float
    future: Future
    nbytes: int
    # Loads: per group, the device block ids the bytes go to.
    device_ids: list[np.ndarray] = field(default_factory=list)


@dataclass
class TierCounters:
    host_blocks_loaded: int = 0
    disk_blocks_loaded: int = 0
    disk_blocks_failed: int = 0  # missing or corrupt files, recomputed
    blocks_stored: int = 0
    disk_writes_dropped: int = 0

    def line(self, disk: DiskTier | None) -> str:
        text = (
            f"KV offload: loaded {self.host_blocks_loaded} blocks from host, "
            f"{self.disk_blocks_loaded} from disk ({self.disk_blocks_failed} unreadable, "
            f"recomputed); stored {self.blocks_stored}"
        )
        if disk is not None:
            text += f"; disk holds {disk.num_files} blocks ({disk.bytes_used / 2**30:.2f} GiB)"
        return text


class MLXTransfer(OffloadingWorker):
    def __init__(self, pool: KVPool, group_ids: list[int], num_chunks: int, disk: DiskTier | None):
        self.pool: KVPool | None = pool  # None while sleep mode has freed it
        layout = pool.layout
        # The memory regions of each offloaded group, in layer order.
        self.regions = [
            list(
                dict.fromkeys(
                    r for r, g in zip(layout.region_of_layer, layout.group_of_layer) if g == group
                )
            )
            for group in group_ids
        ]
        # Bytes of one block of each group: its regions' K and V pages as they are stored (a
        # TurboQuant pool's key and value pages have widths of their own, its boundary layers'
        # the model's dtype), whatever their layers' rows per block.
        self.group_bytes = [
            sum(_page_bytes(a) for r in rs for a in (pool.keys[r], pool.values[r]))
            for rs in self.regions
        ]
        self.chunk_bytes = max(self.group_bytes, default=0)
        # Pages are committed by the OS as chunks are first written.
        self.host = np.empty((num_chunks, self.chunk_bytes), dtype=np.uint8)
        self.disk = disk
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-copy")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-disk")
        self._pending_disk_bytes = 0
        self._lock = threading.Lock()
        self._stores: dict[int, _Job] = {}
        self._loads: dict[int, _Job] = {}
        self._load_errors: set[int] = set()
        self.counters = TierCounters()
        self._logged = (time.monotonic(), TierCounters())

    # ------------------------------------------------------------ stores

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, TierSpec)
        started = time.perf_counter()
        parts = []  # (host chunk ids, keys, gathered bytes) per group
        offset = 0
        for g, n in enumerate(src_spec.group_sizes):
            if n == 0:
                continue
            ids = mx.array(src_spec.block_ids[offset : offset + n])
            gathered = self._gather(g, ids)
            parts.append(
                (
                    dst_spec.block_ids[offset : offset + n],
                    dst_spec.keys[offset : offset + n],
                    gathered,
                )
            )
            offset += n
        mx.eval([p[2] for p in parts])
        nbytes = sum(p[2].nbytes for p in parts)
        host_parts = [(chunks, np.asarray(data)) for chunks, _, data in parts]
        self._stores[job_id] = _Job(
            job_id, started, self._copier.submit(self._to_host, host_parts), nbytes
        )
        self.counters.blocks_stored += offset
        if self.disk is not None:
            for _, keys, data in parts:
                self._queue_disk_writes(keys, np.asarray(data))
        return True

    def _gather(self, group: int, ids: mx.array) -> mx.array:
        """The group's blocks `ids` as bytes: [n, 2 * regions * block bytes]."""
        pool = self.pool
        regions = self.regions[group]
        arrays = [pool.keys[r] for r in regions] + [pool.values[r] for r in regions]
        pages = [a[ids].reshape(ids.shape[0], -1).view(mx.uint8) for a in arrays]
        return mx.concatenate(pages, axis=1)

    def _to_host(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for chunks, data in parts:
            self.host[chunks, : data.shape[1]] = data

    def _queue_disk_writes(self, keys: list[bytes], data: np.ndarray) -> None:
        with self._lock:
            if self._pending_disk_bytes + data.nbytes > MAX_PENDING_DISK_BYTES:
                self.counters.disk_writes_dropped += len(keys)
                return
            self._pending_disk_bytes += data.nbytes
        self._writer.submit(self._write_disk, keys, data)

    def _write_disk(self, keys: list[bytes], data: np.ndarray) -> None:
        try:
            for key, row in zip(keys, data):
                self.disk.write(key, row)
        except OSError as exc:
            logger.warning("KV offload: disk write failed (%s); the blocks stay in memory", exc)
        finally:
            with self._lock:
                self._pending_disk_bytes -= data.nbytes

    # ------------------------------------------------------------ loads

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, TierSpec)
        requests = []  # per group: (host chunk ids, keys, group index)
        device_ids = []
        offset = 0
        for g, n in enumerate(dst_spec.group_sizes):
            if n == 0:
                continue
            requests.append(
                (src_spec.block_ids[offset : offset + n], src_spec.keys[offset : offset + n], g)
            )
            device_ids.append(dst_spec.block_ids[offset : offset + n])
            offset += n
        nbytes = sum(len(chunks) * self.group_bytes[g] for chunks, _, g in requests)
        future = self._copier.submit(self._read, requests)
        self._loads[job_id] = _Job(job_id, time.perf_counter(), future, nbytes, device_ids)
        return True

    def _read(self, requests) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per group: (group, bytes [n, group bytes], ok mask [n])."""
        out = []
        for chunks, keys, g in requests:
            size = self.group_bytes[g]
            ok = np.ones(len(chunks), dtype=bool)
            on_host = chunks != ON_DISK
            if on_host.all():  # the usual case: one gather from the host pool
                out.append((g, self.host[chunks, :size], ok))
                self.counters.host_blocks_loaded += len(chunks)
                continue
            data = np.empty((len(chunks), size), dtype=np.uint8)
            data[on_host] = self.host[chunks[on_host], :size]
            for i in np.flatnonzero(~on_host):
                row = None if self.disk is None else self.disk.read(keys[i], size)
                if row is None:
                    ok[i] = False
                else:
                    data[i] = row
            self.counters.host_blocks_loaded += int(on_host.sum())
            self.counters.disk_blocks_loaded += int((~on_host & ok).sum())
            self.counters.disk_blocks_failed += int((~ok).sum())
            out.append((g, data, ok))
        return out

    def _scatter(self, job: _Job) -> None:
        pool = self.pool
        for (g, data, ok), ids in zip(job.future.result(), job.device_ids):
            if pool is None:  # freed meanwhile (sleep mode): the blocks were not loaded
                ok[:] = False
            self._load_errors.update(ids[~ok].tolist())
            if not ok.any():
                continue
            regions = self.regions[g]
            rows = mx.array(data if ok.all() else data[ok])
            dst = mx.array(ids[ok])
            start = 0
            for arrays in (pool.keys, pool.values):
                for r in regions:
                    size = _page_bytes(arrays[r])
                    page = rows[:, start : start + size].view(arrays[r].dtype)
                    arrays[r][dst] = page.reshape(len(ids[ok]), *arrays[r].shape[1:])
                    start += size

    # ------------------------------------------------------------ results

    def get_finished(self) -> list[TransferResult]:
        results = []
        for jobs, is_load in ((self._stores, False), (self._loads, True)):
            for job_id in [j for j, job in jobs.items() if job.future.done()]:
                job = jobs.pop(job_id)
                if is_load:
                    self._scatter(job)
                else:
                    job.future.result()  # a failed host copy is a bug: raise it here
                elapsed = time.perf_counter() - job.started
                results.append(TransferResult(job_id, True, job.nbytes, elapsed))
        self._maybe_log()
        return results

    def take_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            job = self._stores.get(job_id) or self._loads.get(job_id)
            if job is not None:
                job.future.result()

    def drain_disk_writes(self) -> None:
        """Block until every queued disk write is on disk (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        last_time, last = self._logged
        if now - last_time >= SUMMARY_INTERVAL_S and self.counters != last:
            logger.info("%s", self.counters.line(self.disk))
            self._logged = (now, TierCounters(**vars(self.counters)))

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        if self.counters != TierCounters():
            logger.info("%s", self.counters.line(self.disk))
        if self.disk is not None:
            self.disk.close()


def _page_bytes(array: mx.array) -> int:
    """Bytes of one block of a pool array `[num_blocks, ...]`."""
    return int(np.prod(array.shape[1:])) * array.dtype.size
