"""Decode instances as child processes: start them, reach each through a client, stop them.

    with start_instances(model_path, 3, kv_pages=512, block_tokens=64) as instances:
        reply = instances[0].client.generate([5, 7, 9], max_tokens=8).result()   # a GenerateResult
        router_loads = [i.client.instance_load() for i in instances]             # InstanceLoad, for Router

Each instance is `python -m engine.serving.instance ... --exit-on-stdin-eof`, its stdin a pipe this process
holds, so the children end with it however it ends. The options are the instance's (InstanceConfig's
fields: kv_pages, servers, auth_tokens, tls_cert, ...); `client` holds the InstanceClient's (token, tls_ca,
...) for a secured instance.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from engine.serving.client import InstanceClient
from engine.serving.config import FIELDS
from engine.serving.loop import Load

REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m engine.serving.instance` imports from


class InstanceStartError(RuntimeError):
    """An instance process did not get ready: it exited or timed out (the message carries its stderr)."""


@dataclass
class InstanceProcess:
    process: subprocess.Popen
    port: int
    client: InstanceClient
    stderr_path: Path
    args: list[str] = field(default_factory=list)

    def stderr(self) -> str:
        return _tail(self.stderr_path)


class Instances(Sequence[InstanceProcess]):
    """Started instances; a context manager that stops them all."""

    def __init__(self, instances: list[InstanceProcess]) -> None:
        self._instances = instances

    @overload
    def __getitem__(self, index: int) -> InstanceProcess: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[InstanceProcess]: ...

    def __getitem__(self, index: int | slice) -> InstanceProcess | Sequence[InstanceProcess]:
        return self._instances[index]

    def __len__(self) -> int:
        return len(self._instances)

    def __iter__(self) -> Iterator[InstanceProcess]:
        return iter(self._instances)

    def loads(self) -> list[Load]:
        """Every instance's load, asked of all at once."""
        futures = [i.client.load_async() for i in self._instances]
        return [f.result(30.0) for f in futures]

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        return stop_instances(self._instances, timeout_s)

    def __enter__(self) -> Instances:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()


def instance_args(model: Path | str, **options: Any) -> list[str]:
    """The command line of one instance: `options` are InstanceConfig's fields (checked by the instance, which
    reports what it refuses on its stderr)."""
    if unknown := sorted(set(options) - set(FIELDS)):
        raise TypeError(f"instance_args: unknown options {unknown}; known: {', '.join(FIELDS)}")
    args = [sys.executable, "-m", "engine.serving.instance", "--model", str(model), "--port", "0",
            "--exit-on-stdin-eof"]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # a switch: --name on, --no-name off (kvstore/settings.py)
            args.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            args += [flag, ",".join(value) if isinstance(value, (list, tuple)) else str(value)]
    return args


def start_instances(model: Path | str, count: int, *, ready_timeout_s: float = 120.0,
                    client: Mapping[str, Any] | None = None, **options: Any) -> Instances:
    """Start `count` instances of `model` at once (they load in parallel) and connect to each.

    Raises InstanceStartError, with the child's stderr, if one exits or is not READY within
    `ready_timeout_s`; the others are stopped then."""
    if count < 1:
        raise ValueError(f"start_instances: count must be >= 1, got {count}")
    args = instance_args(model, **options)
    host = options.get("host", "127.0.0.1")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    # one torch thread each (--threads); OpenMP threads of several processes would spin against each other
    env.setdefault("OMP_NUM_THREADS", str(options.get("threads", 1)))
    started: list[tuple[subprocess.Popen, Path]] = []
    instances: list[InstanceProcess] = []
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
            instances.append(InstanceProcess(process, port, InstanceClient(f"{host}:{port}", **(client or {})),
                                             stderr_path, args))
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
    assert process.stdout is not None, "started with stdout=PIPE"
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


def stop_instances(instances: Sequence[InstanceProcess], timeout_s: float = 10.0) -> list[int]:
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
