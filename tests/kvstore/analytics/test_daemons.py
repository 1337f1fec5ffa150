"""Analytics against real daemons: the simulator and a daemon agree; live stats; access logs."""

import json
import os
import random
import subprocess
import sys
import time

import pytest

from kvstore.analytics.drive import replay_through_daemons
from kvstore.analytics.simulate import replay
from kvstore.analytics.trace import CONVERSATION_TRACE, Request, read_trace

pytestmark = pytest.mark.integration

RECORD_BYTES = 116 + 4096  # header (2 tokens, 1 layer) + payload per block in the driven replay


@pytest.fixture(scope="module")
def small_trace():
    requests = []
    for request in read_trace(CONVERSATION_TRACE):
        requests.append(request)
        if len(requests) == 400:
            return requests


def kvstore(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=300)


def test_a_daemon_with_room_for_everything_matches_the_simulator_exactly(daemons, small_trace):
    daemon, = daemons(1, "--capacity-bytes", "1GiB")
    driven = replay_through_daemons(small_trace, daemon.address)
    simulated = replay(small_trace, "lru", 10**9)
    assert (driven.hit_blocks, driven.hit_tokens) == (simulated.hit_blocks, simulated.hit_tokens)
    assert driven.hit_blocks > 100


def conversations(n: int = 60, turns: tuple[int, ...] = (5,), seed: int = 3) -> list[Request]:
    """n conversations of a number of turns drawn from `turns`, interleaved at random: a 2-block shared
    system prompt, then each turn adds 2 blocks to its conversation and ends in a partial block."""
    rng, lengths = random.Random(seed), random.Random(seed + 1)
    ids: dict = {}
    order = [c for c in range(n) for _ in range(lengths.choice(turns))]
    rng.shuffle(order)
    grown = dict.fromkeys(range(n), 0)
    out = []
    for t, conversation in enumerate(order):
        grown[conversation] += 1
        path = [("system", 0), ("system", 1)] + [("turns", conversation, i) for i in range(2 * grown[conversation] + 2)]
        keys = [ids.setdefault(tuple(path[: i + 1]), len(ids)) for i in range(len(path))]
        out.append(Request(t * 1000, len(keys) * 512 + 100, 10, tuple(keys + [ids.setdefault(("tail", t), len(ids))])))
    return out


@pytest.mark.parametrize("policy", ["lru", "prefix-reuse"])
def test_a_daemon_under_pressure_agrees_with_the_simulator(daemons, policy):
    trace = conversations()
    capacity = 150  # of 722 unique full blocks: LRU hits ~37% of tokens here
    driven = replay_through_daemons(trace, _pressed(daemons, policy, capacity))  # puts carry the requests' hints
    simulated = replay(trace, policy, int(capacity * 0.99), low_blocks=int(capacity * 0.97))
    assert driven.evictions > 0
    assert abs(driven.token_hit_rate - simulated.token_hit_rate) < 0.02, (driven, simulated)
    # ... and the agreement means something: another capacity (or, for LRU, policy) would be told apart.
    others = [replay(trace, policy, 100), replay(trace, policy, 200)]
    if policy == "lru":
        others.append(replay(trace, "s3fifo", capacity))
    for other in others:
        assert abs(other.token_hit_rate - simulated.token_hit_rate) > 0.04


def test_a_daemon_advised_of_each_conversations_fate_agrees_with_the_simulator(daemons):
    trace = conversations(turns=(1, 8))  # one-off questions and long chats: their first turns look alike
    capacity = 150  # of 676 unique full blocks
    driven = replay_through_daemons(trace, _pressed(daemons, "prefix-reuse", capacity), continuation_signal=1.0)
    advised, unadvised = (replay(trace, "prefix-reuse", int(capacity * 0.99), low_blocks=int(capacity * 0.97),
                                 continuation_signal=signal) for signal in (1.0, None))
    assert driven.evictions > 0
    # The daemon evicts on its sweep thread, so its watermarks overshoot by a few blocks, more or less
    # from run to run (1.2 points seen): the bound is half the advice's worth, so a daemon that ignored
    # the advice would still fail it.
    assert advised.token_hit_rate - unadvised.token_hit_rate > 0.05, "the advice is worth something here"
    assert abs(driven.token_hit_rate - advised.token_hit_rate) < 0.025, (driven, advised)


def _pressed(daemons, policy: str, capacity_blocks: int) -> str:
    """The address of one daemon with room for `capacity_blocks` blocks of the driven replay."""
    daemon, = daemons(1, "--capacity-bytes", str(capacity_blocks * RECORD_BYTES), "--eviction-policy", policy,
                      "--high-watermark", "0.99", "--low-watermark", "0.97", "--segment-bytes", "256KiB",
                      "--sweep-interval-s", "0.05")
    return daemon.address


def test_live_and_access_log_reports(daemons, tmp_path, small_trace):
    log = tmp_path / "access.log"
    daemon, = daemons(1, "--access-log", str(log), "--access-flush-interval-s", "0.05", "--sweep-interval-s", "0.05")
    replay_through_daemons(small_trace[:100], daemon.address, continuation_signal=0.5)  # both kinds of advice
    live = kvstore("analytics", "live", "--servers", daemon.address, "--rounds", "1")
    assert live.returncode == 0 and "blocks by class: chat" in live.stdout
    simulated = replay(small_trace[:100], "infinite", None)
    full_blocks = sum(r.input_length // 512 for r in small_trace[:100])
    # the prefix hit rate, what lookups found, not the reads of blocks already found (which all hit)
    assert f"prefix hit {simulated.hit_blocks / full_blocks:>7.2%} (blocks found / {full_blocks:,} looked up)" \
        in live.stdout and "reads served 100.00%" in live.stdout
    assert "advised blocks:  going on" in live.stdout and ", ended" in live.stdout
    daemon.stop()  # flushes the log
    out = tmp_path / "log.json"
    report_run = kvstore("analytics", "log", str(log), "--json", str(out))
    assert report_run.returncode == 0, report_run.stderr
    report = json.loads(out.read_text())
    assert report["lookup_hits"] == simulated.hit_blocks and report["blocks_looked_up"] == full_blocks
    # token-weighted, over the full blocks looked up (512 tokens each, the driven replay's)
    assert report["lookup_tokens_found"] == simulated.hit_blocks * 512
    assert report["tokens_looked_up"] == full_blocks * 512
    assert f"{report['token_hit_rate']:.2%} of tokens ({simulated.hit_blocks * 512:,} tokens found" in report_run.stdout
    assert report["by_class"]["chat"]["hits"] == simulated.hit_blocks, "every hit was then read"
    assert report["hits_by_tier"]["dram"] > 0 and report["puts_by_class"]["chat"]["stored"] > 0
    log.write_text(log.read_text() + "garbage line\n")
    assert kvstore("analytics", "log", str(log)).returncode == 2
    skipped = kvstore("analytics", "log", str(log), "--skip-bad")
    assert skipped.returncode == 0 and "prefix hit rate" in skipped.stdout
    assert "may not be flushed yet" in skipped.stdout  # just written: its daemon could still be running
    os.utime(log, (time.time() - 3600, time.time() - 3600))
    assert "may not be flushed" not in kvstore("analytics", "log", str(log), "--skip-bad").stdout
