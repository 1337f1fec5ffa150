"""The parent side of `engine.decode.serve`: start decode instance processes, talk to them, stop them.

    with start_instances(model_path, 3, kv_pages=512, block_tokens=64) as instances:
        reply = instances[0].client.generate([5, 7, 9], max_tokens=8).result()   # the "done" message
        load = instances[1].client.load()                                         # the "load" message
        router_loads = [i.client.instance_load() for i in instances]              # InstanceLoad, for Router

Each instance is a child process (`python -m engine.decode.serve ... --exit-on-stdin-eof`, its stdin a pipe
this process holds, so the children end with it however it ends) with one client connection. The client
is thread-safe: any thread may send; one reader thread per client resolves each generate's Future when
its "done" (or "error") arrives, and answers load queries in the order they were sent (the instance
answers a connection's load queries in order, at once, from the state after its last step).
"""

from __future__ import annotations

import itertools
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.decode.router import InstanceLoad

REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m engine.decode.serve` imports from


class InstanceError(RuntimeError):
    """An instance answered a request with an error, or its connection ended before the answer."""


class InstanceStartError(RuntimeError):
    """An instance process did not get ready: it exited or timed out (the message carries its stderr)."""


class InstanceClient:
    """One connection to one instance."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 10.0) -> None:
        self.address = (host, port)
        self._sock = socket.create_connection(self.address, timeout=connect_timeout_s)
        self._sock.settimeout(None)  # the reader blocks until replies come; sends are small
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()  # one line at a time, and load waiters queued in send order
        self._ids = itertools.count()
        self._pending: dict[Any, Future] = {}  # generate id -> its Future
        self._loads: deque[Future] = deque()  # load queries in flight, oldest first
        self._shutdown: Future | None = None
        self.unmatched: list[dict] = []  # errors no request in flight claims (e.g. a cancel that came too late)
        self._ended = False  # the connection ended: sends fail at once instead of waiting for no answer
        self._reader = threading.Thread(target=self._read, name=f"client-{port}", daemon=True)
        self._reader.start()

    # -- requests --

    def generate(self, prompt: Sequence[int], max_tokens: int | None, **sampling: Any) -> Future:
        """Send a generate; a Future of its "done" message (InstanceError for an "error"). Its id is
        `future.request_id`."""
        future: Future = Future()
        with self._send_lock:
            rid = next(self._ids)
            future.request_id = rid  # type: ignore[attr-defined]
            self._pending[rid] = future
            try:
                self._send({"op": "generate", "id": rid, "prompt": list(prompt), "max_tokens": max_tokens,
                            **sampling})
            except InstanceError:
                self._pending.pop(rid, None)
                raise
        return future

    def cancel(self, request_id: Any) -> None:
        """Ask the instance to cancel a request: its Future then resolves with finish_reason "cancelled"."""
        with self._send_lock:
            self._send({"op": "cancel", "id": request_id})

    def load_async(self) -> Future:
        future: Future = Future()
        with self._send_lock:
            self._loads.append(future)  # before the send: the answer may come before this thread goes on
            try:
                self._send({"op": "load"})
            except InstanceError:
                self._loads.pop()
                raise
        return future

    def load(self, timeout_s: float = 30.0) -> dict:
        """The instance's "load" message (its state after its last step, and what it has received since)."""
        return self.load_async().result(timeout_s)

    def instance_load(self, timeout_s: float = 30.0) -> InstanceLoad:
        return to_instance_load(self.load(timeout_s))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """The shutdown op: in-flight requests resolve as cancelled, then the instance exits."""
        future: Future = Future()
        with self._send_lock:
            self._shutdown = future
            self._send({"op": "shutdown"})
        future.result(timeout_s)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(timeout=5.0)

    # -- wire --

    def _send(self, message: dict) -> None:
        """Under the send lock."""
        if self._ended:
            raise InstanceError(f"the connection to instance {self.address} has ended")
        try:
            self._sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        except OSError as e:
            raise InstanceError(f"instance {self.address} is gone: {e}") from None

    def _read(self) -> None:
        try:
            stream = self._sock.makefile("rb")
            for line in stream:
                message = json.loads(line)
                op = message.get("op")
                if op == "done":
                    future = self._pending.pop(message["id"], None)
                    if future is not None:
                        future.set_result(message)
                elif op == "error":
                    future = self._pending.pop(message.get("id"), None)
                    if future is not None:
                        future.set_exception(InstanceError(message["message"]))
                    else:
                        self.unmatched.append(message)
                elif op == "load":
                    self._loads.popleft().set_result(message)
                elif op == "shutdown" and self._shutdown is not None:
                    self._shutdown.set_result(message)
        except (OSError, ValueError):
            pass
        finally:  # the connection ended: nothing in flight will be answered
            with self._send_lock:  # no request can slip in between: later sends raise at once
                self._ended = True
                waiting = [*self._pending.values(), *self._loads, *([self._shutdown] if self._shutdown else [])]
                self._pending.clear()
                self._loads.clear()
            reason = InstanceError(f"the connection to instance {self.address} ended")
            for future in waiting:
                if not future.done():
                    future.set_exception(reason)


def to_instance_load(load: dict) -> InstanceLoad:
    """The router's view of a "load" message: requests running or queued, and the KV held plus the
    prompts queued (so a request placed a moment ago counts before the instance admits it)."""
    return InstanceLoad(running=load["running"] + load["waiting"], kv_tokens=load["kv_tokens"] + load["queued_tokens"],
                        kv_capacity=load["kv_capacity"])


# -- processes -------------------------------------------------------------------------------------------------

@dataclass
class Instance:
    process: subprocess.Popen
    port: int
    client: InstanceClient
    stderr_path: Path
    args: list[str] = field(default_factory=list)

    def stderr(self) -> str:
        return _tail(self.stderr_path)


class Instances(Sequence[Instance]):
    """Started instances; a context manager that stops them all."""

    def __init__(self, instances: list[Instance]) -> None:
        self._instances = instances

    def __getitem__(self, index):  # type: ignore[override]
        return self._instances[index]

    def __len__(self) -> int:
        return len(self._instances)

    def __iter__(self) -> Iterator[Instance]:
        return iter(self._instances)

    def loads(self) -> list[dict]:
        """Every instance's "load" message, asked of all at once."""
        futures = [i.client.load_async() for i in self._instances]
        return [f.result(30.0) for f in futures]

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        return stop_instances(self._instances, timeout_s)

    def __enter__(self) -> Instances:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()


def serve_args(model: Path | str, *, kv_pages: int = 512, block_tokens: int = 256, max_running: int = 64,
               prefill_tokens_per_step: int = 2048, threads: int = 1, max_line_bytes: int | None = None,
               servers: Sequence[str] = ()) -> list[str]:
    """The command line of one instance."""
    args = [sys.executable, "-m", "engine.decode.serve", "--model", str(model), "--port", "0",
            "--kv-pages", str(kv_pages), "--block-tokens", str(block_tokens), "--max-running", str(max_running),
            "--prefill-tokens-per-step", str(prefill_tokens_per_step), "--threads", str(threads),
            "--exit-on-stdin-eof"]
    if max_line_bytes is not None:
        args += ["--max-line-bytes", str(max_line_bytes)]
    if servers:
        args += ["--servers", ",".join(servers)]
    return args


def start_instances(model: Path | str, count: int, *, ready_timeout_s: float = 120.0, **options: Any) -> Instances:
    """Start `count` instances of `model` at once (they load in parallel) and connect to each.

    `options` are serve_args' (kv_pages, block_tokens, max_running, ...). Raises InstanceStartError, with
    the child's stderr, if one exits or is not READY within `ready_timeout_s`; the others are stopped then."""
    if count < 1:
        raise ValueError(f"start_instances: count must be >= 1, got {count}")
    args = serve_args(model, **options)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    # one torch thread each (--threads); OpenMP threads of several processes would spin against each other
    env.setdefault("OMP_NUM_THREADS", str(options.get("threads", 1)))
    started: list[tuple[subprocess.Popen, Path]] = []
    instances: list[Instance] = []
    try:
        for _ in range(count):
            # stderr to a file, not a pipe: nobody drains a pipe while the instance runs, and a full one blocks it
            fd, name = tempfile.mkstemp(prefix="decode-instance-", suffix=".stderr")
            with os.fdopen(fd, "wb") as stderr:
                process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                           cwd=REPO_ROOT, env=env)
            started.append((process, Path(name)))
        deadline = time.monotonic() + ready_timeout_s
        for process, stderr_path in started:
            port = _wait_ready(process, stderr_path, deadline)
            instances.append(Instance(process, port, InstanceClient("127.0.0.1", port), stderr_path, args))
    except BaseException:
        for instance in instances:
            instance.client.close()
        _stop_processes([p for p, _ in started], timeout_s=5.0)
        for _, stderr_path in started:
            stderr_path.unlink(missing_ok=True)
        raise
    return Instances(instances)


def _wait_ready(process: subprocess.Popen, stderr_path: Path, deadline: float) -> int:
    """The port on the child's READY line; InstanceStartError if it exits or the deadline passes first."""
    fd = process.stdout.fileno()
    seen = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InstanceStartError(f"decode instance (pid {process.pid}) not READY in time; its stderr:\n"
                                         f"{_tail(stderr_path)}")
            if selector.select(min(left, 0.5)):
                chunk = os.read(fd, 4096)
                if not chunk:  # stdout closed: it exited
                    code = process.wait(timeout=10)
                    raise InstanceStartError(f"decode instance (pid {process.pid}) exited with {code} before "
                                             f"READY; its stderr:\n{_tail(stderr_path)}")
                seen += chunk
    line = seen.split(b"\n", 1)[0].decode(errors="replace").strip()
    parts = line.split()
    if len(parts) != 2 or parts[0] != "READY" or not parts[1].isdigit():
        raise InstanceStartError(f"decode instance (pid {process.pid}) said {line!r}, not 'READY <port>'; "
                                 f"its stderr:\n{_tail(stderr_path)}")
    return int(parts[1])


def stop_instances(instances: Sequence[Instance], timeout_s: float = 10.0) -> list[int]:
    """SIGTERM all (each shuts down cleanly), wait up to `timeout_s` in all, SIGKILL what remains; the exit
    codes. Stderr files are removed."""
    codes = _stop_processes([i.process for i in instances], timeout_s)
    for instance in instances:
        instance.client.close()
        instance.stderr_path.unlink(missing_ok=True)
    return codes


def _stop_processes(processes: Sequence[subprocess.Popen], timeout_s: float) -> list[int]:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
    return [process.returncode for process in processes]


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no stderr)"
    return text[-limit:] if text else "(empty)"
