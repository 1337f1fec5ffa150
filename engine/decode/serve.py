"""One decode instance as a process: a DecodeEngine behind newline-delimited JSON over TCP.

    python -m engine.decode.serve --model PATH [--port 0] [--kv-pages N] [--block-tokens B] [--max-running M]
                                  [--prefill-tokens-per-step P] [--threads T] [--max-line-bytes L]
                                  [--exit-on-stdin-eof] [--servers HOST:PORT,...]

With --servers the instance is a client of the store: every prompt goes through its prefill engine, which
loads what the daemons hold of it, and the reply's blocks are saved for the next turn; a generate with
"from_handoff": true continues from the state a prefill process handed over (`engine.prefill.handoff`), and its
"done" says how the prompt's KV came ("prefill_path": "handed_over", or the fallback's path). Without it,
prompts are computed here and nothing is saved.

It loads the model, listens on 127.0.0.1:PORT (0: a free port) and, once it can serve, prints exactly one
line, `READY <port>`, on stdout (flushed); everything else it says goes to stderr. Several such processes
behind `engine.decode.router` are the decode tier (`engine.decode.instances` starts and talks to them).

Protocol: each message is one JSON object on one line (UTF-8, `\\n`-terminated), both ways. A client may
keep any number of requests in flight on one connection; replies come when ready, matched by `id`.

    -> {"op": "generate", "id": ID, "prompt": [token ids], "max_tokens": N or null,
        optional "temperature", "top_k", "top_p", "seed", "stop_token_ids"   (see SamplingParams),
        and with --servers "from_handoff", "salt", "traffic_class", "session_id"   (see PrefillRequest)}
    <- {"op": "done", "id": ID, "tokens": [...], "finish_reason": "...", "token_times_s": [...],
        "prompt_tokens": N, "preemptions": N, "prefill_path": "..." or null}
    -> {"op": "cancel", "id": ID}        <- the request's "done", finish_reason "cancelled"
    -> {"op": "load"}                    <- {"op": "load", "running": .., "waiting": .., "kv_tokens": ..,
                                             "queued_tokens": .., "kv_capacity": ..}   (at once)
    -> {"op": "shutdown"}                <- "done" (cancelled) for every request in flight, then
                                            {"op": "shutdown"}, and the process exits 0
    <- {"op": "error", "id": ID or null, "message": "..."}   for one bad line or request alone

ID is a string or an integer chosen by the client, unique among its connection's requests in flight;
`token_times_s` are seconds from the engine's submit to each token. `kv_tokens` is the KV held by running
sequences as of the engine's last step; `waiting` counts requests not admitted yet, those received but not
yet submitted included, and `queued_tokens` their prompt tokens (for submitted ones: the newest `waiting`
requests' prompts, exact unless some were preempted), so a router sees a request it placed at once;
`kv_capacity` is pages x block tokens. Unknown fields are errors (a typo must not silently fall back to a
default); stop strings are refused (the instance has no tokenizer). A line longer than --max-line-bytes
is discarded up to its newline and answered with an error, so a client cannot make the instance buffer
without bound. A connection's end (EOF) cancels its requests in flight: nobody is left to read them.
SIGTERM or SIGINT shut down like the shutdown op; with --exit-on-stdin-eof so does the end of stdin, so
instances started by a parent die with it. SIGUSR1 dumps every thread's stack to stderr (a hung instance).

Threads: the engine is not thread-safe, so one thread (the main one) owns it and does all engine work.
Per connection a reader thread parses and validates lines into an inbox queue, and a writer thread sends
replies, so neither a slow socket nor a slow step blocks the other: the engine thread drains the inbox
(a bounded number of messages) between steps, steps while anything is pending, and blocks on the inbox
only when the engine is idle. Load queries do not wait for a step: the reader answers them from the state
the engine thread publishes after every step (a router asks all instances before each placement, and a
long prefill step must not hold it up). Replies to one connection keep the order of its requests only
among load replies; "done" and "error" replies come when ready.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.decode.config import DecodeConfig
from engine.decode.engine import DecodeEngine
from engine.decode.protocol import ProtocolError, is_int, parse_line, prompt_tokens
from engine.decode.request import DecodeError, DecodeRequest, DecodeResult
from engine.model.decoder import Decoder
from engine.model.weights import model_identity
from engine.prefill import PrefillConfig, PrefillEngine
from kvstore.client import KVClient

MAX_LINE_BYTES = 2**20  # a 1 MiB line holds a prompt of >100k token ids: past these models' contexts
MAX_OUTBOX = 4096  # replies queued for one client; past that it is not reading them, and it is dropped
DRAIN_PER_STEP = 256  # inbox messages handled between two steps: a flood of messages cannot starve decoding


@dataclass(frozen=True)
class ServeConfig:
    """Everything one instance process is started with."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, announced on the READY line
    kv_pages: int = 512
    block_tokens: int = 256
    max_running: int = 64
    prefill_tokens_per_step: int = 2048
    threads: int = 1  # torch threads: several instances share a machine's cores, so one each by default
    max_line_bytes: int = MAX_LINE_BYTES
    exit_on_stdin_eof: bool = False
    servers: tuple[str, ...] = ()  # the store's daemons (host:port); none: no store

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        if not self.model.is_dir():
            raise ValueError(f"ServeConfig: model must be a model directory (config.json + weights), got {self.model}")
        for name in ("kv_pages", "block_tokens", "max_running", "prefill_tokens_per_step", "threads",
                     "max_line_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServeConfig: {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"ServeConfig: port must be an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"ServeConfig: host must be a non-empty string, got {self.host!r}")
        object.__setattr__(self, "servers", tuple(self.servers))
        if not all(isinstance(s, str) and s.rpartition(":")[2].isdigit() for s in self.servers):
            raise ValueError(f"ServeConfig: servers must be host:port addresses, got {self.servers!r}")

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(max_running=self.max_running, prefill_tokens_per_step=self.prefill_tokens_per_step,
                            kv_pages=self.kv_pages, block_tokens=self.block_tokens)


def _thread(target: Any, name: str, *args: Any) -> threading.Thread:
    """A daemon thread that leaves SIGTERM and SIGINT to the main thread.

    The kernel hands a process signal to any thread that does not block it; CPython then only sets a flag
    and runs the handler in the main thread when that thread next wakes, so a main thread idle on the
    inbox would not see the signal. Blocked here, the signal goes to the main thread and wakes it."""

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


# -- connections --------------------------------------------------------------------------------------------

class Connection:
    """One client: its socket, a writer thread that sends queued replies, and its requests in flight."""

    _CLOSE = object()

    def __init__(self, sock: socket.socket, number: int) -> None:
        self.sock, self.number = sock, number
        self.alive = True  # False once it ended or a send failed: its replies are dropped
        self.requests: dict[str | int, int] = {}  # client id -> engine id of its requests in flight (engine thread)
        # bounded: a client that sends (loads, say) but never reads must not grow the instance's memory
        self._outbox: queue.Queue = queue.Queue(MAX_OUTBOX)
        self._writer = _thread(self._write, f"writer-{number}")

    def send(self, message: dict) -> None:
        """Queue a reply (from any thread; never waits on the socket)."""
        if self.alive:
            try:
                self._outbox.put_nowait(message)
            except queue.Full:
                self._drop()

    def close(self) -> None:
        """Send what is queued, then close (from any thread)."""
        try:
            self._outbox.put_nowait(self._CLOSE)
        except queue.Full:
            self._drop()
            self._outbox.put(self._CLOSE)  # the writer, failing its sends now, drains the queue

    def _drop(self) -> None:
        """The client does not read its replies: end the connection (its reader sees the end and its
        requests in flight are cancelled)."""
        self.alive = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def join(self, timeout: float) -> None:
        self._writer.join(timeout)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not self._CLOSE:
            if not self.alive:
                continue
            try:
                self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            except OSError:
                self.alive = False  # the peer is gone; its reader sees the end and its requests are cancelled
        self.alive = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes its reader, if still reading
        except OSError:
            pass
        self.sock.close()


def _error(rid: Any, message: str) -> dict:
    return {"op": "error", "id": rid if (is_int(rid) or isinstance(rid, str)) else None, "message": message}


# -- the instance -------------------------------------------------------------------------------------------

_SHUTDOWN = ("shutdown", None, None, None)  # inbox item: stop serving (signal, stdin's end, or the op)


class Instance:
    """The engine thread's state: the engine, the inbox, and the requests in flight."""

    def __init__(self, config: ServeConfig, engine: DecodeEngine, listener: socket.socket) -> None:
        self.config, self.engine, self.listener = config, engine, listener
        # SimpleQueue: its put is reentrant, so the SIGTERM handler may put while the main thread is in get
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.inflight: dict[int, tuple[Connection, str | int, int]] = {}  # engine id -> (conn, client id, prompt)
        self.order: list[int] = []  # engine ids in flight, in submit order: the newest are the waiting ones
        self.connections: set[Connection] = set()
        self._lock = threading.Lock()  # guards `connections` between the accept and the engine thread
        self._stopping = False
        # Load is answered by the reader threads at once, not by the engine thread between steps: a router
        # asks every instance before each placement and must not wait for the slowest one's step. So the
        # engine thread publishes its state after each batch of messages and each step, and the readers add
        # the generates they have queued but the engine has not taken yet.
        self._load_lock = threading.Lock()
        self._published = {"running": 0, "waiting": 0, "kv_tokens": 0, "queued_tokens": 0}
        self._unsubmitted = [0, 0]  # generates in the inbox or taken since the last publish: requests, tokens
        self._taken = [0, 0]  # engine thread: generates taken from the inbox since the last publish
        self._capacity = engine.pool.num_pages * engine.pool.block_tokens
        self.context = engine.model.config.max_position_embeddings

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    # -- threads that feed the inbox --

    def start_threads(self) -> None:
        _thread(self._accept, "accept")
        if self.config.exit_on_stdin_eof:
            _thread(self._watch_stdin, "stdin")

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # the listener was closed: shutting down
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # replies are small and latency-bound
            conn = Connection(sock, number := number + 1)
            with self._lock:
                if self._stopping:
                    conn.close()
                    continue
                self.connections.add(conn)
            _thread(self._read, f"reader-{number}", conn)

    def _read(self, conn: Connection) -> None:
        limit = self.config.max_line_bytes
        stream = conn.sock.makefile("rb")
        try:
            while line := stream.readline(limit + 1):  # at most limit + 1 bytes held, however long the line
                if len(line) > limit and not line.endswith(b"\n"):  # longer than allowed: skip to its end
                    while line and not line.endswith(b"\n"):
                        line = stream.readline(limit + 1)
                    conn.send(_error(None, f"line longer than {limit} bytes: discarded"))
                    continue
                if not line.strip():
                    continue
                try:
                    op, message, request = parse_line(line, bool(self.config.servers))
                except (ProtocolError, DecodeError) as e:
                    rid = None
                    try:
                        rid = json.loads(line).get("id")
                    except Exception:
                        pass
                    conn.send(_error(rid, str(e)))
                    continue
                if op == "load":
                    conn.send(self.load())
                    continue
                if op == "generate" and prompt_tokens(request) >= self.context:  # before it queues anything
                    conn.send(_error(message["id"], f"prompt of {prompt_tokens(request)} tokens leaves no room "
                                                    f"for a reply in the model's context of {self.context}"))
                    continue
                if op == "generate":
                    with self._load_lock:
                        self._unsubmitted[0] += 1
                        self._unsubmitted[1] += prompt_tokens(request)
                self.inbox.put((op, conn, message, request))
        except OSError:
            pass  # reset by the peer, or shut down by us: the same as its end
        finally:
            self.inbox.put(("closed", conn, None, None))

    def _watch_stdin(self) -> None:
        # the raw descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader aborts the
        # interpreter's exit (it cannot take the buffer's lock)
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except (OSError, ValueError):
            pass
        self.inbox.put(_SHUTDOWN)

    def request_shutdown(self, *_: Any) -> None:
        """Signal handler: the engine thread shuts down after its current step."""
        self.inbox.put(_SHUTDOWN)

    # -- the engine thread --

    def run(self) -> int:
        """Serve until shutdown; the exit status."""
        while not self._stopping:
            # block only when idle: with work pending the engine steps after draining what has arrived
            item = self._wait() if not self.engine.pending else self._poll()
            handled = 0
            while item is not None:
                self._handle(*item)
                if self._stopping:
                    return 0
                handled += 1
                item = self._poll() if handled < DRAIN_PER_STEP else None
            self._publish()
            if self.engine.pending:
                try:
                    results = self.engine.step()
                except Exception:  # an engine bug, not a bad request: tell every client, then exit non-zero
                    message = "decode instance failed: " + traceback.format_exc(limit=3)
                    print(message, file=sys.stderr, flush=True)
                    for conn, rid, _ in self.inflight.values():
                        conn.send(_error(rid, message))
                    self._close_all()
                    return 1
                for result in results:
                    self._finished(result)
                self._publish()
        return 0

    def _wait(self) -> tuple | None:
        try:
            # the timeout is a fallback only: a signal that reached another thread (one torch started, say)
            # runs its handler once the main thread wakes
            return self.inbox.get(timeout=1.0)
        except queue.Empty:
            return None

    def _poll(self) -> tuple | None:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, op: str, conn: Connection | None, message: dict | None, request: DecodeRequest | None) -> None:
        if op == "generate":
            # taken off the readers' count only when the engine's next published state includes it
            self._taken[0] += 1
            self._taken[1] += prompt_tokens(request)
            rid = message["id"]
            if rid in conn.requests:
                conn.send(_error(rid, f"id {rid!r} is already in flight on this connection"))
                return
            try:
                eid = self.engine.submit(request)
            except DecodeError as e:
                conn.send(_error(rid, str(e)))
                return
            conn.requests[rid] = eid
            self.inflight[eid] = (conn, rid, prompt_tokens(request))
            self.order.append(eid)
        elif op == "cancel":
            rid = message["id"]
            if rid not in conn.requests or not self.engine.cancel(conn.requests[rid]):
                conn.send(_error(rid, f"no request {rid!r} in flight on this connection"))
            # the "done" (cancelled) comes with the next step's results
        elif op == "closed":
            for eid in list(conn.requests.values()):
                self.engine.cancel(eid)  # nobody is left to read them: free their KV now
            conn.alive = False
            with self._lock:
                self.connections.discard(conn)
            conn.close()
        elif op == "shutdown":
            self._shutdown(conn)

    def _publish(self) -> None:
        """Engine thread: the state load replies report, as of now."""
        engine = self.engine
        # the newest `waiting` requests are not admitted yet (admission is first come, first served)
        waiting_ids = self.order[len(self.order) - engine.waiting:] if engine.waiting else []
        state = {"running": engine.running, "waiting": engine.waiting, "kv_tokens": engine.kv_tokens,
                 "queued_tokens": sum(self.inflight[e][2] for e in waiting_ids)}
        with self._load_lock:  # one swap: a reader never sees a request in neither count nor in both
            self._published = state
            self._unsubmitted = [self._unsubmitted[0] - self._taken[0], self._unsubmitted[1] - self._taken[1]]
        self._taken = [0, 0]

    def load(self) -> dict:
        """Any thread: the load message, as of the engine's last step plus the generates not yet taken."""
        with self._load_lock:
            state, (requests, tokens) = self._published, self._unsubmitted
            return {"op": "load", "running": state["running"], "waiting": state["waiting"] + requests,
                    "kv_tokens": state["kv_tokens"], "queued_tokens": state["queued_tokens"] + tokens,
                    "kv_capacity": self._capacity}

    def _finished(self, result: DecodeResult) -> None:
        conn, rid, _ = self.inflight.pop(result.id)
        self.order.remove(result.id)
        conn.requests.pop(rid, None)
        conn.send({"op": "done", "id": rid, "tokens": result.tokens, "finish_reason": result.finish_reason,
                   "token_times_s": result.token_times_s, "prompt_tokens": result.prompt_tokens,
                   "preemptions": result.preemptions, "prefill_path": result.prefill_path})

    def _shutdown(self, requester: Connection | None) -> None:
        """Cancel what is in flight (each gets its "done"), acknowledge, close everything."""
        for eid in list(self.inflight):
            self.engine.cancel(eid)
        if self.inflight:
            for result in self.engine.step():  # nothing runs now: it only hands back the cancelled
                self._finished(result)
        if requester is not None:
            requester.send({"op": "shutdown"})
        self._close_all()

    def _close_all(self) -> None:
        self._stopping = True
        with self._lock:
            connections, self.connections = list(self.connections), set()
        try:
            self.listener.close()
        except OSError:
            pass
        for conn in connections:
            conn.close()
        for conn in connections:
            conn.join(timeout=2.0)  # let queued replies (the cancellations, the ack) reach their clients


def serve(config: ServeConfig, ready: Any = None) -> int:
    """Load the model, listen, announce `READY <port>` on `ready` (stdout), serve; the exit status."""
    torch.set_num_threads(config.threads)
    model = Decoder.from_pretrained(config.model)
    prefill = None
    if config.servers:  # the prefill engine shares its page pool with the decode engine
        client = KVClient(list(config.servers))
        prefill = PrefillEngine(model, client, PrefillConfig(block_tokens=config.block_tokens,
                                                             kv_pages=config.kv_pages), model_identity(config.model))
    engine = DecodeEngine(model, prefill, config.decode_config())
    listener = socket.create_server((config.host, config.port))
    instance = Instance(config, engine, listener)
    signal.signal(signal.SIGTERM, instance.request_shutdown)
    signal.signal(signal.SIGINT, instance.request_shutdown)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack, to stderr
    instance.start_threads()
    out = ready if ready is not None else sys.stdout
    print(f"READY {instance.port}", file=out, flush=True)
    return instance.run()


def parse_args(argv: Sequence[str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser(prog="python -m engine.decode.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="model directory (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port, printed on the READY line")
    parser.add_argument("--kv-pages", type=int, default=512)
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--prefill-tokens-per-step", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--max-line-bytes", type=int, default=MAX_LINE_BYTES)
    parser.add_argument("--exit-on-stdin-eof", action="store_true",
                        help="shut down when stdin ends (a parent holding the pipe died or closed it)")
    parser.add_argument("--servers", default="", help="the store's daemons, host:port,...: prompts go through it")
    a = parser.parse_args(argv)
    try:
        return ServeConfig(model=a.model, host=a.host, port=a.port, kv_pages=a.kv_pages, block_tokens=a.block_tokens,
                           max_running=a.max_running, prefill_tokens_per_step=a.prefill_tokens_per_step,
                           threads=a.threads, max_line_bytes=a.max_line_bytes, exit_on_stdin_eof=a.exit_on_stdin_eof,
                           servers=tuple(s for s in a.servers.split(",") if s))
    except ValueError as e:
        parser.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
