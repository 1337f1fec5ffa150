"""`kvstore-server`: start the daemon, serve until SIGTERM/SIGINT, shut down gracefully."""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.proto import SERVICE
from kvstore.server.config import DEFAULT_DATA_DIR, ServerConfig, load_config
from kvstore.server.dataplane import DataPlaneServer
from kvstore.server.index import IndexUnavailable
from kvstore.server.limits import ByteBudget, CallLimiter
from kvstore.server.metrics import Metrics
from kvstore.server.registration import Registration
from kvstore.server.scrub import Scrubber
from kvstore.server.security import Security
from kvstore.server.service import KVStoreService
from kvstore.server.store import BlockStore, DataDirInUse
from kvstore.startup import StartupError, exit_at_startup, port_in_use, probe_port
from kvstore.stdin_watch import watch_stdin

log = logging.getLogger("kvstore.server")


class ShutdownError(Exception):
    """The daemon stopped, but its data directory could not be closed cleanly (an I/O error)."""


async def serve(config: ServerConfig, stop: asyncio.Event | None = None) -> None:
    try:
        security = Security.from_config(config)
    except ValueError as exc:  # AuthConfigError included
        raise StartupError(str(exc)) from None
    connections = grpc_connection_limit(config)  # first: raises the descriptor limit the store opens files under
    announce_data_dir(config)
    metrics = Metrics()
    try:
        store = BlockStore(config, metrics)  # it reads and makes files in the data directory too
        await store.open()
    except (DataDirInUse, IndexUnavailable) as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:  # a file where it should be, /proc, no permission, a read-only file system
        where = config.data_dir.resolve()
        not_a_dir = config.data_dir.exists() and not config.data_dir.is_dir()
        why = "a file is there, not a directory" if not_a_dir else exc.strerror or str(exc)
        inside = f" at {exc.filename}" if exc.filename and not not_a_dir and Path(exc.filename).resolve() != where \
            else ""
        raise StartupError(f"data directory {where} cannot be used ({why}{inside}): give --data-dir a directory "
                           "this user may write") from None  # the exit frees the lock, if it was taken
    server = grpc.aio.server(
        options=grpc_options(config, connections),
        # Calls are counted by CallLimiter instead of gRPC's own limit, which would count the health check too.
        maximum_concurrent_rpcs=None,
        interceptors=[*security.interceptors, CallLimiter(config)],  # tokens first: the limiter needs the principal
    )
    put_budget = ByteBudget(config.max_inflight_put_bytes, config.max_inflight_put_bytes_per_principal,
                            settings="max_inflight_put_bytes, max_inflight_put_bytes_per_principal")
    data_plane = DataPlaneServer(store, config, put_budget, security)
    metrics_port = None
    try:
        try:
            data_port = 0 if config.data_port is None else await data_plane.start(config.host, config.data_port)
        except OSError as exc:
            raise port_in_use("the data channel", "--data-port", config.host, config.data_port, exc) from None
        try:
            data_socket = "" if config.data_socket is None else await data_plane.start_unix(config.data_socket)
        except OSError as exc:
            raise StartupError(f"cannot listen on the data socket {config.data_socket} ({exc.strerror or exc}): "
                               "give --data-socket another path, or off") from None
        service = KVStoreService(store, config, put_budget, data_port, data_socket)
        server.add_generic_rpc_handlers([service.handler()])
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
        address = f"{config.host}:{config.port}"
        try:
            probe_port(config.host, config.port)  # OSError: gRPC's own bind would fail, and log a line of its own
            if security.grpc_credentials is not None:
                port = server.add_secure_port(address, security.grpc_credentials)
            else:
                port = server.add_insecure_port(address)
        except (OSError, RuntimeError) as exc:  # RuntimeError: gRPC says only that it failed to bind
            raise port_in_use("gRPC", "--port", config.host, config.port, exc) from None
        if port == 0:
            raise port_in_use("gRPC", "--port", config.host, config.port, OSError(0, "Address already in use"))
        if config.metrics_port is not None:  # last: nothing after it can fail, so it never needs stopping here
            from prometheus_client import start_http_server
            try:
                metrics_server, _ = start_http_server(config.metrics_port, addr=config.metrics_host,
                                                       registry=metrics.registry)
            except OSError as exc:
                raise port_in_use("/metrics", "--metrics-port", config.metrics_host, config.metrics_port,
                                  exc) from None
            metrics_port = metrics_server.server_port
    except StartupError:
        await data_plane.stop(0)
        await store.close()
        raise
    await server.start()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if config.port_file is not None:
        tmp = config.port_file.with_suffix(".tmp")
        tmp.write_text(f"{port}\n{metrics_port or ''}\n{data_port or ''}\n")
        os.replace(tmp, config.port_file)  # readers never see a half-written file
    log.info("kvstore-server serving on %s:%d (data channel %s, data socket %s, metrics %s, TLS %s, tokens %s), "
             "data in %s", config.host, port, data_port or "off", data_socket or "off", metrics_port or "off",
             "mutual" if config.tls_client_ca else "on" if config.tls else "off",
             "on" if security.authenticator else "off", config.data_dir)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    if config.exit_on_stdin_eof:
        watch_stdin(lambda: loop.call_soon_threadsafe(stop.set))
    report_stacks_on_signals(loop)
    maintenance = asyncio.create_task(store.retention.run())
    promotion = asyncio.create_task(store.promoter.run())
    scrub = asyncio.create_task(Scrubber(store, config, metrics).run())
    registration = None
    if config.register is not None:  # only once serving: a client that sees the entry can use it
        registration = Registration(config.register, config.advertised, config.register_ttl_s, config.etcd_access())
        registration.start()
    try:
        await stop.wait()
    finally:
        log.info("shutting down: draining RPCs for up to %.1f s", config.grace_s)
        if registration is not None:
            await loop.run_in_executor(None, registration.stop)
            if config.leave_drain_s:  # out of the membership, still serving: clients copy what they read
                log.info("left the membership; serving %.1f s more before the drain", config.leave_drain_s)
                await asyncio.sleep(config.leave_drain_s)
        await health_servicer.enter_graceful_shutdown()
        await asyncio.gather(server.stop(config.grace_s), data_plane.stop(config.grace_s))
        for task in (maintenance, promotion, scrub):
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        try:
            await store.close()  # a full disk is no error here: what cannot be saved is logged
        except OSError as exc:
            raise ShutdownError(f"stopped, but {config.data_dir} was not closed cleanly ({exc}); "
                                f"check it with `kvstore fsck {config.data_dir}` before the next start") from None
        log.info("stopped cleanly")


def report_stacks_on_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Where a daemon that does not stop hangs: SIGUSR1 prints every thread's stack to stderr (from C, so even
    while the event loop is blocked), SIGUSR2 logs every asyncio task's (a task waiting forever leaves the loop
    thread idle in its poll, and only the tasks' stacks say on what)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def log_tasks() -> None:
        for task in asyncio.all_tasks(loop):
            # by hand: Task.print_stack fails on a frame without a line number (one of uvloop's)
            frames = "\n".join(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
                                for frame in task.get_stack())
            log.warning("asyncio task %r:\n%s", task, frames)
    try:
        loop.add_signal_handler(signal.SIGUSR2, log_tasks)
    except (NotImplementedError, RuntimeError):  # not the main thread (tests)
        pass


def announce_data_dir(config: ServerConfig) -> None:
    """Say where the data goes where it is the default, ./data under the working directory: easy to miss."""
    if config.data_dir == DEFAULT_DATA_DIR:
        log.info("data directory %s: the default, ./data under the working directory (--data-dir, "
                 "KVSTORE_DATA_DIR or data_dir in the config file sets another)", config.data_dir.resolve())


def grpc_options(config: ServerConfig, connections: int) -> list[tuple[str, int]]:
    """gRPC core settings: message sizes, and what one connection or an idle client may hold."""
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_block_bytes + 2**20),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.http2.max_pings_without_data", 0),
        # One connection cannot take every call slot; HTTP/2 refuses streams past this.
        ("grpc.max_concurrent_streams", config.max_concurrent_rpcs_per_connection),
        # Connections past this are closed as they are accepted, so sockets never take the descriptors
        # segment files need; one that sends nothing is closed once the handshake (TLS, then the HTTP/2
        # preface and settings) is overdue, and one without calls once it has been idle a while.
        ("grpc.max_allowed_incoming_connections", connections),
        ("grpc.server_handshake_timeout_ms", round(config.grpc_handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", round(config.grpc_connection_idle_s * 1000)),
    ]


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the default soft limit, often 1,024, is far below
    what connections and segment files need); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft


def grpc_connection_limit(config: ServerConfig) -> int:
    """The gRPC connections allowed at once: `max_grpc_connections`, or fewer where the descriptor limit
    would otherwise let connections take what `fd_reserve` and the data channel's connections need."""
    limit = raise_descriptor_limit()
    room = limit - config.fd_reserve - config.max_data_connections
    if room < 1:
        raise StartupError(f"the descriptor limit (ulimit -n) is {limit}: fd_reserve ({config.fd_reserve}) and "
                           f"max_data_connections ({config.max_data_connections}) leave none for gRPC "
                           "connections; raise the limit or lower those settings")
    if room < config.max_grpc_connections:
        log.warning("the descriptor limit (ulimit -n) is %d: at most %d gRPC connections at once, not "
                    "max_grpc_connections = %d", limit, room, config.max_grpc_connections)
    return min(room, config.max_grpc_connections)


def tune_allocator() -> None:
    """Keep freed memory in the process instead of returning it to the OS, up to a bound.

    Fresh memory on these VMs costs ~3 us per 4 KiB page to fault in; glibc by default gives large
    freed blocks back (munmap, trim) and the next payload faults them in again. Linux glibc only.
    Up to 256 MiB free at the top of the heap is kept (several payloads' worth, for reuse); past that it
    is trimmed, so a burst does not stay in the daemon for good. The data channel keeps memory a client
    could make it hold (large heads, record payloads) out of the heap altogether, in anonymous mappings.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover - not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 256 * 2**20)
    libc.mallopt(m_trim_threshold, 256 * 2**20)


def run_loop(coro) -> None:
    """Run on uvloop where available (a dependency on Linux), else the default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ValueError as exc:
        exit_at_startup("kvstore-server", f"configuration error: {exc}")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_allocator()
    try:
        run_loop(serve(config))
    except StartupError as exc:
        exit_at_startup("kvstore-server", str(exc))
    except ShutdownError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
