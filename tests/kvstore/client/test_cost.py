import pytest

from kvstore.client.cost import BandwidthMeter, blocks_worth_loading

pytestmark = pytest.mark.unit


def attention_cost(a: float, b: float, per_token: float = 1e-4):
    """compute(x, y): x·(2L + x) + b·x style cost of tokens [x, y) after x cached (docs/design.md section 8)."""
    return lambda start, end: a * (end - start) * (start + end) + b * (end - start)


def test_meter_moving_average_and_defaults():
    meter = BandwidthMeter(alpha=0.5)
    assert meter.bytes_per_s("host") > meter.bytes_per_s("10.0.0.1:1") > 0
    meter.record("d", 100, 1.0)
    meter.record("d", 300, 1.0)
    assert meter.bytes_per_s("d") == 200
    meter.record("d", 0, 1.0)  # ignored
    assert meter.bytes_per_s("d") == 200


def test_a_fast_store_loads_everything_a_slow_one_nothing():
    block_bytes, block_tokens, total = 3 * 2**20, 256, 8192
    compute = attention_cost(a=1e-8, b=2e-4)  # ~1.6 s for 8K tokens from scratch
    fast, slow = BandwidthMeter(), BandwidthMeter()
    fast.record("d", 10 * 2**30, 1.0)
    slow.record("d", 20 * 2**20, 1.0)  # 20 MiB/s: a block takes 0.15 s, more than computing it
    sources = ["d"] * 30
    for pipelined in (True, False):
        assert blocks_worth_loading(sources, block_bytes, block_tokens, total, compute, fast, pipelined) == 30
    assert blocks_worth_loading(sources, block_bytes, block_tokens, total, compute, slow, pipelined=False) == 0
    # Overlapped with the compute of the rest, a slow load is free only while it is the shorter of the two.
    partial = blocks_worth_loading(sources, block_bytes, block_tokens, total, compute, slow, pipelined=True)
    assert 0 < partial < 30
    load_s = partial * block_bytes / slow.bytes_per_s("d")
    assert load_s <= compute(partial * block_tokens, total) * 1.2


def test_pipelining_makes_more_worth_loading_than_load_then_compute():
    block_bytes, block_tokens, total = 2**20, 256, 4096
    compute = attention_cost(a=0, b=1e-4)  # 25.6 ms a block to compute
    meter = BandwidthMeter()
    meter.record("d", 30 * 2**20, 1.0)  # ~33 ms a block to load: slower than computing it
    sources = ["d"] * 15
    serial = blocks_worth_loading(sources, block_bytes, block_tokens, total, compute, meter, pipelined=False)
    overlapped = blocks_worth_loading(sources, block_bytes, block_tokens, total, compute, meter, pipelined=True)
    assert serial == 0 and 0 < overlapped < 15, "overlap hides part of the load behind the rest's compute"


def test_host_blocks_count_at_host_speed():
    meter = BandwidthMeter()
    meter.record("d", 2**20, 1.0)  # a slow daemon
    compute = attention_cost(a=0, b=1e-3)
    assert blocks_worth_loading(["host"] * 4 + ["d"] * 4, 2**20, 16, 128, compute, meter) == 4
