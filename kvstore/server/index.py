"""The block index in LMDB: key -> where the record lies, its class and its retention. No KV bytes.

All writes go through one writer thread that group-commits: it takes every queued operation, syncs
the segment files they depend on (durability "fsync"), and commits them in one LMDB transaction, so
an index entry never becomes visible before its bytes are written (two-phase put).

A full map grows (up to `max_map_bytes`); `IndexFull` is raised to the callers only when it cannot,
and the store evicts. Reads run on the event loop thread under `_read_lock`, which the writer takes
only to resize the map (LMDB forbids resizing while a transaction of this process is open).
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import queue
import struct
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias

import lmdb
from lmdb.verify import VerifyError
from lmdb.verify import verify as verify_lmdb

from kvstore import faults

log = logging.getLogger(__name__)

# segment id, offset, header length, payload length, expiry (ms), last access (ms), class id; then the
# 16-byte parent key, one byte, the eviction policy's class of the block, and the u16 tenant id (entries
# written before these were kept are shorter, and read as no parent, class 0 and tenant 0)
_ENTRY = struct.Struct("<IQIIQQH")
_PARENT_BYTES = 16
_TENANT_ID = struct.Struct("<H")
TENANT_AT = _ENTRY.size + _PARENT_BYTES + 1  # offset of the tenant id in a packed entry
_EXPIRY = struct.Struct("<Q")
_EXPIRY_AT = 20  # offset of the expiry in a packed entry
_BATCH_MAX = 1024
# LMDB reports a write cut short by a full disk as EIO; with less free than this, that is what it was.
_SHORT_WRITE_FREE_BYTES = 64 * 2**20


class IndexFull(Exception):
    """The LMDB map is at its configured maximum; the caller should evict and retry."""


class IndexNoSpace(OSError):
    """The file system has no room for the pages a commit writes; nothing of it was applied.

    An OSError with errno ENOSPC, like a segment append that met a full disk."""

    def __init__(self, detail: str) -> None:
        super().__init__(errno.ENOSPC, f"no space left for an index commit ({detail})")


class IndexUnavailable(Exception):
    """The index cannot be opened (a file system error, or damage it could not be set aside for)."""


class IndexDamaged(IndexUnavailable):
    """The index files are not a readable LMDB database: a damaged page, or not LMDB at all.

    Nothing in them can be trusted, but every record in the segments describes itself, so the index can
    be rebuilt from them (`kvstore fsck --rebuild`, or a daemon at start-up; docs/operations.md)."""


# What LMDB says about files it cannot read as a database. A generic lmdb.Error is an errno (no space,
# no permission: the files may be fine) unless it names the data format, which py-lmdb reads from the
# meta page before LMDB sees the file.
_DAMAGE = (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.CorruptedError, lmdb.PanicError,
           lmdb.PageNotFoundError, lmdb.IncompatibleError)


def is_damage(exc: lmdb.Error) -> bool:
    """Whether an error from opening or reading an LMDB environment means its files are damaged."""
    return isinstance(exc, _DAMAGE) or (type(exc) is lmdb.Error and "data format" in str(exc))


@dataclass(frozen=True, slots=True)
class Entry:
    segment: int
    offset: int
    header_len: int
    payload_len: int
    expires_ms: int
    access_ms: int
    class_id: int
    parent: bytes = b""  # the prefix parent's key (the namespace digest for a first block); b"": unknown
    # what the eviction policy keeps for the block (EvictionPolicy.class_of); kept only with a parent
    policy_class: int = 0
    tenant_id: int = 0  # Index.tenant_id of the record's tenant; 0: a record without one (format 1)

    @property
    def record_len(self) -> int:
        return self.header_len + self.payload_len

    def pack(self) -> bytes:
        fixed = _ENTRY.pack(self.segment, self.offset, self.header_len, self.payload_len,
                            self.expires_ms, self.access_ms, self.class_id)
        if not (self.parent or self.tenant_id):
            return fixed
        parent = self.parent.ljust(_PARENT_BYTES, b"\x00")
        return fixed + parent + bytes([self.policy_class]) + _TENANT_ID.pack(self.tenant_id)

    @staticmethod
    def unpack(raw: bytes) -> Entry:
        end = _ENTRY.size + _PARENT_BYTES
        parent = bytes(raw[_ENTRY.size : end])
        segment, offset, header_len, payload_len, expires_ms, access_ms, class_id = _ENTRY.unpack_from(raw)
        return Entry(segment, offset, header_len, payload_len, expires_ms, access_ms, class_id,
                     b"" if parent == bytes(_PARENT_BYTES) else parent, raw[end] if len(raw) > end else 0,
                     tenant_id_of(raw))

    def with_access(self, access_ms: int, expires_ms: int, class_id: int | None = None) -> Entry:
        return replace(self, expires_ms=max(self.expires_ms, expires_ms), access_ms=max(self.access_ms, access_ms),
                       class_id=self.class_id if class_id is None else class_id)


def tenant_id_of(raw: bytes | memoryview) -> int:
    """The tenant id of a packed entry, without unpacking the rest (lookups filter on it)."""
    return _TENANT_ID.unpack_from(raw, TENANT_AT)[0] if len(raw) >= TENANT_AT + _TENANT_ID.size else 0


# The group commit's write transaction: opened without buffers=True, so its values are bytes (a string:
# lmdb's Transaction is generic only in its stubs)
Txn: TypeAlias = "lmdb.Transaction[bytes]"
Op = Callable[[Txn, Any], Any]


def structural_damage(path: Path) -> str:
    """Why the LMDB file in `path` is unsound ("" if it is sound, or not written yet).

    LMDB trusts every page it reads and can crash the process (SIGBUS) on a damaged one, so the file is
    first walked page by page in Python (lmdb.verify), which cannot (about 0.15 s per 100,000 entries).
    Raises OSError if the file cannot be read."""
    data = Path(path) / "data.mdb"
    if not data.exists() or data.stat().st_size == 0:  # LMDB makes a new database of an empty file
        return ""
    try:
        problems = verify_lmdb(str(path))
    except VerifyError as exc:
        return str(exc)
    if not problems:
        return ""
    return problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")


def _unavailable(path: Path, exc: lmdb.Error) -> IndexUnavailable:
    reason = str(exc).removeprefix(f"{path}: ")  # LMDB's messages start with the path
    if is_damage(exc):
        return IndexDamaged(f"the index at {path} is damaged ({reason})")
    return IndexUnavailable(f"cannot open the index at {path}: {reason}")


class Index:
    def __init__(self, path: Path, map_bytes: int, max_map_bytes: int, fsync: bool) -> None:
        """Open (or create) the index at `path`. Raises IndexDamaged when its files are not a readable
        LMDB database, IndexUnavailable when they cannot be opened for another reason."""
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            damage = structural_damage(path)
        except OSError as exc:
            raise IndexUnavailable(f"cannot read the index at {path}: {exc}") from None
        if damage:
            raise IndexDamaged(f"the index at {path} is damaged ({damage})")
        try:
            self._env = lmdb.open(str(path), mode=0o600, map_size=map_bytes, max_dbs=4, sync=fsync, metasync=fsync,
                                  readahead=False, max_readers=256, lock=True)
        except lmdb.Error as exc:
            raise _unavailable(path, exc) from None
        try:
            self._blocks = self._env.open_db(b"blocks")
            self._meta = self._env.open_db(b"meta")
        except lmdb.Error as exc:
            self._env.close()
            raise _unavailable(path, exc) from None
        self._max_map_bytes = max_map_bytes
        self._read_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="index-writer", daemon=True)
        self._writer.start()

    # -- reads (event loop thread) --------------------------------------------------------------

    def get(self, key: bytes) -> Entry | None:
        with self._read_lock, self._env.begin(db=self._blocks, buffers=False) as txn:
            raw = txn.get(key)
        return None if raw is None else Entry.unpack(raw)

    def get_many(self, keys: Sequence[bytes]) -> list[Entry | None]:
        with self._read_lock, self._env.begin(db=self._blocks, buffers=False) as txn:
            return [None if raw is None else Entry.unpack(raw) for raw in map(txn.get, keys)]

    def live_prefix(self, keys: Sequence[bytes], now_ms: int, extended: dict[bytes, tuple[int, int, int]],
                    tenants: frozenset[int] | None = None) -> int:
        """How many leading keys exist and expire after `now_ms` (or were extended past it), counting only
        blocks of `tenants` (ids) when given: another tenant's block is as absent as a missing one."""
        expiry = _EXPIRY.unpack_from
        with self._read_lock, self._env.begin(db=self._blocks, buffers=True) as txn:
            get = txn.get
            for i, key in enumerate(keys):
                raw = get(key)
                if raw is None:
                    return i
                if expiry(raw, _EXPIRY_AT)[0] <= now_ms and extended.get(key, (0, 0))[1] <= now_ms:
                    return i
                if tenants is not None and tenant_id_of(raw) not in tenants:
                    return i
        return len(keys)

    def live_each(self, keys: Sequence[bytes], now_ms: int, extended: dict[bytes, tuple[int, int, int]],
                  tenants: frozenset[int] | None = None) -> bytes:
        """For every key on its own, 1 if it exists and is live (as `live_prefix` judges each), else 0."""
        expiry = _EXPIRY.unpack_from
        out = bytearray(len(keys))
        with self._read_lock, self._env.begin(db=self._blocks, buffers=True) as txn:
            for i, key in enumerate(keys):
                raw = txn.get(key)
                if raw is None or (tenants is not None and tenant_id_of(raw) not in tenants):
                    continue
                out[i] = expiry(raw, _EXPIRY_AT)[0] > now_ms or extended.get(key, (0, 0))[1] > now_ms
        return bytes(out)

    def items(self) -> Generator[tuple[bytes, Entry], None, None]:
        """Every entry, in key order (start-up and tools; holds a read transaction while iterating)."""
        with self._read_lock, self._env.begin(db=self._blocks, buffers=False) as txn:
            for key, raw in txn.cursor():
                yield key, Entry.unpack(raw)

    def entries_from(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """Up to `limit` entries in key order, from the first key at or after `start`: a walk of the whole
        index a batch at a time (the scrub's), which holds no read transaction between batches."""
        out: list[tuple[bytes, Entry]] = []
        with self._read_lock, self._env.begin(db=self._blocks, buffers=False) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start):
                return out
            for key, raw in cursor:
                out.append((key, Entry.unpack(raw)))
                if len(out) >= limit:
                    break
        return out

    def classes(self) -> dict[str, int]:
        with self._read_lock, self._env.begin(db=self._meta) as txn:
            return {k[6:].decode(): int(v) for k, v in txn.cursor() if k.startswith(b"class:")}

    def tenants(self) -> dict[bytes, int]:
        """Tenant digest -> its small id in entries (ids from 1; 0 is a record without a tenant)."""
        with self._read_lock, self._env.begin(db=self._meta) as txn:
            return {bytes(k[7:]): int(v) for k, v in txn.cursor() if k.startswith(b"tenant:")}

    def fill_ratio(self) -> float:
        """Pages in use (all databases) over the largest map allowed; deletes need headroom too."""
        with self._read_lock, self._env.begin() as txn:
            pages = sum(stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
                        for stat in (txn.stat(self._blocks), txn.stat(self._meta), self._env.stat()))
            page_size = self._env.stat()["psize"]
        return pages * page_size / self._max_map_bytes

    def stat(self) -> dict[str, int]:
        info, stat = self._env.info(), self._env.stat()
        with self._env.begin(db=self._blocks) as txn:
            entries = txn.stat(self._blocks)["entries"]
        return {"map_bytes": info["map_size"], "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
                "entries": entries}

    # -- writes (through the writer thread) --------------------------------------------------

    def submit(self, op: Op, sync: Iterable[Any] = ()) -> concurrent.futures.Future:
        """Run `op(txn, blocks_db)` in the next group commit, after syncing `sync` (segments)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((op, tuple(sync), future))
        return future

    def put_op(self, key: bytes, entry: Entry) -> Op:
        def op(txn: Txn, db: Any) -> Entry | None:
            old = txn.get(key, db=db)
            txn.put(key, entry.pack(), db=db)
            return None if old is None else Entry.unpack(old)
        return op

    def remove_op(self, keys: Sequence[bytes], only_at: dict[bytes, tuple[int, int]] | None = None) -> Op:
        """Delete `keys`; a key in `only_at` only while its entry still points at that (segment, offset)."""
        def op(txn: Txn, db: Any) -> list[tuple[bytes, Entry]]:
            removed = []
            for key in keys:
                raw = txn.get(key, db=db)
                if raw is None:
                    continue
                entry = Entry.unpack(raw)
                if only_at and key in only_at and (entry.segment, entry.offset) != only_at[key]:
                    continue
                txn.delete(key, db=db)
                removed.append((key, entry))
            return removed
        return op

    def move_op(self, key: bytes, old_at: tuple[int, int], new_at: tuple[int, int], expires_ms: int) -> Op:
        """Point `key` at its copy in `new_at`, if it still points at `old_at`; True if it moved."""
        def op(txn: Txn, db: Any) -> bool:
            raw = txn.get(key, db=db)
            if raw is None:
                return False
            e = Entry.unpack(raw)
            if (e.segment, e.offset) != old_at:
                return False
            txn.put(key, replace(e, segment=new_at[0], offset=new_at[1],
                                 expires_ms=max(e.expires_ms, expires_ms)).pack(), db=db)
            return True
        return op

    def meta(self, name: bytes) -> bytes | None:
        with self._read_lock, self._env.begin(db=self._meta) as txn:
            return txn.get(name)

    def set_meta_op(self, name: bytes, value: bytes) -> Op:
        def op(txn: Txn, db: Any) -> None:
            txn.put(name, value, db=self._meta)
        return op

    def class_id(self, name: str) -> int:
        """The stable small id of a traffic class name, assigned on first use."""
        known = self.classes()
        if name in known:
            return known[name]
        return self.submit(self._assign_id_op(b"class:", name.encode(), first=0)).result()

    def tenant_id_op(self, tenant: bytes) -> Op:
        """Assign `tenant` (a 16-byte digest) its stable small id, or find the one it has."""
        return self._assign_id_op(b"tenant:", tenant, first=1)

    def _assign_id_op(self, prefix: bytes, name: bytes, first: int) -> Op:
        def op(txn: Txn, db: Any) -> int:
            existing = txn.get(prefix + name, db=self._meta)
            if existing is not None:
                return int(existing)
            new_id = first + sum(1 for k, _ in txn.cursor(db=self._meta) if k.startswith(prefix))
            if new_id > 0xFFFF:
                raise ValueError(f"more than 65535 distinct {prefix[:-1].decode()} names in one index")
            txn.put(prefix + name, str(new_id).encode(), db=self._meta)
            return new_id
        return op

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH_MAX:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = any(item is None for item in batch)
            # An op whose caller gave up before it ran is skipped; one that runs is seen through.
            live = [item for item in batch if item is not None and item[2].set_running_or_notify_cancel()]
            try:
                self._commit(live)
            except BaseException as exc:  # the writer must outlive any one batch
                if isinstance(exc, OSError):  # the disk's error, not the daemon's: a line an operator can act on
                    log.error("index commit failed: %s", exc)
                else:
                    log.exception("index commit failed")
                for _, _, future in live:
                    if not future.done():
                        future.set_exception(exc)
            if stopping:
                return

    def _commit(self, batch: list) -> None:
        if not batch:
            return
        try:
            for segment in {id(s): s for _, sync, _ in batch for s in sync}.values():
                if not segment.deleted:
                    os.fdatasync(segment.fd)
        except OSError as exc:
            for _, _, future in batch:
                future.set_exception(exc)
            return
        while True:
            results: list[tuple[concurrent.futures.Future, bool, Any]] = []
            try:
                with self._env.begin(write=True) as txn:
                    for op, _, future in batch:
                        try:
                            results.append((future, True, op(txn, self._blocks)))
                        except lmdb.MapFullError:
                            raise
                        except Exception as exc:  # one bad op fails alone
                            results.append((future, False, exc))
                    faults.hit("index.before_commit")
                faults.hit("index.after_commit")
            except lmdb.MapFullError:
                if self._grow():
                    continue
                for _, _, future in batch:
                    future.set_exception(IndexFull("LMDB map is full at lmdb_max_map_bytes"))
                return
            except (lmdb.Error, OSError) as exc:
                if not self._out_of_space(exc):
                    raise
                # The store decides what may use its reserved room (eviction); the writer only says why.
                for _, _, future in batch:
                    future.set_exception(IndexNoSpace(str(exc)))
                return
            for future, ok, value in results:
                future.set_result(value) if ok else future.set_exception(value)
            return

    def _out_of_space(self, exc: BaseException) -> bool:
        """Whether a failed commit failed for want of room on the file system."""
        if isinstance(exc, lmdb.DiskError):
            return True
        code = exc.errno if isinstance(exc, OSError) else getattr(exc, "code", 0)
        if code in (errno.ENOSPC, errno.EDQUOT):
            return True
        if code == errno.EIO or "Input/output error" in str(exc):
            fs = os.statvfs(self._env.path())
            return fs.f_bavail * fs.f_frsize < _SHORT_WRITE_FREE_BYTES
        return False

    def commit_bytes(self, keys: int) -> int:
        """At most how many bytes of fresh pages one commit that writes or deletes `keys` keys takes:
        each key's leaf and the branch pages above it (copy on write), plus free-list and meta pages."""
        with self._read_lock, self._env.begin() as txn:
            depth = max(txn.stat(self._blocks)["depth"], 1)
        return (keys * depth + 4) * self._env.stat()["psize"]

    def _grow(self) -> bool:
        current = self._env.info()["map_size"]
        if current >= self._max_map_bytes:
            return False
        new_size = min(current * 2, self._max_map_bytes)
        with self._read_lock:
            self._env.set_mapsize(new_size)
        log.info("LMDB map grown from %d to %d bytes", current, new_size)
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()
        try:
            self._env.sync(True)
        except lmdb.Error as exc:  # every commit was written already; only its flush to the disk is in doubt
            log.warning("syncing the index at close failed: %s", exc)
        finally:
            self._env.close()
