"""An identity of this host (and boot), so a client can tell that a daemon runs beside it: then it uses the
daemon's Unix socket (Info.data_socket), where shared memory is offered, when it can connect to it."""

from __future__ import annotations

import functools
import socket


@functools.cache
def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: shared memory is not offered
        return ""
    return f"{socket.gethostname()}/{boot}"
