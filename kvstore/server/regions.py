"""Shared memory a client on the daemon's host lends it for one data-channel connection."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import struct

from kvstore.server.data_connection import Peer
from kvstore.server.requests import RequestError

HUGETLBFS_MAGIC = 0x958458F6  # linux/magic.h
_libc = ctypes.CDLL(None, use_errno=True)


class Region:
    """Memory a Unix-socket client lent for one connection: a memfd it holds, sealed against shrinking."""

    def __init__(self, mapping: mmap.mmap, size: int) -> None:
        self.mapping, self.size = mapping, size
        self.view = memoryview(mapping)

    @staticmethod
    def adopt(fd: int, size: int, peer: Peer) -> Region:
        """Map `size` bytes of `fd`; RequestError unless it cannot shrink, is the peer's and is big enough.

        A shared mapping of a file that shrinks loses its pages: the next write into them is a SIGBUS."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a sealable object (a regular file, a socket)
        if not seals & fcntl.F_SEAL_SHRINK:
            raise RequestError("shared memory must be a memfd sealed against shrinking: memfd_create with "
                               "MFD_ALLOW_SEALING, ftruncate, then F_ADD_SEALS with F_SEAL_SHRINK")
        if _file_system(fd) == HUGETLBFS_MAGIC:
            # Seals do not keep a hugetlbfs file's pages: fallocate(PUNCH_HOLE) frees them all the same,
            # and the daemon's next write into them is a SIGBUS.
            raise RequestError("shared memory must not be huge pages (MFD_HUGETLB): sealing cannot keep "
                               "their pages mapped; use a plain memfd")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != peer.uid:
            raise RequestError("shared memory must be a memfd created by the registering client")
        if info.st_size < size:
            raise RequestError(f"the memory holds {info.st_size} bytes, fewer than the {size} registered")
        try:
            mapping = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:  # write-sealed, or read-only
            raise RequestError(f"cannot map the memory for writing: {exc}") from None
        return Region(mapping, size)

    def close(self) -> None:
        self.view.release()
        try:
            self.mapping.close()
        except BufferError:  # a read cut short still holds a view of it: unmapped when that goes
            pass


def _file_system(fd: int) -> int:
    """The magic number of the file system `fd` is on (statfs.f_type), or 0 if it cannot be told."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs, f_type first; 120 bytes on 64-bit Linux
    if _libc.fstatfs(fd, buffer) != 0:
        return 0
    return struct.unpack_from("l", buffer.raw)[0] & 0xFFFFFFFF
