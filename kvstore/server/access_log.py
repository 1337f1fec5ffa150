"""The daemon's compact access log, for `kvstore analytics log`: one tab-separated line per block.

    time_ms  op  key  traffic_class  result  tier  bytes
    1764403200120  lookup  9f2c...  -  hit  -  0
    1764403200121  lookup  77ab...  -  missing  -  0
    1764403200123  get  9f2c...  chat  hit  dram  4194304
    1764403200130  put  77ab...  agent  stored  -  4198400

`key` is the daemon's keyed digest of the block key (kvstore/server/key_digest.py), never the key.
`op` is lookup (every key asked: the leading run "hit", the rest "missing"), get (each block read: hit
with its tier, or a miss cause such as expired or checksum), put (stored or exists) or remove (why the
block went: evicted, expired, deleted or corrupt).

A remove line is written through to the file (the OS) before the removal commits, not queued: a crash of
the daemon never loses the line of a removal that took effect, so the log tells every block the daemon
let go from one it lost. A removal the crash stopped may be logged although its block stays.

The event loop only queues a line's fields; a thread of its own digests, formats and writes them, so a
call of 65,536 keys costs the loop a few milliseconds, not a fifth of a second. What one call may log is
capped (KEYS_PER_CALL; a Lookup's keys beyond it are not logged), and so is the queue (MAX_QUEUED lines): a
log that cannot keep up drops lines and counts them (`dropped`, the metric
kvstore_access_log_dropped_lines), it never holds the daemon up or grows without bound. Flushed by the
maintenance loop; rotated once to `<path>.1` at a bound.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from pathlib import Path

KEYS_PER_CALL = 4096  # lines one Lookup may log; engines ask for far fewer keys than this
MAX_QUEUED = 1 << 18  # lines waiting for the writer thread: about 40 MiB of fields at the most
Line = tuple[int, str, bytes, str, str, str, int]


class AccessLog:
    def __init__(self, path: Path, max_bytes: int, digest: Callable[[bytes], str]) -> None:
        self.path, self.max_bytes, self.digest = Path(path), max_bytes, digest
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = _open_private(self.path)
        self._size = self.path.stat().st_size
        self.dropped = 0  # lines not logged: past a call's cap, or with the queue full
        self._queue: collections.deque[Line] = collections.deque()
        self._wake = threading.Condition()
        self._file_lock = threading.Lock()  # the writer thread's lines and `write_through`'s, one at a time
        self._flush_wanted = self._closing = False
        self._writer = threading.Thread(target=self._run, name="kvstore-access-log", daemon=True)
        self._writer.start()

    def write(self, time_ms: int, op: str, key: bytes, traffic_class: str, result: str, tier: str, nbytes: int) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.append((time_ms, op, key, traffic_class, result, tier, nbytes))
        if len(self._queue) == 1:
            with self._wake:
                self._wake.notify()

    def write_through(self, time_ms: int, op: str, keys: list[tuple[bytes, str]], result: str) -> None:
        """One line per (key, traffic class), written to the file before this returns (on the caller's
        thread: a removal's few lines, once per commit)."""
        if not keys:
            return
        lines = "".join(f"{time_ms}\t{op}\t{self.digest(key)}\t{traffic_class or '-'}\t{result}\t-\t0\n"
                        for key, traffic_class in keys)
        with self._file_lock:
            self._write(lines)
            self._file.flush()

    def skipped(self, lines: int) -> None:
        """`lines` a call did not log, being past its cap."""
        self.dropped += lines

    def flush(self) -> None:
        """Have the writer write out what is queued and flush the file (it returns at once)."""
        with self._wake:
            self._flush_wanted = True
            self._wake.notify()

    def close(self) -> None:
        """Write out everything queued, then close the file."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._writer.join()
        with self._file_lock:
            self._file.close()

    # -- the writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue or self._flush_wanted or self._closing, timeout=1.0)
                flush, self._flush_wanted = self._flush_wanted, False
                closing = self._closing
            self._drain()
            if flush or closing:
                with self._file_lock:
                    self._file.flush()
            if closing:
                return

    def _drain(self) -> None:
        while self._queue:
            time_ms, op, key, traffic_class, result, tier, nbytes = self._queue.popleft()
            line = (f"{time_ms}\t{op}\t{self.digest(key)}\t{traffic_class or '-'}\t{result}\t{tier or '-'}\t"
                    f"{nbytes}\n")
            with self._file_lock:
                self._write(line)

    def _write(self, lines: str) -> None:
        self._file.write(lines)
        self._size += len(lines)
        if self._size >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = _open_private(self.path)
        self._size = 0


def _open_private(path: Path):
    """Append to `path`, created readable by the daemon's user only (digests, but of every tenant's reads)."""
    return open(path, "a", buffering=1 << 16, opener=lambda name, flags: os.open(name, flags, 0o600))
