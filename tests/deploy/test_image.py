"""The kvstore-server image, built here by deploy/image/build.sh on a Debian base made with debootstrap, and run
with podman as the StatefulSet runs it: the manifest's arguments, its Secrets' files mounted where it mounts them
with its file modes and fsGroup, its probe commands run inside the container; then the host's `kvstore` CLI puts
and gets blocks over TLS with a token, /metrics answers, torch is not in the image and SIGTERM stops it cleanly."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.test_manifests import (
    ROOT,
    container,
    documents,
    make_secrets,
    one,
    probe_commands,
    secret_mounts,
    with_flags,
)

pytestmark = pytest.mark.deploy

IMAGE = "localhost/kvstore-server:test"
BUILD_S = 1200  # a hang guard: debootstrap and pip the first time take about two minutes, a rebuild less
START_S = 60.0
TEXT = "a prompt long enough to fill three blocks of sixteen tokens"  # 59 UTF-8 bytes: 3 full 16-token blocks


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sandbox_flags() -> list[str]:
    """What podman needs to start a container on a host like this one, found on the sandbox the project's CI
    runs in; on an ordinary host these are harmless.

    * Resource limits: podman asks for a descriptor limit of 1048576, above this process's hard limit, and
      without CAP_SYS_RESOURCE the runtime may not raise it ("setrlimit `RLIMIT_NOFILE`: Operation not
      permitted"); the same for the process limit. The container gets this process's descriptor limit and a
      process limit a daemon's threads stay far below.
    * Runtime: crun refuses cgroup v1 controllers with a cgroup2 hierarchy also mounted ("cgroups in hybrid mode
      not supported, drop all controllers from cgroupv2"), which is how this sandbox mounts them; runc takes them.
    """
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    flags = ["--ulimit", f"nofile={hard}:{hard}", "--ulimit", "nproc=4096:4096"]
    hybrid = os.path.ismount("/sys/fs/cgroup/unified") and not os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    if hybrid:
        if shutil.which("runc") is None:
            # deploy/peers.sh installs it the way it installs podman (root, from Debian's packages)
            subprocess.run([str(ROOT / "deploy" / "peers.sh"), "runc"], check=True, timeout=600)
        flags += ["--runtime", "runc"]
    return flags


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def image() -> str:
    for tool in ("podman", "debootstrap"):
        assert shutil.which(tool), f"no {tool}: run `deploy/peers.sh podman debootstrap` (make test-deploy does)"
    if os.geteuid() != 0:
        pytest.skip("the image is built rootful: debootstrap and podman import need root")
    build = subprocess.run([str(ROOT / "deploy" / "image" / "build.sh"), *sandbox_flags()], capture_output=True,
                           text=True, timeout=BUILD_S, env={**os.environ, "KVSTORE_IMAGE": IMAGE})
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return IMAGE


def kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    """The host's kvstore CLI, the project's own client."""
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture()
def daemon(image: str, tmp_path: Path) -> Iterator[dict]:
    """The image run with the StatefulSet's arguments, its ports moved to free ones on loopback (host network:
    the data channel is reached at the port the daemon names, so no port mapping can stand between)."""
    sts = one(documents(), "StatefulSet", "kvstore")
    c = container(sts)
    pod = sts["spec"]["template"]["spec"]
    secrets = make_secrets(tmp_path / "secrets")
    fs_group = pod["securityContext"]["fsGroup"]
    modes = {v["name"]: v["secret"].get("defaultMode", 0o644) for v in pod["volumes"] if "secret" in v}
    volumes = []
    for mount in c["volumeMounts"]:
        host = tmp_path / "pod" / mount["name"]
        host.mkdir(parents=True)
        if mount["mountPath"] in secret_mounts(sts):
            # as the kubelet mounts a Secret: root's files, the pod's fsGroup, the volume's defaultMode
            name, keys = secret_mounts(sts)[mount["mountPath"]]
            for key in keys:
                shutil.copy(secrets[name][key], host / key)
                os.chown(host / key, 0, fs_group)
                os.chmod(host / key, modes[mount["name"]])
            volumes += ["-v", f"{host}:{mount['mountPath']}:ro"]
        else:  # the data volume, whose root the kubelet hands to fsGroup
            os.chown(host, 0, fs_group)
            os.chmod(host, 0o2775)
            volumes += ["-v", f"{host}:{mount['mountPath']}"]
    grpc_port, data_port, metrics_port = free_port(), free_port(), free_port()
    args = with_flags(c["args"], host="127.0.0.1", port=str(grpc_port), data_port=str(data_port),
                      metrics_port=str(metrics_port), metrics_host="127.0.0.1")
    name = f"kvstore-test-{uuid.uuid4().hex[:8]}"
    try:
        podman("run", "-d", "--name", name, "--network", "host", *sandbox_flags(), *volumes,
               # the pod's user and groups, as runAsUser, runAsGroup and fsGroup give them
               "--user", f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}",
               "--group-add", str(fs_group), "--read-only", image, *args)
        yield {"name": name, "container": c, "secrets": secrets, "grpc": grpc_port, "metrics": metrics_port,
               "tmp": tmp_path}
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)


def probe(daemon: dict, kind: str) -> subprocess.CompletedProcess[str]:
    """The manifest's probe command, as the kubelet runs it: inside the container, its files where they are."""
    command = with_flags(probe_commands(daemon["container"])[kind], address=f"127.0.0.1:{daemon['grpc']}")
    return podman("exec", daemon["name"], *command, check=False, timeout=30)


def test_image_serves_as_the_statefulset_runs_it(daemon: dict) -> None:
    deadline = time.monotonic() + START_S
    while (ready := probe(daemon, "startupProbe")).returncode != 0:
        state = podman("inspect", "--format", "{{.State.Status}}", daemon["name"]).stdout.strip()
        logs = podman("logs", daemon["name"], check=False)
        assert state == "running", (logs.stdout + logs.stderr)[-4000:]
        assert time.monotonic() < deadline, ready.stderr
        time.sleep(0.5)
    for kind in ("readinessProbe", "livenessProbe"):
        result = probe(daemon, kind)
        assert result.returncode == 0 and "SERVING" in result.stdout, (kind, result.stderr)

    secrets = daemon["secrets"]
    # the client checks the daemon as kvstore-0.kvstore.kvstore.svc.cluster.local, the name SRV would give it
    secured = ["--servers", f"127.0.0.1:{daemon['grpc']}", "--tls-ca", str(secrets["kvstore-ca"]["ca.crt"]),
               "--tls-server-name", "kvstore-0.kvstore.kvstore.svc.cluster.local", "--text", TEXT]
    token = ["--token", secrets["kvstore-api-store-token"]["token"].read_text()]
    refused = kvstore("put", *secured)  # no token: the daemon in the image enforces its token file
    assert refused.returncode != 0 and "stored 0" in refused.stdout, refused.stdout + refused.stderr
    put = kvstore("put", *secured, *token)
    assert put.returncode == 0 and "stored 3, already present 0, failed 0" in put.stdout, put.stdout + put.stderr
    got = kvstore("get", *secured, *token)
    assert got.returncode == 0 and "3 of 3 leading blocks read and verified" in got.stdout, got.stdout + got.stderr

    metrics = httpx.get(f"http://127.0.0.1:{daemon['metrics']}/metrics", timeout=10)
    assert metrics.status_code == 200 and "kvstore_" in metrics.text

    # the daemon's image holds no torch, and runs as the manifests' non-root user
    no_torch = podman("exec", daemon["name"], "python3", "-c",
                      "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)",
                      check=False)
    assert no_torch.returncode == 0, "torch is importable in the daemon's image"
    assert podman("exec", daemon["name"], "id", "-u").stdout.strip() == "10001"

    # SIGTERM (what the kubelet sends) drains and closes the index: exit 0 within the grace period
    podman("stop", "-t", "30", daemon["name"], timeout=60)
    assert podman("inspect", "--format", "{{.State.ExitCode}}", daemon["name"]).stdout.strip() == "0"
    logs = podman("logs", daemon["name"])
    assert "stopped cleanly" in logs.stdout + logs.stderr
