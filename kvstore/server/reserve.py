"""Room kept on the data directory's file system for the index commits that eviction needs.

Eviction frees disk space only once its LMDB commit has gone through, and a commit needs fresh pages:
on a full disk neither happens, and puts are wedged for good (docs/design.md section 10, invariant 6). A
file of preallocated bytes, `RESERVE` in the data directory, holds that room. It is given back when a
commit fails for want of space, so that eviction's commits go through, and taken again once eviction
and compaction have freed space. It survives restarts, so a daemon started on a full disk has it too.

On copy-on-write file systems (btrfs, ZFS) preallocated blocks are no promise of room; there the
reserve is best effort.

Thread-safety: `hold` and `release` run on I/O threads, one at a time.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


class SpaceReserve:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._size = self.path.stat().st_size  # the last run's reserve, its blocks still allocated
        except FileNotFoundError:
            self._size = 0

    @property
    def held_bytes(self) -> int:
        return self._size

    def hold(self, nbytes: int) -> bool:
        """Make sure at least `nbytes` are held; False if the file system has no room for them now.

        Raises OSError for any failure but a full file system."""
        with self._lock:
            if self._size >= nbytes:
                return True
            existed = self.path.exists()
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)  # a full tmpfs refuses even this
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
            except OSError as exc:
                if not existed:  # never leave a half-made reserve that looks held to the next run
                    self.path.unlink(missing_ok=True)
                if exc.errno in _NO_ROOM:
                    return False
                raise
            self._size = nbytes
            return True

    def release(self) -> int:
        """Give the reserved bytes back to the file system; how many (0 if none were held)."""
        with self._lock:
            freed, self._size = self._size, 0
            self.path.unlink(missing_ok=True)
            return freed
