"""The parts of a Get, in the order they are sent; shared by the gRPC service and the data channel.

Each part is (GetPartHead, payload or None). With a `target`, payloads are read straight into the
buffer it names for each part (a client's shared-memory region) instead of a buffer of their own.
Block-major sends all requested layers of a block as one part; layer-major sends every block's header
first, then layer l of every block before layer l+1 of any, so that a loader can start on layer 0 while
later layers are in flight. The store's misses become the protocol's part statuses here (protocol_map.py).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable

from kvstore.proto import pb
from kvstore.record import CorruptRecord, RecordBytes
from kvstore.server.block_reader import OpenBlock
from kvstore.server.outcomes import Miss, MissStatus
from kvstore.server.protocol_map import part_status
from kvstore.server.store import BlockStore, Scope

READ_AHEAD = 3  # blocks of a block-major Get read ahead of the one being sent
Part = tuple[pb.GetPartHead, "RecordBytes | None"]
# (index of the key, first layer of the part, payload bytes) -> where to put the payload
Target = Callable[[int, int, int], "memoryview | None"]


async def get_parts(store: BlockStore, request: pb.GetRequest, target: Target | None = None,
                    scope: Scope = None) -> AsyncIterator[Part]:
    """The parts of `request`; blocks of tenants outside `scope` are MISSING, like absent ones."""
    opened: list[tuple[int, OpenBlock, int, int]] = []
    served: list[OpenBlock] = []
    served_bytes = 0
    try:
        if request.order == pb.LAYER_MAJOR:
            for index, key in enumerate(request.keys):
                found = await _open(store, request, index, key, scope)
                if isinstance(found, pb.GetPartHead):
                    yield found, None
                    if request.stop_at_miss:
                        break
                    continue
                opened.append(found)
                first = head(index, pb.OK, found[2], found[2], found[1].header_bytes, 0)
                first.replicas = store.replicas_wanted(found[1].key)  # one read of the block
                yield first, None
            alive = list(opened)
            for layer in range(request.layer_begin, max((o[3] for o in opened), default=0)):
                survivors = []
                for opened_block in alive:
                    index, block, _, end = opened_block
                    if layer >= end:
                        survivors.append(opened_block)
                        continue
                    if layer == request.layer_begin:
                        await store.warm(block)  # one read of the whole block, then layers from DRAM
                    part = await _read(store, block, layer, layer + 1, index, False, target)
                    yield part
                    if part[1] is None:
                        if request.stop_at_miss:
                            break  # this block and every later one are no longer part of the prefix
                        continue
                    served_bytes += len(part[1])
                    survivors.append(opened_block)
                alive = survivors
            served = [block for _, block, *_ in alive]
        else:
            async def fetch(index: int) -> tuple[OpenBlock | None, Part]:
                found = await _open(store, request, index, request.keys[index], scope)
                if isinstance(found, pb.GetPartHead):
                    return None, (found, None)
                opened.append(found)
                _, block, begin, end = found
                return block, await _read(store, block, begin, end, index, True, target)

            # The next blocks are read (on I/O threads, which release the GIL) while block i is checked
            # and sent, so reads overlap checksums, sends and each other.
            ahead = collections.deque(asyncio.ensure_future(fetch(i))
                                      for i in range(min(READ_AHEAD, len(request.keys))))
            try:
                for index in range(len(request.keys)):
                    fetched, part = await ahead.popleft()
                    if index + READ_AHEAD < len(request.keys):
                        ahead.append(asyncio.ensure_future(fetch(index + READ_AHEAD)))
                    yield part
                    if part[1] is None:
                        if request.stop_at_miss:
                            break
                        continue
                    assert fetched is not None, "a payload was read, so its block was opened"
                    served_bytes += len(part[1])
                    served.append(fetched)
            finally:
                for task in ahead:  # read ahead but not wanted: let them end, so their blocks can be closed
                    task.cancel()
                await asyncio.gather(*ahead, return_exceptions=True)
    finally:
        for _, block, *_ in opened:
            store.close_block(block)
        store.record_hits(served, served_bytes)


async def _open(store: BlockStore, request: pb.GetRequest, index: int,
                key: bytes, scope: Scope) -> tuple[int, OpenBlock, int, int] | pb.GetPartHead:
    found = await store.open_block(key, scope)
    if isinstance(found, Miss):
        return head(index, part_status(found.status), 0, 0, b"", 0, found.cause)
    n_layers = found.header.n_layers
    begin, end = request.layer_begin, request.layer_end or n_layers
    if not begin < end <= n_layers:  # a request's shape is never a reason to read, let alone drop, a block
        store.close_block(found)
        return head(index, pb.BAD_RANGE, begin, end, b"", 0, f"layers [{begin}, {end}) of a block of {n_layers}")
    return index, found, begin, end


async def _read(store: BlockStore, block: OpenBlock, begin: int, end: int, index: int, with_header: bool,
                target: Target | None) -> Part:
    header_bytes = block.header_bytes if with_header else b""
    try:
        into = target(index, begin, (end - begin) * block.header.layer_bytes) if target else None
        data = await store.read_layers(block, begin, end, into)
    except CorruptRecord as exc:
        miss = store.miss(MissStatus.CORRUPT, exc.cause, block.key, block.entry)
        return head(index, part_status(miss.status), begin, end, header_bytes, 0, miss.cause), None
    except OSError:
        miss = store.miss(MissStatus.UNAVAILABLE, "io_error", block.key, block.entry)
        return head(index, part_status(miss.status), begin, end, header_bytes, 0, miss.cause), None
    part = head(index, pb.OK, begin, end, header_bytes, len(data))
    if with_header:  # a block's first part: one read of it
        part.replicas = store.replicas_wanted(block.key)
    return part, data


def head(index: int, status: pb.PartStatus, begin: int, end: int, header: bytes, nbytes: int,
         cause: str = "") -> pb.GetPartHead:
    return pb.GetPartHead(index=index, status=status, layer_begin=begin, layer_end=end, header=header,
                          payload_bytes=nbytes, cause=cause)
