"""The disk tier of KV offloading keeps whole, checked blocks on disk within its capacity: what is
written reads back byte for byte (also after a restart and from another process), a damaged or
half-written file is never served, and the least recently used files go first."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from vllm_metal.kv.offload import disk
from vllm_metal.kv.offload.disk import DiskTier

NS = "0123abcd"
ROOT_DIR = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    """Like vLLM's: a 32-byte block hash and a 4-byte group index."""
    return i.to_bytes(32, "little") + (i % 3).to_bytes(4, "little")


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def files(root: Path) -> list[Path]:
    return sorted(p for p in (root / NS).rglob("*") if p.is_file())


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONHASHSEED="12345")
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT_DIR,
        env=env,
        timeout=60,
    )


@pytest.fixture
def disk_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """`caplog` for the disk module, also when vLLM's logging config stops propagation."""
    disk.logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        disk.logger.removeHandler(caplog.handler)


def test_round_trip_survives_restart_and_is_seen_by_a_reader_process(tmp_path: Path):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    data = payload(5000, 0)
    assert not tier.contains(key(1))
    assert tier.write(key(1), data)
    assert tier.contains(key(1))
    out = tier.read(key(1), data.nbytes)
    assert out is not None and out.dtype == np.uint8 and out.shape == (5000,)
    np.testing.assert_array_equal(out, data)
    assert out.ctypes.data != data.ctypes.data
    assert tier.stats.writes == 1 and tier.stats.hits == 1
    (path,) = files(tmp_path)
    assert path.name == key(1).hex() + ".kvb"
    assert path.parent.parent == tmp_path / NS and len(path.parent.name) == 2
    assert tier.bytes_used == path.stat().st_size > data.nbytes and tier.num_files == 1
    tier.close()

    reopened = DiskTier(tmp_path, NS, 1 << 20)
    assert reopened.num_files == 1 and reopened.bytes_used == tier.bytes_used
    np.testing.assert_array_equal(reopened.read(key(1), data.nbytes), data)

    reader = DiskTier(tmp_path, NS, 1 << 20, writer=False)
    assert reader.contains(key(1)) and not reader.contains(key(2))
    with pytest.raises(RuntimeError):
        reader.write(key(2), data)
    # Another process, with another hash seed, finds the same file name.
    code = (
        "import sys; from vllm_metal.kv.offload.disk import DiskTier; "
        "t = DiskTier(sys.argv[1], sys.argv[2], 1, writer=False); "
        "print(t.contains(bytes.fromhex(sys.argv[3])), t.contains(bytes.fromhex(sys.argv[4])))"
    )
    proc = run_python(code, str(tmp_path), NS, key(1).hex(), key(2).hex())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"]


def test_reader_creates_nothing(tmp_path: Path):
    reader = DiskTier(tmp_path / "absent", NS, 100, writer=False)
    assert not reader.contains(key(0))
    assert not (tmp_path / "absent").exists()


def _flip_payload_byte(tier: DiskTier, k: bytes, other: bytes) -> None:
    with open(tier.path(k), "r+b") as f:
        f.seek(-7, os.SEEK_END)
        b = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def _truncate(tier: DiskTier, k: bytes, other: bytes) -> None:
    path = tier.path(k)
    os.truncate(path, path.stat().st_size // 2)


def _other_key(tier: DiskTier, k: bytes, other: bytes) -> None:
    shutil.copyfile(tier.path(other), tier.path(k))


def _bad_magic(tier: DiskTier, k: bytes, other: bytes) -> None:
    with open(tier.path(k), "r+b") as f:
        f.write(b"XXXX")


def _bad_version(tier: DiskTier, k: bytes, other: bytes) -> None:
    with open(tier.path(k), "r+b") as f:
        f.seek(4)
        f.write((99).to_bytes(4, "little"))


def _trailing_byte(tier: DiskTier, k: bytes, other: bytes) -> None:
    with open(tier.path(k), "ab") as f:
        f.write(b"\0")


@pytest.mark.parametrize(
    "damage, nbytes_delta, reason",
    [
        (_flip_payload_byte, 0, "digest"),
        (_truncate, 0, "expected"),
        (_other_key, 0, "another key"),
        (_bad_magic, 0, "magic"),
        (_bad_version, 0, "version"),
        (_trailing_byte, 0, "expected"),
        (None, 1, "expected 4001"),  # the caller's block size disagrees with the file
    ],
)
def test_damaged_file_is_deleted_not_served(
    tmp_path: Path, disk_log, damage, nbytes_delta: int, reason: str
):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    assert tier.write(key(1), payload(4000, 1))
    assert tier.write(key(2), payload(4000, 2))
    size = tier.bytes_used // 2
    if damage is not None:
        damage(tier, key(1), key(2))
    path = tier.path(key(1))

    assert tier.read(key(1), 4000 + nbytes_delta) is None
    assert not path.exists() and not tier.contains(key(1))
    assert tier.stats.corrupt == 1 and tier.stats.misses == 0
    assert tier.num_files == 1 and tier.bytes_used == size
    # (A record can reach caplog's handler twice: on the module logger and through propagation.)
    (record,) = {id(r): r for r in disk_log.records if r.levelno == logging.WARNING}.values()
    assert str(path) in record.getMessage() and reason in record.getMessage()

    assert tier.read(key(1), 4000) is None
    assert tier.stats.misses == 1 and tier.stats.corrupt == 1
    np.testing.assert_array_equal(tier.read(key(2), 4000), payload(4000, 2))
    assert tier.write(key(1), payload(4000, 1))  # recomputed, stored again
    np.testing.assert_array_equal(tier.read(key(1), 4000), payload(4000, 1))


# Writes one 1 MiB block with the file size limited to 64 KiB: the kernel stops the write midway
# (SIGXFSZ kills the process with mode "kill"; the write fails with EFBIG with mode "raise").
_INTERRUPTED_WRITE = """
import json, resource, signal, sys
import numpy as np
from vllm_metal.kv.offload.disk import DiskTier
tier = DiskTier(sys.argv[1], sys.argv[2], 1 << 30)
key, mode = bytes.fromhex(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
signal.signal(signal.SIGXFSZ, signal.SIG_DFL if mode == "kill" else signal.SIG_IGN)
try:
    tier.write(key, np.full(1 << 20, 7, dtype=np.uint8))
except OSError as exc:
    print(json.dumps([exc.errno, tier.bytes_used, tier.num_files]))
"""


def test_write_killed_midway_leaves_only_a_temp_file_which_the_next_writer_removes(tmp_path):
    proc = run_python(_INTERRUPTED_WRITE, str(tmp_path), NS, key(1).hex(), "kill")
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr
    (leftover,) = files(tmp_path)
    assert leftover.name.endswith(".tmp") and leftover.stat().st_size == 64 << 10
    assert not DiskTier(tmp_path, NS, 1 << 30, writer=False).contains(key(1))

    tier = DiskTier(tmp_path, NS, 1 << 30)
    assert files(tmp_path) == [] and tier.num_files == 0 and tier.bytes_used == 0
    assert tier.read(key(1), 1 << 20) is None and tier.stats.misses == 1
    assert tier.write(key(1), np.full(1 << 20, 7, dtype=np.uint8))
    assert tier.read(key(1), 1 << 20) is not None


def test_failed_write_leaves_nothing_and_releases_its_space(tmp_path):
    proc = run_python(_INTERRUPTED_WRITE, str(tmp_path), NS, key(1).hex(), "raise")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [errno.EFBIG, 0, 0]
    assert files(tmp_path) == []


def test_least_recently_used_files_are_evicted_and_order_survives_restart(tmp_path: Path):
    probe = DiskTier(tmp_path / "probe", NS, 1 << 20)
    probe.write(key(0), payload(1000, 0))
    size = probe.bytes_used
    capacity = 3 * size + size // 2

    tier = DiskTier(tmp_path, NS, capacity)
    for i in range(3):
        assert tier.write(key(i), payload(1000, i))
    assert tier.read(key(0), 1000) is not None  # LRU first: 1 2 0
    assert tier.write(key(3), payload(1000, 3))  # evicts 1: 2 0 3
    assert not tier.write(key(2), payload(1000, 2))  # present, not rewritten but used: 0 3 2
    assert tier.read(key(0), 1000) is not None  # 3 2 0
    assert tier.write(key(4), payload(1000, 4))  # evicts 3: 2 0 4
    assert [tier.contains(key(i)) for i in range(5)] == [True, False, True, False, True]
    assert tier.num_files == 3 and tier.bytes_used == 3 * size <= capacity
    assert tier.stats.evictions == 2 and len(files(tmp_path)) == 3

    # A new writer orders by mtime (2 0 4); with a smaller capacity it evicts on open.
    smaller = DiskTier(tmp_path, NS, 2 * size)
    assert smaller.num_files == 2 and smaller.stats.evictions == 1
    assert [smaller.contains(key(i)) for i in (0, 2, 4)] == [True, False, True]
    assert smaller.write(key(5), payload(1000, 5))  # evicts 0
    assert [smaller.contains(key(i)) for i in (0, 4, 5)] == [False, True, True]
    np.testing.assert_array_equal(smaller.read(key(4), 1000), payload(1000, 4))


def test_block_larger_than_the_tier_is_not_written(tmp_path: Path):
    tier = DiskTier(tmp_path, NS, 1000)
    assert tier.write(key(0), payload(500, 0))
    assert not tier.write(key(1), payload(1000, 1))
    assert tier.contains(key(0)) and not tier.contains(key(1)) and tier.stats.evictions == 0


def test_writing_a_present_key_again_does_not_rewrite_it(tmp_path: Path):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    assert tier.write(key(7), payload(3000, 1))
    inode = tier.path(key(7)).stat().st_ino
    assert not tier.write(key(7), payload(3000, 2))
    assert tier.path(key(7)).stat().st_ino == inode
    assert tier.stats.writes == 1 and tier.num_files == 1
    np.testing.assert_array_equal(tier.read(key(7), 3000), payload(3000, 1))
    assert tier.remove(key(7)) and not tier.contains(key(7)) and tier.bytes_used == 0
    assert not tier.remove(key(7))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": -5}, "capacity_bytes"),
        ({"namespace": ""}, "namespace"),
        ({"namespace": "a/b"}, "namespace"),
        ({"namespace": ".."}, "namespace"),
    ],
)
def test_bad_constructor_arguments_are_rejected(tmp_path: Path, kwargs, name: str):
    args = {"root": tmp_path, "namespace": NS, "capacity_bytes": 100} | kwargs
    with pytest.raises(ValueError, match=name):
        DiskTier(**args)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros(16, dtype=np.float32),
        np.zeros((4, 4), dtype=np.uint8),
        np.zeros(32, dtype=np.uint8)[::2],
        b"raw bytes",
    ],
)
def test_bad_payload_is_rejected(tmp_path: Path, bad):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    with pytest.raises(ValueError, match="payload"):
        tier.write(key(0), bad)
    assert files(tmp_path) == [] and tier.bytes_used == 0


def test_bad_key_and_nbytes_are_rejected(tmp_path: Path):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    for bad_key in (b"", "text", b"x" * 101):
        with pytest.raises(ValueError, match="key"):
            tier.write(bad_key, payload(10, 0))
    with pytest.raises(ValueError, match="nbytes"):
        tier.read(key(0), -1)


def test_concurrent_writes_and_reads_keep_a_consistent_index(tmp_path: Path):
    sizes = {i: 256 + 97 * (i % 40) for i in range(240)}
    capacity = sum(sizes.values()) // 3
    tier = DiskTier(tmp_path, NS, capacity)
    over_capacity, done = [], threading.Event()

    def watch() -> None:
        while not done.wait(0.0002):
            if tier.bytes_used > capacity:
                over_capacity.append(tier.bytes_used)

    def work(thread: int) -> int:
        rng, served = random.Random(thread), 0
        for i in range(thread, len(sizes), 6):
            tier.write(key(i), payload(sizes[i], i))
            j = rng.randrange(len(sizes))
            out = tier.read(key(j), sizes[j])
            if out is not None:
                np.testing.assert_array_equal(out, payload(sizes[j], j))
                served += 1
        return served

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(6) as pool:
        served = sum(pool.map(work, range(6)))
    done.set()
    watcher.join()

    assert over_capacity == []
    assert tier.stats.corrupt == 0 and tier.stats.hits == served and tier.stats.evictions > 0
    on_disk = files(tmp_path)
    assert all(p.suffix == ".kvb" for p in on_disk)
    assert tier.num_files == len(on_disk) == sum(tier.contains(key(i)) for i in sizes)
    assert tier.bytes_used == sum(p.stat().st_size for p in on_disk) <= capacity
    fresh = DiskTier(tmp_path, NS, capacity)
    assert (fresh.num_files, fresh.bytes_used) == (tier.num_files, tier.bytes_used)
