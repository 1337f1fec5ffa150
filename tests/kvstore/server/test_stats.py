"""The Stats RPC's structured samples: a real daemon's samples round-trip, label values whole whatever they hold."""

import os
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.block import KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.proto import method, pb
from kvstore.server.metrics import Metrics
from kvstore.stats import Sample, Stats

NS = Namespace("stats-test", KVLayout(num_layers=2, kv_heads=2, head_dim=16, dtype="float16"), block_tokens=16)
ODD = 'a,b=c}"x'  # each of , = } broke `name{label=value}`; " needs escaping on /metrics


def test_samples_add_up_by_name_and_labels():
    a = Stats([Sample("hits", {"tier": "dram"}, 2), Sample("hits", {"tier": "ssd"}, 3), Sample("disk", {}, 10)])
    b = Stats([Sample("hits", {"tier": "dram"}, 5), Sample("hits", {"tier": ODD}, 1)])
    assert a.value("hits") == 5 and a.value("hits", tier="ssd") == 3 and a.value("hits", tier="none") == 0
    assert a.value("missing") == 0
    total = Stats.sum([a, b])
    assert total.by("hits", "tier") == {"dram": 7, "ssd": 3, ODD: 1}
    assert total.value("disk") == 10 and not Stats()
    assert Sample("x", {"k": ODD}).text() == 'x{k="a,b=c}\\"x"}'


def test_metrics_keep_label_values_whole():
    metrics = Metrics()
    metrics.blocks.labels(traffic_class=ODD).set(4)
    metrics.rpc_errors.labels(method="Get", code="A=B,C}").inc()
    samples = Stats(metrics.samples())
    assert samples.value("kvstore_blocks", traffic_class=ODD) == 4
    assert samples.by("kvstore_rpc_errors_total", "code", method="Get") == {"A=B,C}": 1}
    assert not any(s.name.endswith(("_bucket", "_created")) for s in samples)


@pytest.mark.integration
def test_a_daemons_samples_round_trip_with_a_label_value_holding_comma_equals_brace(daemons, tmp_path):
    config = tmp_path / "classes.toml"
    config.write_text(f'[classes]\nchat = "7d"\n"{ODD.replace(chr(34), chr(92) + chr(34))}" = "1d"\n')
    daemon, = daemons(1, "--config", str(config), "--metrics-port", "0")
    items = [(block, os.urandom(NS.block_bytes)) for block in NS.blocks(range(3 * NS.block_tokens))]
    with KVClient([daemon.address]) as client:
        assert client.put(items, NS.num_layers, ODD).stored == 3
        assert len(client.get([b for b, _ in items])) == 3
        client.server_stats()  # so that the next one, like /metrics below, counts a Stats call
        stats = client.server_stats()[daemon.address]
    assert isinstance(stats, Stats)
    assert stats.value("kvstore_blocks", traffic_class=ODD) == 3
    assert stats.by("kvstore_class_hits_total", "traffic_class") == {ODD: 3}
    assert stats.value("kvstore_puts_total", result="stored") == 3
    assert Sample("kvstore_blocks", {"traffic_class": ODD}, 3.0) in stats.samples

    # The same samples as /metrics: every name and label set, and the values nothing changes in between.
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    exposed = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if not s.name.endswith(("_bucket", "_created"))}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in stats}
    assert got.keys() == exposed.keys()
    steady = [k for k in got if k[0] in ("kvstore_blocks", "kvstore_class_hits_total", "kvstore_puts_total",
                                         "kvstore_hits_total", "kvstore_capacity_bytes")]
    assert steady and all(got[k] == exposed[k] for k in steady)

    # For one release the daemon still fills the old flat map, for clients older than `samples`.
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.unary_unary(method("Stats"), pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString)
        response = call(pb.StatsRequest(), timeout=10)
    assert Stats.from_pb(response).value("kvstore_blocks", traffic_class=ODD) == 3
    assert response.values[f"kvstore_blocks{{traffic_class={ODD}}}"] == 3
