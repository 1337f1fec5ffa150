"""One decode instance as a process: a serving loop behind gRPC (proto/decode.proto).

    python -m engine.serving.instance --model DIR [--port 0] [--servers HOST:PORT,...] [--auth-tokens FILE]
                                      [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]] [--exit-on-stdin-eof]
                                      [--store-token T --store-tls-ca PEM ...]   (secured daemons)

It loads the model, listens on HOST:PORT (0: a free port) and, once it serves, prints exactly one line,
`READY <port>`, on stdout (flushed); everything else it says goes to stderr. With --servers the instance
is a client of the store: every prompt goes through its prefill engine, which loads what the daemons hold
of it (or, with from_handoff, continues what a prefill process handed over), and the reply's blocks are
saved for the next turn. Several instances behind `engine.decode.router` are the decode tier
(`engine.serving.processes` starts them, `engine.serving.client` talks to them).

Shut down by SIGTERM or SIGINT, or with --exit-on-stdin-eof by the end of stdin (a parent that holds the
pipe died or closed it): the health check says NOT_SERVING, new calls are refused, every request in
flight ends with finish_reason "cancelled" on its stream, and the process exits 0. If the engine fails on
one request (its sampling or drafting raised), that request alone ends INTERNAL and the others go on; if
it fails a step, every request in flight ends INTERNAL and the process exits 1: its state is not to be
trusted, and its supervisor starts a fresh one. SIGUSR1 dumps every thread's stack to stderr (a hung instance).

Threads: the main one runs the event loop of the gRPC server (and handles the signals); the serving
loop's thread owns the engines.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TextIO

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.model.decoder import Decoder
from engine.model.weights import model_identity
from engine.prefill import PrefillConfig, PrefillEngine
from engine.serving.config import InstanceConfig, parse_args
from engine.serving.loop import ServingLoop
from engine.serving.proto import SERVICE
from engine.serving.service import DecodeService, verb_of
from kvstore.server.auth import AuthConfigError, Authenticator
from kvstore.server.grpc_auth import TokenInterceptor, server_credentials
from kvstore.stdin_watch import watch_stdin

log = logging.getLogger("engine.serving.instance")

GRACE_S = 5.0  # at shutdown, how long the streams in flight have to deliver their cancelled results


class StartupError(Exception):
    """The instance cannot start as configured (a token file, a certificate, a port)."""


def serve(config: InstanceConfig, ready: TextIO | None = None) -> int:
    """Load the model, listen, announce `READY <port>` on `ready` (stdout), serve until shut down; the exit
    status."""
    try:
        authenticator = Authenticator.from_file(config.auth_tokens) if config.auth_tokens else None
        credentials = None
        if config.tls_cert is not None and config.tls_key is not None:  # InstanceConfig: both or neither
            credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    except (AuthConfigError, OSError) as exc:
        raise StartupError(str(exc)) from None
    _warn_if_exposed(config, authenticator is not None, credentials is not None)
    torch.set_num_threads(config.threads)
    model = Decoder.from_pretrained(config.model, config.dtype)
    prefill = None
    if config.servers:  # the prefill engine shares its page pool with the decode engine
        from kvstore.client import KVClient

        prefill = PrefillEngine(model, KVClient(config.store_client()),
                                PrefillConfig(block_tokens=config.block_tokens, kv_pages=config.kv_pages,
                                              kv_codec=config.kv_codec),
                                model_identity(config.model))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    interceptors = [TokenInterceptor(authenticator, verb_of)] if authenticator else []
    return asyncio.run(_serve(config, model, prefill, interceptors, credentials, ready or sys.stdout))


async def _serve(config: InstanceConfig, model: Decoder, prefill: PrefillEngine | None, interceptors: list,
                 credentials: grpc.ServerCredentials | None, ready: TextIO) -> int:
    loop = asyncio.get_running_loop()
    stop, status = asyncio.Event(), [0]

    def failed(_: Exception) -> None:  # the engine thread
        status[0] = 1
        loop.call_soon_threadsafe(stop.set)

    serving = ServingLoop(model, prefill, config.decode_config(), on_fault=failed, max_calls=config.max_calls,
                          max_calls_per_principal=config.max_calls_per_principal)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_message_bytes),
                                      ("grpc.so_reuseport", 0)], interceptors=interceptors)
    server.add_generic_rpc_handlers([DecodeService(serving).handler()])
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    reflection.enable_server_reflection(
        [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    port = add_port(server, address, credentials)
    if port == 0:
        serving.close()
        raise StartupError(f"cannot listen on {address}")
    await server.start()
    await checks.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.exit_on_stdin_eof:
        watch_stdin(lambda: loop.call_soon_threadsafe(stop.set))
    print(f"READY {port}", file=ready, flush=True)
    await stop.wait()
    await checks.enter_graceful_shutdown()
    stopping = asyncio.ensure_future(server.stop(GRACE_S))  # refuses new calls; those in flight go on meanwhile
    await asyncio.to_thread(serving.close)  # each request in flight ends "cancelled" on its stream
    await stopping
    if prefill is not None:
        await asyncio.to_thread(prefill.flush, GRACE_S)  # the replies' blocks still on their way to the store
        if prefill.client is not None:
            prefill.client.close()
    return status[0]


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on `address` (TLS with `credentials`); the port, or 0 where it cannot (taken, or not an address)."""
    try:
        return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        return 0


def _warn_if_exposed(config: InstanceConfig, tokens: bool, tls: bool) -> None:
    if config.loopback_only:
        return
    if not tokens:
        log.warning("this decode instance listens on %s WITHOUT AUTHENTICATION: anyone who reaches it can spend "
                    "its engine and, with a store, read and write any tenant's blocks. Set --auth-tokens (and "
                    "--tls-cert/--tls-key).", config.host)
    elif not tls:
        log.warning("this decode instance listens on %s without TLS: tokens, prompts and replies cross the network "
                    "in clear. Set --tls-cert and --tls-key.", config.host)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return serve(config)
    except StartupError as exc:
        print(f"decode instance: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
