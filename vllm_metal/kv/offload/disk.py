"""The disk tier of KV offloading: one file per KV block, content-addressed by its key.

A block lives at `<root>/<namespace>/<fan-out>/<hex(key)>.kvb`, where the 2-hex-char fan-out
directory comes from a BLAKE2b digest of the key (stable across processes). A file is a header
(magic `VMKV`, format version, key length and key, payload length, 16-byte BLAKE2b digest of the
payload) followed by the payload. Writes go to a temporary file in the same directory, are
fsync'd, then renamed over the final name, so a final name only ever holds a whole file; `read`
re-checks the header and digest anyway and deletes (never serves) a file that fails. The writer
keeps an LRU index bounded by `capacity_bytes`; recency is also stored as the file's mtime, so a
restarted writer rebuilds the same order. One writer per directory; any number of readers, which
only ask `contains` (and may `clear` the namespace).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_metal._logging import init_logger

logger = init_logger(__name__)

MAGIC = b"VMKV"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
MAX_KEY_BYTES = 100  # hex(key) plus the temporary suffix must fit a 255-byte file name
_PREFIX = struct.Struct("<4sIH")  # magic, format version, key length; then the key
_TRAILER = struct.Struct("<Q16s")  # payload length, blake2b-128 of the payload; then the payload


def _header_size(key: bytes) -> int:
    return _PREFIX.size + len(key) + _TRAILER.size


def _touch(path: Path, stamp: int) -> None:
    """Set `path`'s mtime, which orders the LRU index when a writer reopens the directory."""
    try:
        os.utime(path, ns=(stamp, stamp))
    except FileNotFoundError:
        pass  # evicted meanwhile


@dataclass
class DiskTierStats:
    writes: int = 0
    hits: int = 0  # reads that returned a block
    misses: int = 0  # reads of a key with no file
    corrupt: int = 0  # files that failed a check on read (and were deleted)
    evictions: int = 0


class DiskTier:
    """KV blocks on disk under `Path(root) / namespace`, at most `capacity_bytes` of files."""

    def __init__(
        self,
        root: str | os.PathLike,
        namespace: str,
        capacity_bytes: int,
        *,
        writer: bool = True,
    ) -> None:
        if not namespace or "/" in namespace or os.sep in namespace or namespace in (".", ".."):
            raise ValueError(f"namespace must be a non-empty directory name, got {namespace!r}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.dir = Path(root) / namespace
        self.capacity_bytes = int(capacity_bytes)
        self.writer = writer
        self.stats = DiskTierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._pending: dict[bytes, int] = {}  # keys being written -> reserved size
        self._used = 0  # committed files plus reservations of writes in flight
        self._clock = 0  # last mtime (ns) handed out; strictly increasing
        self._tmp_ids = itertools.count()
        if writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    @property
    def bytes_used(self) -> int:
        return self._used

    @property
    def num_files(self) -> int:
        return len(self._index)

    def path(self, key: bytes) -> Path:
        """Where `key`'s block lives (whether or not it is there)."""
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {key!r}")
        fan_out = hashlib.blake2b(key, digest_size=1).hexdigest()
        return self.dir / fan_out / (key.hex() + SUFFIX)

    def contains(self, key: bytes) -> bool:
        return self.path(key).exists()

    def write(self, key: bytes, payload: np.ndarray) -> bool:
        """Store `payload` under `key`; False (nothing written) if present or larger than the tier.

        Evicts least-recently-used files to make room. An I/O error (e.g. disk full) propagates
        after the temporary file is removed; the final name is never left with a partial file.
        """
        self._require_writer("write")
        path = self.path(key)
        ok = isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and payload.ndim == 1
        if not (ok and payload.flags.c_contiguous):
            raise ValueError("payload must be a contiguous 1-D np.uint8 array")
        size = _header_size(key) + payload.nbytes
        if size > self.capacity_bytes:
            return False
        with self._lock:
            present = key in self._index
            if present and not path.exists():  # deleted by `clear` in another process
                self._used -= self._index.pop(key)
                present = False
            if present:
                self._index.move_to_end(key)
            elif key in self._pending or not self._evict_until_fits(size):
                return False  # being written by another thread, or the rest is held by writes
            else:
                self._pending[key] = size
                self._used += size
                tmp = path.with_name(f"{path.name}.{os.getpid()}.{next(self._tmp_ids)}{TMP_SUFFIX}")
            stamp = self._stamp()
        if present:
            _touch(path, stamp)
            return False
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        header = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(key)) + key
        header += _TRAILER.pack(payload.nbytes, digest)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(header)
                f.write(memoryview(payload))
                f.flush()
                os.utime(f.fileno(), ns=(stamp, stamp))
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._used -= self._pending.pop(key)
            raise
        with self._lock:
            self._index[key] = self._pending.pop(key)
            self.stats.writes += 1
        return True

    def read(self, key: bytes, nbytes: int) -> np.ndarray | None:
        """`key`'s payload as a new array of `nbytes`; None if absent or bad (then deleted)."""
        self._require_writer("read")
        path = self.path(key)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        try:
            with open(path, "rb", buffering=0) as f:  # unbuffered: the payload lands in `out`
                inode = os.fstat(f.fileno()).st_ino
                out, reason = self._read_checked(f, key, nbytes)
        except FileNotFoundError:
            with self._lock:
                self.stats.misses += 1
                if key in self._index and not path.exists():  # deleted behind our back
                    self._used -= self._index.pop(key)  # (exists: written since our open)
            return None
        with self._lock:
            if out is None:
                self._drop_corrupt(path, key, inode, reason)
                return None
            self.stats.hits += 1
            indexed = key in self._index
            if indexed:
                self._index.move_to_end(key)
                stamp = self._stamp()
        if indexed:
            _touch(path, stamp)
        return out

    def remove(self, key: bytes) -> bool:
        """Delete `key`'s file; True if there was one."""
        self._require_writer("remove")
        path = self.path(key)
        with self._lock:
            if key in self._index:
                self._used -= self._index.pop(key)
            try:
                path.unlink()
            except FileNotFoundError:
                return False
        return True

    def clear(self) -> int:
        """Delete every block file of this namespace (a reader may too: vLLM's prefix-cache
        reset runs on the scheduler side); the number deleted. A writer in another process
        notices lazily: its index drops a key whose file is gone when the key comes back."""
        deleted = 0
        with self._lock:
            for file in self.dir.glob(f"*/*{SUFFIX}"):
                file.unlink(missing_ok=True)
                deleted += 1
            if self.writer:
                self._index.clear()
                self._used = sum(self._pending.values())
        return deleted

    def close(self) -> None:
        """Nothing to flush: every write is complete and fsync'd when `write` returns."""

    def _require_writer(self, op: str) -> None:
        if not self.writer:
            raise RuntimeError(f"DiskTier at {self.dir} was opened read-only; cannot {op}")

    def _stamp(self) -> int:
        """A strictly increasing mtime (ns), so the LRU order on disk has no ties. Under the lock."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _evict_until_fits(self, size: int) -> bool:
        """Delete LRU files until `size` more bytes fit. Under the lock."""
        while self._used + size > self.capacity_bytes and self._index:
            key, file_size = self._index.popitem(last=False)
            self.path(key).unlink(missing_ok=True)
            self._used -= file_size
            self.stats.evictions += 1
        return self._used + size <= self.capacity_bytes

    def _read_checked(self, f, key: bytes, nbytes: int) -> tuple[np.ndarray | None, str]:
        """The payload, or None and why the file is bad."""
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            return None, "truncated header"
        magic, version, key_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            return None, f"bad magic {magic!r}"
        if version != FORMAT_VERSION:
            return None, f"format version {version}, expected {FORMAT_VERSION}"
        rest = f.read(key_len + _TRAILER.size)
        if len(rest) < key_len + _TRAILER.size:
            return None, "truncated header"
        if rest[:key_len] != key:
            return None, "file holds another key"
        payload_len, digest = _TRAILER.unpack(rest[key_len:])
        if payload_len != nbytes:
            return None, f"payload is {payload_len} bytes, expected {nbytes}"
        file_size = os.fstat(f.fileno()).st_size
        if file_size != _header_size(key) + payload_len:
            return None, f"file is {file_size} bytes, expected {_header_size(key) + payload_len}"
        out = np.empty(nbytes, dtype=np.uint8)
        view, filled = memoryview(out), 0
        while filled < nbytes:
            n = f.readinto(view[filled:])
            if not n:
                return None, "truncated payload"
            filled += n
        if hashlib.blake2b(out, digest_size=16).digest() != digest:
            return None, "payload digest mismatch"
        return out, ""

    def _drop_corrupt(self, path: Path, key: bytes, inode: int, reason: str) -> None:
        """Delete the bad file we read, unless a fresh write has replaced it since. Under the lock."""
        self.stats.corrupt += 1
        logger.warning("Discarding KV block file %s: %s", path, reason)
        try:
            if os.stat(path).st_ino != inode:
                return  # written afresh since we read it
            path.unlink()
        except FileNotFoundError:
            pass
        if key in self._index:
            self._used -= self._index.pop(key)

    def _scan(self) -> None:
        """Index the files left by earlier writers (LRU by mtime), delete interrupted writes."""
        for tmp in self.dir.glob(f"*/*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        found: list[tuple[int, bytes, int]] = []
        for file in self.dir.glob(f"*/*{SUFFIX}"):
            try:
                key = bytes.fromhex(file.name.removesuffix(SUFFIX))
                if self.path(key) == file:  # else not a name we write (nor could evict)
                    st = file.stat()
                    found.append((st.st_mtime_ns, key, st.st_size))
            except (ValueError, FileNotFoundError):
                continue
        found.sort()
        for mtime, key, size in found:
            self._index[key] = size
            self._used += size
            self._clock = max(self._clock, mtime)
        self._evict_until_fits(0)
