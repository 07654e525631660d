"""Startup configuration of the KV offload tiers (`config.startup`, after the capability table).

vLLM turns `--kv-offloading-size` into its `OffloadingConnector` after the platform's check
(`VllmConfig._post_init_kv_transfer_config`) and keeps extra connector settings the platform put
there first. This module puts in the spec to load (`MetalOffloadingSpec`) and the disk tier's
settings, sizes the host pool when only the disk tier was asked for, and refuses, naming the
setting, what cannot work: a draft model beside it (its KV cache is not offloaded), another
offloading backend or spec, a host pool larger than free memory, a disk tier in an unwritable
directory or larger than the disk, block hashes that differ between processes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_metal import envs
from vllm_metal._logging import init_logger
from vllm_metal.config.errors import MetalConfigError
from vllm_metal.config.features import NO_OFFLOAD, offload_setting
from vllm_metal.host import available_memory_bytes, memory_pressure, physical_memory_bytes
from vllm_metal.kv.offload import SPEC_MODULE, SPEC_NAME
from vllm_metal.kv.offload.spec import DISK_BYTES, DISK_DIR, MIN_CHUNKS, MODEL_FINGERPRINT

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# Without --kv-offloading-size the host pool takes this share of the memory free at startup, at
# most this share of all memory, and a smaller share when the machine is already paging.
AUTO_HOST_SHARE_OF_FREE = 0.25
AUTO_HOST_SHARE_OF_TOTAL = 0.125
AUTO_HOST_SHARE_WHEN_PAGING = 0.05
# Without VLLM_METAL_SSD_CACHE_SIZE the disk tier takes at most this, and half the free space.
DEFAULT_DISK_BYTES = 64 * 2**30
# Block hashes that differ between processes unless PYTHONHASHSEED is set.
PROCESS_SEEDED_HASHES = ("xxhash", "xxhash_cbor")


def configure(vllm_config: VllmConfig) -> None:
    setting = offload_setting(vllm_config)
    if setting is None:
        return
    from vllm.config import KVTransferConfig

    spec = vllm_config.speculative_config
    if spec is not None and spec.uses_draft_model():
        raise MetalConfigError(
            f"vllm-metal: KV offloading with a draft model (its KV cache is not offloaded) is not "
            f"supported: {setting} with --speculative-config method={spec.method!r}; "
            f"{NO_OFFLOAD}, or draft with method 'ngram'"
        )
    cache = vllm_config.cache_config
    if cache.kv_offloading_backend != "native":
        raise MetalConfigError(
            f"vllm-metal: --kv-offloading-backend {cache.kv_offloading_backend} is not "
            "supported; use native (the default)"
        )
    if os.environ.get("VLLM_USE_SIMPLE_KV_OFFLOAD", "0") not in ("", "0"):
        raise MetalConfigError(
            "vllm-metal: VLLM_USE_SIMPLE_KV_OFFLOAD=1 selects a CUDA-only connector; unset it"
        )
    transfer = vllm_config.kv_transfer_config
    extra = {} if transfer is None else transfer.kv_connector_extra_config
    if extra.get("spec_name", SPEC_NAME) != SPEC_NAME:
        raise MetalConfigError(
            f"vllm-metal: kv_connector_extra_config spec_name={extra['spec_name']!r} is not "
            f"supported; leave it unset (this platform's spec is {SPEC_NAME})"
        )
    disk_dir = envs.VLLM_METAL_SSD_CACHE_DIR
    settings = {
        "spec_name": SPEC_NAME,
        "spec_module_path": SPEC_MODULE,
        MIN_CHUNKS: -(-vllm_config.model_config.max_model_len // (cache.block_size or 16)),
        MODEL_FINGERPRINT: model_fingerprint(vllm_config),
    }
    if disk_dir is not None:
        _check_hash_is_stable(cache.prefix_caching_hash_algo)
        settings[DISK_DIR] = disk_dir
        settings[DISK_BYTES] = _disk_capacity(disk_dir)
    if cache.kv_offloading_size is None and "cpu_bytes_to_use" not in extra:
        cache.kv_offloading_size = _auto_host_bytes() / 2**30
        logger.info(
            "KV offload: host tier of %.2f GiB sized from free memory (--kv-offloading-size "
            "sets it)",
            cache.kv_offloading_size,
        )
    else:
        _check_host_fits(cache.kv_offloading_size, extra.get("cpu_bytes_to_use"))
    if transfer is None:
        vllm_config.kv_transfer_config = transfer = KVTransferConfig()
    transfer.kv_connector_extra_config.update(settings)
    if disk_dir is not None:
        # A disk block that fails its checksum is reported as a load error: recompute it.
        transfer.kv_load_failure_policy = "recompute"


def _auto_host_bytes() -> int:
    free = available_memory_bytes()
    share = AUTO_HOST_SHARE_WHEN_PAGING if memory_pressure() else AUTO_HOST_SHARE_OF_FREE
    return int(min(free * share, physical_memory_bytes() * AUTO_HOST_SHARE_OF_TOTAL))


def _check_host_fits(size_gib: float | None, cpu_bytes: object) -> None:
    asked = int(size_gib * 2**30) if size_gib is not None else int(cpu_bytes or 0)
    free = available_memory_bytes()
    if asked > free:
        raise MetalConfigError(
            f"vllm-metal: --kv-offloading-size asks for a host tier of {asked / 2**30:.2f} GiB "
            f"but only {free / 2**30:.2f} GiB of memory is free; lower it"
        )


def _check_hash_is_stable(algo: str) -> None:
    if algo in PROCESS_SEEDED_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        raise MetalConfigError(
            f"vllm-metal: the disk tier (VLLM_METAL_SSD_CACHE_DIR) needs block hashes that are "
            f"the same in every process, but --prefix-caching-hash-algo {algo} is seeded per "
            "process; use sha256 (the default) or sha256_cbor, or set PYTHONHASHSEED"
        )


def _disk_capacity(disk_dir: str) -> int:
    try:
        Path(disk_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=disk_dir, prefix=".probe-"):
            pass
    except OSError as exc:
        raise MetalConfigError(
            f"vllm-metal: VLLM_METAL_SSD_CACHE_DIR={disk_dir!r} is not a writable directory "
            f"({exc.strerror or exc})"
        ) from None
    free = shutil.disk_usage(disk_dir).free
    if "VLLM_METAL_SSD_CACHE_SIZE" not in os.environ:
        return int(min(DEFAULT_DISK_BYTES, free // 2))
    asked = envs.VLLM_METAL_SSD_CACHE_SIZE
    held = sum(f.stat().st_size for f in Path(disk_dir).rglob("*.kvb"))
    if asked > free + held:
        raise MetalConfigError(
            f"vllm-metal: VLLM_METAL_SSD_CACHE_SIZE={asked / 2**30:.2f} GiB is more than the "
            f"disk holding {disk_dir!r} can take ({(free + held) / 2**30:.2f} GiB free or "
            "already used by the cache); lower it"
        )
    return asked


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """The checkpoint's identity: the hub snapshot, or a local directory's weight files with
    their sizes and modification times (a re-converted model never reads stale blocks)."""
    model = vllm_config.model_config
    facts: dict[str, object] = {"model": model.model, "revision": model.revision}
    path = Path(model.model)
    if path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        facts["files"] = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model.model, "config.json", revision=model.revision)
            facts["snapshot"] = str(found) if isinstance(found, str) else None
        except (ValueError, OSError):  # not a hub id: the name and revision identify it
            facts["snapshot"] = None
    return json.dumps(facts, sort_keys=True)
