"""The Kubernetes manifests (deploy/k8s/): valid for Kubernetes, and what they tell the programs is what the
programs accept. Every flag given to kvstore-server goes through its real parser and config checks with the
Secrets' files where the pods mount them (made by deploy/k8s/make-secrets.sh, the script the docs tell operators
to run); the probes run against a real daemon started with the manifest's own arguments; kvstore-api's flags go
through its parser; selectors, ports and Secret names are checked against one another."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from kvstore.client.config import _SECURITY_FLAGS, ClientConfig
from kvstore.proto import SERVICE
from kvstore.server.config import ServerConfig, load_config, parse_size
from kvstore.server.security import Security

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PROBE = ROOT / "deploy" / "image" / "kvstore-probe"
KUBERNETES = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships
START_S = 30.0  # a hang guard for the daemon's start; it is up in a second or two

Doc = dict[str, Any]


def documents() -> list[Doc]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def ports(c: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def secret_mounts(workload: Doc) -> dict[str, tuple[str, list[str]]]:
    """mountPath -> (Secret name, the keys mounted there)."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {}
    for mount in container(workload).get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret is not None:
            mounts[mount["mountPath"]] = (secret["secretName"], [item["key"] for item in secret["items"]])
    return mounts


def secret_refs(workload: Doc) -> set[tuple[str, str]]:
    """Every (Secret, key) the workload reads: mounted files and environment variables."""
    refs = {(name, key) for name, keys in secret_mounts(workload).values() for key in keys}
    for env in container(workload).get("env", []):
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            refs.add((ref["name"], ref["key"]))
    return refs


def make_secrets(directory: Path) -> dict[str, dict[str, Path]]:
    """Run deploy/k8s/make-secrets.sh, as the docs tell operators to, and read the Secrets its kubectl commands
    would create: Secret name -> key -> the file that becomes its value."""
    out = subprocess.run([str(K8S / "make-secrets.sh"), str(directory)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    secrets: dict[str, dict[str, Path]] = {}
    for line in out.splitlines():
        words = shlex.split(line)
        assert words[:4] == ["kubectl", "-n", "kvstore", "create"], line
        kind, name, flags = words[5], words[6], words[7:]
        if kind == "tls":  # kubectl create secret tls: the keys are tls.crt and tls.key
            given = dict(flag.removeprefix("--").split("=", 1) for flag in flags)
            secrets[name] = {"tls.crt": Path(given["cert"]), "tls.key": Path(given["key"])}
        else:
            assert kind == "generic", line
            pairs = [flag.removeprefix("--from-file=").split("=", 1) for flag in flags]
            secrets[name] = {key: Path(path) for key, path in pairs}
    return secrets


def mount_secrets(workload: Doc, secrets: dict[str, dict[str, Path]], root: Path) -> None:
    """Lay the Secrets' files out under `root` as the kubelet would mount them in the pod."""
    for path, (name, keys) in secret_mounts(workload).items():
        (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for key in keys:
            shutil.copy(secrets[name][key], root / path.lstrip("/") / key)


def rerooted(args: list[str], prefixes: list[str], root: Path) -> list[str]:
    """`args` with every --flag=/path under one of `prefixes` moved under `root` (the pod's files, here)."""
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        if eq and any(value == p or value.startswith(p.rstrip("/") + "/") for p in prefixes):
            arg = f"{flag}={root}{value}"
        out.append(arg)
    return out


def with_flags(args: list[str], **values: str) -> list[str]:
    """`args` with the given --flag=VALUE settings replaced (ports of a daemon run here, not in a pod)."""
    out = list(args)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        hits = [i for i, a in enumerate(out) if a.split("=", 1)[0] == flag]
        assert len(hits) == 1, f"{flag} given {len(hits)} times in {args}"
        out[hits[0]] = f"{flag}={value}"
    return out


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(NAME) substitution in args; a name without a variable would be passed on literally."""
    def one(match: re.Match) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) has no environment variable in the container"
        return env[match.group(1)]
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in args]


def load_probe() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("kvstore_probe", str(PROBE))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("kvstore_probe", loader))
    loader.exec_module(module)
    return module


def probe_commands(c: Doc) -> dict[str, list[str]]:
    return {kind: c[kind]["exec"]["command"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}


def daemon_config(statefulset: Doc, secrets: dict[str, dict[str, Path]], root: Path) -> tuple[list[str], ServerConfig]:
    """The StatefulSet's kvstore-server arguments with the pod's files under `root`, and the config they give."""
    mount_secrets(statefulset, secrets, root)
    c = container(statefulset)
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    (root / "data").mkdir(exist_ok=True)
    args = rerooted(c["args"], mounts, root)
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return args, load_config(args, environ=env)


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return documents()


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    return make_secrets(tmp_path_factory.mktemp("secrets"))


def test_every_document_is_valid_kubernetes(docs: list[Doc]) -> None:
    assert {d["kind"] for d in docs} >= {"Namespace", "StorageClass", "Service", "StatefulSet",
                                         "PodDisruptionBudget", "Deployment"}
    for doc in docs:
        # strict: a field the schema does not know (a typo, a wrong level) is an error, not ignored
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    namespace = one(docs, "Namespace", "kvstore")["metadata"]["name"]
    for doc in docs:
        if doc["kind"] not in ("Namespace", "StorageClass"):  # the cluster-wide ones
            assert doc["metadata"].get("namespace") == namespace, doc["metadata"]["name"]


def test_storage_is_local_nvme_bound_when_scheduled(docs: list[Doc]) -> None:
    sts = one(docs, "StatefulSet", "kvstore")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    storage = one(docs, "StorageClass", claim["spec"]["storageClassName"])
    assert storage["metadata"]["name"] == "local-nvme"
    assert storage["provisioner"] == "kubernetes.io/no-provisioner"
    assert storage["volumeBindingMode"] == "WaitForFirstConsumer"
    mounted = {m["name"]: m["mountPath"] for m in container(sts)["volumeMounts"]}
    assert claim["metadata"]["name"] in mounted


def test_daemon_flags_parse_and_match_the_pod(docs: list[Doc], secrets: dict[str, dict[str, Path]],
                                              tmp_path: Path) -> None:
    sts = one(docs, "StatefulSet", "kvstore")
    c = container(sts)
    _, config = daemon_config(sts, secrets, tmp_path)
    exposed = ports(c)
    assert (config.port, config.data_port, config.metrics_port) == (exposed["grpc"], exposed["data"],
                                                                    exposed["metrics"])
    # reachable from other pods (and Prometheus), not loopback, which a pod's peers cannot reach
    assert config.host == "0.0.0.0" and config.metrics_host == "0.0.0.0"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    data_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert config.data_dir == tmp_path / data_mount.lstrip("/")
    # the budget leaves the index and compaction room on the volume
    assert config.capacity_bytes < parse_size(claim["spec"]["resources"]["requests"]["storage"].replace("i", "iB"))
    assert config.auth_tokens is not None and config.tls
    # the token file and the certificate from make-secrets.sh are what the daemon loads at start
    security = Security.from_config(config)
    assert security.authenticator is not None and security.grpc_credentials is not None
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == config.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    # a memory limit, and the hot tier fits well inside it
    limit = parse_size(c["resources"]["limits"]["memory"].replace("i", "iB"))
    assert config.hot_tier_bytes < limit and "cpu" in c["resources"]["requests"]


def test_daemon_pods_run_as_the_images_user(docs: list[Doc]) -> None:
    sts = one(docs, "StatefulSet", "kvstore")
    pod = sts["spec"]["template"]["spec"]
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    assert user, "deploy/Dockerfile names no USER uid:gid"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == tuple(
        int(g) for g in user.groups())
    assert pod["securityContext"]["fsGroup"] == int(user.group(2))  # the volume and Secrets readable
    # Service links would put KVSTORE_PORT=tcp://... in the daemon's environment for a Service named kvstore,
    # and the daemon reads KVSTORE_<SETTING> variables as settings.
    assert pod["enableServiceLinks"] is False


def test_headless_service_selects_the_daemons_only(docs: list[Doc]) -> None:
    service = one(docs, "Service", "kvstore")
    sts = one(docs, "StatefulSet", "kvstore")
    api = one(docs, "Deployment", "kvstore-api")
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    spec = service["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is False
    assert selects(spec["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert not selects(spec["selector"], api["spec"]["template"]["metadata"]["labels"])
    assert selects(sts["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
    exposed = ports(container(sts))
    assert {(p["name"], p["port"]) for p in spec["ports"]} == {("grpc", 50051), ("data", 50052), ("metrics", 9100)}
    for port in spec["ports"]:  # SRV records _grpc._tcp...: the port's name and protocol
        assert port["targetPort"] in exposed and exposed[port["targetPort"]] == port["port"]
        assert port["protocol"] == "TCP"


def test_disruption_budget_covers_the_daemons(docs: list[Doc]) -> None:
    pdb = one(docs, "PodDisruptionBudget", "kvstore")
    sts = one(docs, "StatefulSet", "kvstore")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert selects(pdb["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
    assert not selects(pdb["spec"]["selector"]["matchLabels"],
                       one(docs, "Deployment", "kvstore-api")["spec"]["template"]["metadata"]["labels"])


def test_every_secret_the_pods_read_is_made_by_make_secrets(docs: list[Doc],
                                                            secrets: dict[str, dict[str, Path]]) -> None:
    # Secrets are made per cluster by the operator (make-secrets.sh prints the kubectl commands), never kept in
    # the repository: each one a pod reads must be among them, with the key it reads.
    refs = secret_refs(one(docs, "StatefulSet", "kvstore")) | secret_refs(one(docs, "Deployment", "kvstore-api"))
    assert refs
    for name, key in sorted(refs):
        assert key in secrets.get(name, {}), f"Secret {name} key {key}: not made by deploy/k8s/make-secrets.sh"
    assert not [d for d in docs if d["kind"] == "Secret"], "no Secret values in the repository"


def test_daemon_certificate_carries_every_pod_name(docs: list[Doc], secrets: dict[str, dict[str, Path]]) -> None:
    # The client checks each daemon against its SRV target name, kvstore-N.<service>.<ns>.svc.cluster.local.
    sts = one(docs, "StatefulSet", "kvstore")
    cert = x509.load_pem_x509_certificate(secrets["kvstore-daemon-tls"]["tls.crt"].read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    domain = f"{sts['spec']['serviceName']}.{sts['metadata']['namespace']}.svc.cluster.local"
    assert f"*.{domain}" in names
    for probe in probe_commands(container(sts)).values():
        server_name = next(a.split("=", 1)[1] for a in probe if a.startswith("--server-name="))
        assert server_name.split(".", 1)[1] == domain  # one label under the wildcard


@pytest.fixture()
def daemon(docs: list[Doc], secrets: dict[str, dict[str, Path]], tmp_path: Path) -> Iterator[tuple[Doc, int]]:
    """kvstore-server started with the StatefulSet's arguments (ports moved to free ones, on loopback)."""
    sts = one(docs, "StatefulSet", "kvstore")
    args, _ = daemon_config(sts, secrets, tmp_path)
    port_file = tmp_path / "port"
    args = with_flags(args, host="127.0.0.1", port="0", data_port="0", metrics_port="0", metrics_host="127.0.0.1")
    process = subprocess.Popen([sys.executable, "-m", "kvstore.server.main", *args, f"--port-file={port_file}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + START_S
        while not port_file.exists():
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "kvstore-server did not start"
            time.sleep(0.05)
        yield sts, int(port_file.read_text().split()[0])
    finally:
        process.terminate()
        process.wait(timeout=30)
        process.stderr.close()


def test_probes_pass_on_a_daemon_started_with_the_manifests_arguments(daemon: tuple[Doc, int],
                                                                      tmp_path: Path) -> None:
    sts, port = daemon
    c = container(sts)
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    probe = load_probe()
    commands = probe_commands(c)
    for kind, command in commands.items():
        assert command[0] == PROBE.name  # the image installs deploy/image/kvstore-probe under this name
        address = next(a.split("=", 1)[1] for a in command if a.startswith("--address="))
        assert int(address.rpartition(":")[2]) == ports(c)["grpc"], kind
        service = next(a.split("=", 1)[1] for a in command if a.startswith("--service="))
        assert service == ("" if kind == "livenessProbe" else SERVICE), kind
        assert probe.main(with_flags(rerooted(command[1:], mounts, tmp_path), address=f"127.0.0.1:{port}")) == 0
    # why not the kubelet's own gRPC probe: it speaks plaintext, which this daemon refuses
    plain = [a for a in commands["readinessProbe"][1:] if not a.startswith(("--tls-ca=", "--server-name="))]
    assert probe.main([*with_flags(plain, address=f"127.0.0.1:{port}"), "--timeout=2"]) == 1


def test_api_flags_parse_and_find_the_daemons_by_srv(docs: list[Doc], secrets: dict[str, dict[str, Path]],
                                                     tmp_path: Path) -> None:
    from engine.api.server import parse_args

    api = one(docs, "Deployment", "kvstore-api")
    service = one(docs, "Service", "kvstore")
    c = container(api)
    mount_secrets(api, secrets, tmp_path)
    env = {}
    for var in c["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]].read_text()
    config = parse_args(expand(c["args"], env))
    assert config.host == "0.0.0.0" and config.port == ports(c)["http"]
    assert len(config.api_keys) == 1 and config.metrics_keys
    srv = f"dns+srv:///_grpc._tcp.{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert config.servers == (srv,)
    # The store client's settings come from KVSTORE_* variables the client knows; with the pod's files they
    # make a valid client config (a token without whitespace, a readable CA).
    client_env = {name: env[variable] for name, variable in _SECURITY_FLAGS.items() if variable in env}
    assert set(client_env) == {"token", "tls_ca"}
    client_env["tls_ca"] = str(tmp_path / client_env["tls_ca"].lstrip("/"))
    ClientConfig(servers=config.servers, **client_env)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[kind]["httpGet"]["path"] == "/health" and c[kind]["httpGet"]["port"] in ports(c)
    api_service = one(docs, "Service", "kvstore-api")
    assert selects(api_service["spec"]["selector"], api["spec"]["template"]["metadata"]["labels"])
    assert all(p["targetPort"] in ports(c) for p in api_service["spec"]["ports"])


def test_compose_commands_parse(tmp_path: Path) -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    published = set()
    for name, service in compose["services"].items():
        args = rerooted(service["command"], ["/data"], tmp_path / name)
        (tmp_path / name / "data").mkdir(parents=True)
        config = load_config(args, environ={})
        assert config.host == "0.0.0.0" and config.metrics_host == "0.0.0.0", name
        inside = {int(p.rsplit(":", 1)[1]) for p in service["ports"]}
        assert {config.port, config.data_port, config.metrics_port} == inside, name
        hosts = {int(p.rsplit(":", 2)[-2]) for p in service["ports"]}
        # the data channel is published at the port the daemon tells clients, or they could not follow it
        assert config.data_port in hosts and config.port in hosts, name
        assert not hosts & published, name
        published |= hosts
