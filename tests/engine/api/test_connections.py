"""The HTTP server's connection bounds (engine/api/connections.py): half-sent
headers, too many connections from one client or in all, and streams nobody reads. A real uvicorn server
with the guarded protocol, on loopback, in front of a small app."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from engine.api.config import ApiConfig
from engine.api.connections import guarded
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

HANG_GUARD_S = 20.0  # a liveness bound on the test, not a speed claim


class Server:
    def __init__(self, config: ApiConfig) -> None:
        app = FastAPI()
        self.stream_ended = threading.Event()

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/stream")
        async def stream():
            async def chunks():
                try:
                    while True:
                        yield b"x" * 65536
                        await asyncio.sleep(0)
                finally:
                    self.stream_ended.set()  # cancelled: what the request held is freed
            return StreamingResponse(chunks())

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                                    http=guarded(config)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server starting", timeout_s=HANG_GUARD_S)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=HANG_GUARD_S)

    def healthy(self) -> bool:
        with self.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return sock.recv(4096).startswith(b"HTTP/1.1 200")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)


@pytest.fixture
def serve():
    started = []

    def start(**limits) -> Server:
        started.append(Server(ApiConfig(**limits)))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_a_half_sent_header_is_closed_after_the_header_timeout(serve):
    server = serve(header_timeout_s=0.5)
    idle = [server.connect() for _ in range(20)]
    for sock in idle:
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    silent = server.connect()  # not a byte
    assert all(closed_by_server(sock) for sock in [*idle, silent])
    assert server.healthy()


def test_connections_past_a_clients_cap_are_refused_and_the_rest_served(serve):
    server = serve(max_connections=64, max_connections_per_client=8, header_timeout_s=30)
    held = [server.connect() for _ in range(8)]
    extra = server.connect()
    assert closed_by_server(extra), "a ninth connection from one client must be refused"
    held.pop().close()
    deadline = time.monotonic() + HANG_GUARD_S
    while True:  # the freed slot is taken again once the server saw the close
        try:
            if server.healthy():
                break
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert time.monotonic() < deadline, "a freed connection slot never came back"
        time.sleep(0.05)
    for sock in held:
        sock.close()


def test_a_stream_its_client_does_not_read_is_ended(serve):
    server = serve(write_timeout_s=0.5)
    sock = server.connect()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
    assert server.stream_ended.wait(HANG_GUARD_S), "the unread stream kept its request alive"
    sock.close()
    assert server.healthy()
