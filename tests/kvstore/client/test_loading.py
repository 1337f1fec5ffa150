import threading
import time

import pytest

from kvstore.client.loading import BufferDestination, LoadCancelled, LoadHandle, LoadProgress
from tests.waiting import parked_in, wait_for

pytestmark = pytest.mark.unit


def test_a_layer_is_complete_only_when_every_block_of_the_hit_has_it():
    progress = LoadProgress(num_layers=3, hit_blocks=2)
    progress.mark(0, 0)
    with pytest.raises(TimeoutError):
        progress.wait_layer(0, timeout=0.01)
    progress.mark(0, 1)
    assert progress.wait_layer(0, timeout=0.01) == 2
    progress.mark(2, 0)
    progress.mark(2, 1)
    with pytest.raises(TimeoutError):
        progress.wait_layer(2, timeout=0.01), "layers complete in order"


def test_a_shrunk_hit_releases_waiters_and_finish_drops_incomplete_blocks():
    progress = LoadProgress(num_layers=2, hit_blocks=3)
    for layer in range(2):
        progress.mark(layer, 0)
    progress.mark(0, 1)
    progress.shrink(2)  # block 2 failed
    assert progress.wait_layer(0, timeout=0.01) == 2
    progress.finish()  # block 1 never got layer 1
    assert progress.wait(timeout=0.01) == 1
    assert progress.wait_layer(1, timeout=0.01) == 1


def test_waiters_wake_when_the_layer_lands():
    progress = LoadProgress(num_layers=1, hit_blocks=1)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(progress.wait_layer(0, timeout=60)))
    waiter.start()
    wait_for(lambda: woke or parked_in(waiter, LoadProgress.wait_layer), "the waiter waiting for layer 0")
    assert not woke
    progress.mark(0, 0)
    waiter.join(timeout=60)
    assert woke == [1]


def test_cancel_stops_marks_and_waits_for_workers():
    progress = LoadProgress(num_layers=2, hit_blocks=1)
    stopped = []

    def worker():
        try:
            while True:
                progress.mark(0, 0)
                time.sleep(0.001)
        except LoadCancelled:
            stopped.append(True)

    thread = threading.Thread(target=worker)
    thread.start()
    handle = LoadHandle(progress, block_tokens=16, workers=[thread])
    handle.cancel()
    assert stopped == [True] and not thread.is_alive()
    with pytest.raises(LoadCancelled):
        handle.wait_layer(1, timeout=1)


def test_buffer_destination_views():
    buffers = [bytearray(8), bytearray(8)]
    destination = BufferDestination(buffers, num_layers=2, layer_bytes=4)
    destination.layer_view(1, 1)[:] = b"abcd"
    assert buffers[1] == bytearray(4) + b"abcd"
    with pytest.raises(ValueError, match="buffer 0"):
        BufferDestination([bytearray(7)], num_layers=2, layer_bytes=4)
