"""How a process that cannot start as configured ends: one line on stderr, `PROG: what to change`, and exit
status 2, as a bad flag ends it; never a traceback. A port in use, a data directory that cannot be one, a bad
setting: the operator's to fix, and one line says how. kvstore-server and kvstore-api (and every process
configured through kvstore/settings.py) end so.

Imports only the standard library: the daemon, which never imports torch, uses it.
"""

from __future__ import annotations

import socket
import sys
from typing import NoReturn

EXIT_STATUS = 2  # argparse's for a bad flag: a start-up mistake is the same kind of mistake


class StartupError(Exception):
    """The process cannot start as configured; the message says what to change."""


def exit_at_startup(prog: str, message: str) -> NoReturn:
    """End the process with `PROG: MESSAGE` as one line on stderr and exit status 2."""
    line = " ".join(str(message).split())  # one line, whatever the message's source put in it
    print(f"{prog}: {line}", file=sys.stderr, flush=True)
    sys.exit(EXIT_STATUS)


def port_in_use(what: str, flag: str, host: str, port: int | None, error: BaseException) -> StartupError:
    """The error for a port that cannot be listened on: which one, why, and the setting that moves it."""
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return StartupError(f"cannot listen on {host}:{port} for {what} ({reason}): stop what holds it, or give "
                        f"{flag} another port (0: the OS picks one)")


def probe_port(host: str, port: int) -> None:
    """Raise the OSError of binding `host`:`port` where none of the addresses `host` resolves to can be bound
    (as gRPC's bind would fail); return where one can, for port 0, and for a name that does not resolve (gRPC
    then says why). gRPC tells such a failure only as "Failed to bind", and its core first logs a line of its
    own on stderr: a start-up mistake would take two lines, the first of them not ours."""
    if not port:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    failure: OSError | None = None
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                probe.bind(address)
            return
        except OSError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
