"""The daemon's compact access log, for `kvstore analytics log`: one tab-separated line per block.

    time_ms  op  key  traffic_class  result  tier  bytes
    1764403200120  lookup  9f2c...  -  hit  -  0
    1764403200121  lookup  77ab...  -  missing  -  0
    1764403200123  get  9f2c...  chat  hit  dram  4194304
    1764403200130  put  77ab...  agent  stored  -  4198400

`key` is the daemon's keyed digest of the block key (kvstore/server/key_digest.py), never the key.
`op` is lookup (every key asked: the leading run "hit", the rest "missing"), get (each block read: hit
with its tier, or a miss cause such as expired or checksum) or put (stored or exists).
Written through a buffer and flushed by the maintenance loop; rotated once to `<path>.1` at a bound.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


class AccessLog:
    def __init__(self, path: Path, max_bytes: int, digest: Callable[[bytes], str]) -> None:
        self.path, self.max_bytes, self.digest = Path(path), max_bytes, digest
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = _open_private(self.path)
        self._size = self.path.stat().st_size

    def write(self, time_ms: int, op: str, key: bytes, traffic_class: str, result: str, tier: str, nbytes: int) -> None:
        line = f"{time_ms}\t{op}\t{self.digest(key)}\t{traffic_class or '-'}\t{result}\t{tier or '-'}\t{nbytes}\n"
        self._file.write(line)
        self._size += len(line)
        if self._size >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = _open_private(self.path)
        self._size = 0

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _open_private(path: Path):
    """Append to `path`, created readable by the daemon's user only (digests, but of every tenant's reads)."""
    return open(path, "a", buffering=1 << 16, opener=lambda name, flags: os.open(name, flags, 0o600))
