"""Hosts on one machine: network namespaces joined by a bridge, processes started inside them, certificates.

    with Network("10.77.0") as net:                     # a switch namespace holding a bridge
        daemon = net.add_host("d0")                       # namespace + veth to the bridge, 10.77.0.10/24
        proc = net.spawn(daemon, [...], stdout=PIPE)      # `ip netns exec`: the child's pid is the process
        net.link(daemon, up=False)                        # that host's cable pulled (its side of the veth)

Nothing is created in the root namespace: each veth is made inside the switch namespace with its peer moved
straight into its host's, and no namespace gets a default route, so traffic can only reach the subnet.
Names carry a random tag, so runs side by side (or a crashed earlier run) never meet. `close()` kills
what still runs in each namespace and deletes the namespaces, which deletes their veths and rules.
"""

from __future__ import annotations

import ctypes
import datetime
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PR_SET_PDEATHSIG = 1


def available() -> str | None:
    """None if namespaces can be made here; else why not (the test's skip reason)."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veths and a bridge (run make test-multihost as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (deploy/peers.sh iproute2)"
    probe = f"mhprobe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _die_with_parent() -> None:  # in the child, before exec: a test killed outright takes its hosts' processes along
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(frozen=True)
class Host:
    name: str  # d0, e0, ...
    ns: str  # the namespace
    address: str  # on the subnet
    dev: str = "eth0"  # its end of the veth, inside ns
    port_dev: str = ""  # the bridge's end, inside the switch namespace


class Network:
    def __init__(self, subnet: str = "10.77.0", prefix: str = "mh") -> None:
        self.tag = secrets.token_hex(3)
        self.subnet = subnet
        self.switch = f"{prefix}-{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self.processes: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        try:
            self._add_namespace(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        host = Host(name, f"{self.switch[:-3]}-{name}", f"{self.subnet}.{10 + len(self.hosts)}",
                    port_dev=f"p{self.tag}{len(self.hosts)}")
        self._add_namespace(host.ns)
        # made inside the switch namespace, its peer moved straight into the host's: the root namespace sees neither
        ip("-n", self.switch, "link", "add", host.port_dev, "type", "veth", "peer", "name", host.dev, "netns", host.ns)
        ip("-n", self.switch, "link", "set", host.port_dev, "master", "br0")
        ip("-n", self.switch, "link", "set", host.port_dev, "up")
        ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", host.dev)
        ip("-n", host.ns, "link", "set", host.dev, "up")
        self.hosts[name] = host
        return host

    def link(self, host: Host, up: bool) -> None:
        """The host's side of its link up or down (as a pulled cable: the bridge stops forwarding to it)."""
        ip("-n", host.ns, "link", "set", host.dev, "up" if up else "down")

    def routes(self, host: Host) -> list[str]:
        return [line.strip() for line in ip("-n", host.ns, "route", "show").stdout.splitlines() if line.strip()]

    def pids(self, host: Host) -> list[int]:
        """The processes running in the host's namespace."""
        return [int(p) for p in ip("netns", "pids", host.ns).stdout.split()]

    def spawn(self, host: Host, args: list[str], **popen) -> subprocess.Popen:
        """`args` run in the host's namespace. `ip netns exec` execs them, so the Popen's pid is theirs, and they
        are SIGKILLed if this process dies first."""
        process = subprocess.Popen(["ip", "netns", "exec", host.ns, *args], preexec_fn=_die_with_parent, **popen)
        self.processes.append(process)
        return process

    def stop(self, process: subprocess.Popen, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        return process.returncode

    def close(self) -> None:
        """Stop every process started here, kill anything left in the namespaces, delete the namespaces."""
        for process in reversed(self.processes):
            try:
                self.stop(process, timeout_s=5.0)
            except Exception:  # noqa: BLE001 - clean-up goes on whatever one process does
                pass
        for ns in reversed(self._namespaces):
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # only ours live in a namespace of this run's own name
                except (ProcessLookupError, ValueError):
                    pass
            ip("netns", "del", ns, check=False)
        self._namespaces.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def namespaces() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()}


def root_links() -> set[str]:
    """The interfaces of the root namespace (this process's), by name."""
    return {line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").stdout.splitlines()}


# -- certificates ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Certificates:
    ca: Path
    client_cert: Path  # for mutual TLS: the engines' certificate, signed by ca
    client_key: Path
    servers: dict[str, tuple[Path, Path]]  # address -> (certificate, key) valid for that IP address


def make_certificates(directory: Path, addresses: list[str]) -> Certificates:
    """A CA, one server certificate per address (its IP as the subject alternative name: the clients check the
    address they dial, no server-name override) and one client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "multihost test CA")])
    ca = (_builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(name: str, usage, sans: list[x509.GeneralName]) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), ca.subject, key.public_key())
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        cert_path.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        return cert_path, key_path

    servers = {a: leaf(f"server-{a}", ExtendedKeyUsageOID.SERVER_AUTH, [x509.IPAddress(ipaddress.ip_address(a))])
               for a in addresses}
    client_cert, client_key = leaf("engine-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return Certificates(ca_path, client_cert, client_key, servers)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
