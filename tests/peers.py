"""Real peer servers for tests, on loopback: etcd and dnsmasq (Debian's packages, by deploy/peers.sh).

Each runs as a child that dies with the test process (PR_SET_PDEATHSIG) and is stopped by its fixture.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
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
