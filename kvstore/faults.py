"""Named fault-injection points, off by default (the 3FS habit).

Production code calls `faults.hit("segment.after_write")` at places where a crash or an error must be
survivable: a put's steps (`segment.*`, `index.*`), a read (`segment.read`), compaction's (`compaction.copied`,
`compaction.moved`, `compaction.before_delete`). A test switches a point on for a daemon through the environment
(`KVSTORE_FAULTS="segment.after_write=kill@3"`: SIGKILL the process on the third hit). Actions: `kill`
(SIGKILL self), `raise` (OSError), `enospc`; and at points that hold bytes (`damaged`), `flip`: one byte of
them inverted, at the nth hit only (memory gone bad under the daemon, once).
"""

from __future__ import annotations

import errno
import mmap
import os
import signal

Bytes = bytes | bytearray | memoryview | mmap.mmap

_points: dict[str, tuple[str, int]] = {}
_hits: dict[str, int] = {}


def _parse(spec: str) -> dict[str, tuple[str, int]]:
    points = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, action = item.partition("=")
        action, _, nth = action.partition("@")
        if action not in ("kill", "raise", "enospc", "flip"):
            raise ValueError(f"KVSTORE_FAULTS: unknown action {action!r} in {item!r} (kill, raise, enospc, flip)")
        points[name] = (action, int(nth or 1))
    return points


_points.update(_parse(os.environ.get("KVSTORE_FAULTS", "")))


def hit(point: str) -> None:
    """Fire the fault configured for `point`, if any; a no-op dictionary miss otherwise."""
    if not _points or point not in _points:
        return
    action, nth = _points[point]
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] < nth or action == "flip":  # flip needs the bytes: `damaged`
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"injected ENOSPC at {point}")
    raise OSError(errno.EIO, f"injected I/O error at {point}")


def damaged(point: str, data: Bytes) -> Bytes:
    """`data`, or at the nth hit of a `flip` point a copy of it with its middle byte inverted; other actions
    as `hit`."""
    if not _points or point not in _points:
        return data
    action, nth = _points[point]
    if action != "flip":
        hit(point)
        return data
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] != nth or not len(data):
        return data
    copy = bytearray(data)
    copy[len(copy) // 2] ^= 0xFF
    return copy
