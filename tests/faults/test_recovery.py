"""Start-up recovery of the index (docs/design.md invariant 7).

* A missing or emptied index is rebuilt from the self-describing segments, and no segment is deleted.
* A damaged LMDB meta page: fsck says so cleanly, the daemon moves the index aside and rebuilds it.
* `kvstore fsck --rebuild` on a stopped daemon's directory, then a start that serves everything.
* An index entry pointing at another key's record is dropped at start-up, and the key's own record indexed.
* The finer cases in-process: what a rebuilt entry carries, the newest copy of a key, damaged records.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import lmdb
import pytest

from kvstore.block import Block, KVLayout, Namespace, chain_hash
from kvstore.record import build_record, decode_header
from kvstore.server.config import ServerConfig
from kvstore.server.frames import FRAME_BYTES, KEY_FILE
from kvstore.server.fsck import check
from kvstore.server.index import Entry, Index
from kvstore.server.outcomes import Miss, PutResult
from kvstore.server.store import BlockStore
from tests.kvstore.server.conftest import Clock, put_all, read_all, records

from .conftest import NS, Item, client_for, raw_get

pytestmark = pytest.mark.crash

NS_B = Namespace(NS.model_id, NS.layout, NS.block_tokens, salt="tenant-b")  # another tenant, same model
# In-process: records of about 1.2 KB, six to a segment of 8 KiB.
NS_SMALL = Namespace("recovery-test", KVLayout(num_layers=2, kv_heads=1, head_dim=16, dtype="float16"), block_tokens=8)
SMALL_SEGMENTS = ("--segment-bytes", "40KiB")  # two 16 KiB blocks a segment: several segments
META_PAGE_0_VERSION = 16 + 4  # data.mdb: page header (16 bytes), the meta's magic (4), then its version (u32)


def prompt(namespace: Namespace, seed: int, n: int) -> list[Item]:
    start = seed * 4096
    blocks = namespace.blocks(range(start, start + n * namespace.block_tokens))
    return [(block, os.urandom(namespace.block_bytes)) for block in blocks]


def fill(daemon) -> list[Item]:
    """Blocks of two tenants and two traffic classes, put; returned in a known order."""
    chat, agent = prompt(NS, 1, 4), prompt(NS_B, 2, 3)
    with client_for(daemon) as client:
        assert client.put(chat, NS.num_layers, "chat").stored == len(chat)
        assert client.put(agent, NS.num_layers, "agent").stored == len(agent)
    return chat + agent


def served_all(daemon, stored: list[Item]) -> bool:
    served = raw_get(daemon.address, [block.key for block, _ in stored])
    return [got.payload for got in served] == [payload for _, payload in stored]


def segment_files(data_dir: Path) -> set[str]:
    return {path.stem for path in (data_dir / "segments").iterdir()}


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=60)


def lose_index(data_dir: Path, how: str) -> None:
    index = data_dir / "index"
    if how == "deleted":
        shutil.rmtree(index)
    elif how == "emptied":
        for path in index.iterdir():
            path.unlink()
    elif how == "damaged":
        with open(index / "data.mdb", "r+b") as f:
            f.seek(META_PAGE_0_VERSION)
            f.write(b"\xfe")  # LMDB data format v254
    else:
        raise ValueError(how)


# -- real daemons -------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_a_lost_index_is_rebuilt_and_no_segment_is_deleted(daemons, how):
    daemon, = daemons(1, *SMALL_SEGMENTS)
    stored = fill(daemon)
    assert daemon.stop() == 0
    segments = segment_files(daemon.data_dir)
    assert len(segments) >= 3
    lose_index(daemon.data_dir, how)

    daemon.start()
    assert segment_files(daemon.data_dir) == segments, "a segment holding verifiable records was deleted"
    assert served_all(daemon, stored), "every block must be served, byte for byte, from the rebuilt index"
    assert "rebuilding the index" in daemon.log()
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()
    report = check(daemon.data_dir)
    assert report.ok and report.entries == len(stored) and report.unindexed == 0, report.problems[:3]


def test_a_damaged_meta_page_is_reported_by_fsck_and_rebuilt_by_the_daemon(daemons):
    daemon, = daemons(1, *SMALL_SEGMENTS)
    stored = fill(daemon)
    assert daemon.stop() == 0
    lose_index(daemon.data_dir, "damaged")
    damaged_bytes = (daemon.data_dir / "index" / "data.mdb").read_bytes()

    fsck = kvstore("fsck", str(daemon.data_dir))
    assert fsck.returncode == 1
    assert "Traceback" not in fsck.stdout + fsck.stderr, fsck.stderr
    assert "the index is damaged" in fsck.stdout and f"kvstore fsck --rebuild {daemon.data_dir}" in fsck.stdout

    daemon.start()
    assert served_all(daemon, stored)
    aside, = daemon.data_dir.glob("index.damaged-*")
    assert (aside / "data.mdb").read_bytes() == damaged_bytes, "the damaged index is kept as it was"
    assert "moved it aside" in daemon.log()
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()
    assert check(daemon.data_dir).ok


@pytest.mark.kills_daemons
@pytest.mark.parametrize("nth", [1, 2, 3, 5])
@pytest.mark.parametrize("rebuilder", ["daemon", "fsck --rebuild"])
def test_a_rebuild_cut_short_by_a_crash_is_done_again_whole_and_deletes_no_segment(daemons, rebuilder, nth):
    """Killed at its nth index commit (the mark of the rebuild, the traffic classes, the tenants, the entries):
    the partial index is never trusted as whole, which would make every record it lacks dead."""
    daemon, = daemons(1, *SMALL_SEGMENTS)
    stored = fill(daemon)
    assert daemon.stop() == 0
    segments = segment_files(daemon.data_dir)
    lose_index(daemon.data_dir, "deleted")
    kill = {"KVSTORE_FAULTS": f"index.after_commit=kill@{nth}"}
    if rebuilder == "daemon":
        with pytest.raises(RuntimeError):  # killed during start-up: it never answers
            daemon.start(extra_env=kill)
    else:
        cut = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--rebuild", str(daemon.data_dir)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, **kill})
        assert cut.returncode == -9
        report = check(daemon.data_dir)
        assert not report.ok and "cut short" in report.problems[0], "fsck tells a partial index from a whole one"
    daemon.start()
    assert segment_files(daemon.data_dir) == segments, "a segment holding verifiable records was deleted"
    assert served_all(daemon, stored)
    assert "rebuild of the index was cut short" in daemon.log() or "the index is missing" in daemon.log()


@pytest.mark.parametrize("how", ["deleted", "damaged"])
def test_fsck_rebuild_of_a_stopped_daemon_then_a_start_serves_everything(daemons, how):
    daemon, = daemons(1, *SMALL_SEGMENTS)
    stored = fill(daemon)
    busy = kvstore("fsck", "--rebuild", str(daemon.data_dir))
    assert busy.returncode == 1 and "stop it first" in busy.stderr and "Traceback" not in busy.stderr
    assert daemon.stop() == 0
    lose_index(daemon.data_dir, how)

    rebuilt = kvstore("fsck", "--rebuild", str(daemon.data_dir))
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    assert f"index rebuilt: {len(stored)} records indexed" in rebuilt.stdout
    assert f"{len(stored)} index entries, {len(stored)} verified, 0 problems" in rebuilt.stdout
    assert ("moved aside" in rebuilt.stdout) == (how == "damaged")

    daemon.start()
    assert served_all(daemon, stored)
    assert "rebuilding the index" not in daemon.log(), "the daemon must trust the index fsck rebuilt"


def test_an_entry_pointing_at_another_keys_record_is_dropped_and_the_right_record_indexed(daemons):
    daemon, = daemons(1, *SMALL_SEGMENTS)
    stored = fill(daemon)
    assert daemon.stop() == 0
    (victim, _), (other, _) = stored[0], stored[-1]
    env = lmdb.open(str(daemon.data_dir / "index"), max_dbs=4)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        theirs = Entry.unpack(txn.get(other.key))
        mine = Entry.unpack(txn.get(victim.key))
        assert mine.segment != theirs.segment, "the record pointed at must lie in another (sealed) segment"
        txn.put(victim.key, replace(mine, segment=theirs.segment, offset=theirs.offset).pack())
    env.close()
    assert "belongs to another key" in " ".join(check(daemon.data_dir).problems)

    daemon.start()
    assert served_all(daemon, stored), "the victim must be served from its own record, the others as before"
    assert "the record at its place belongs to another key" in daemon.log()
    assert daemon.stop() == 0
    assert check(daemon.data_dir).ok
    with lmdb.open(str(daemon.data_dir / "index"), max_dbs=4, readonly=True, lock=False) as env:
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            now = Entry.unpack(txn.get(victim.key))
    assert (now.segment, now.offset) == (mine.segment, mine.offset), "indexed again at its own record"


# -- in-process -------------------------------------------------------------------------------------


@pytest.fixture
async def store_at(tmp_path):
    """store_at(clock) -> an opened BlockStore on tmp_path/data with small segments; closed at the end."""
    stores: list[BlockStore] = []

    async def make(clock: Clock) -> BlockStore:
        store = BlockStore(ServerConfig(data_dir=tmp_path / "data", segment_bytes=8192, expiry_bucket_s=3600),
                           clock=clock)
        await store.open()
        stores.append(store)
        return store

    yield make
    for store in stores:
        if not store.closed:
            await store.close()


def without_tenant(block: Block) -> Block:
    # a record with no tenant, keyed as format 1 keyed it
    return Block(block.namespace, chain_hash(block.parent, block.tokens), block.parent, block.tokens)


async def test_a_rebuilt_entry_has_its_class_parent_tenant_and_the_bucket_end_as_expiry(store_at, tmp_path, caplog,
                                                                                   monkeypatch):
    clock = Clock()
    store = await store_at(clock)
    salted = Namespace(NS_SMALL.model_id, NS_SMALL.layout, NS_SMALL.block_tokens, salt="tenant-b")
    recs = records(3, "chat", seed=1, namespace=NS_SMALL) + records(2, "agent", seed=2, namespace=salted)
    block = without_tenant(records(1, seed=3, namespace=NS_SMALL)[0][0])
    header_bytes, payload = build_record(block, os.urandom(NS_SMALL.block_bytes), NS_SMALL.num_layers, "chat")
    recs.append((block, header_bytes, decode_header(header_bytes), payload))
    await put_all(store, recs)
    tenants = {v: k for k, v in store.index.tenants().items()}
    before = {r[0].key: store.index.get(r[0].key) for r in recs}
    assert before[block.key].tenant_id == 0 and len({e.tenant_id for e in before.values()}) == 3
    await store.close()
    shutil.rmtree(tmp_path / "data" / "index")

    monkeypatch.setattr("kvstore.server.recovery.PROGRESS_INTERVAL_S", 0.0)
    caplog.set_level(logging.INFO, logger="kvstore.server.recovery")
    store = await store_at(clock)
    assert "rebuilding the index: " in caplog.text, "a rebuild must show its progress in the log"
    names = {v: k for k, v in store.index.classes().items()}
    new_tenants = {v: k for k, v in store.index.tenants().items()}
    for block, _, header, payload in recs:
        old, new = before[block.key], store.index.get(block.key)
        assert (new.segment, new.offset, new.header_len, new.payload_len) == (old.segment, old.offset, old.header_len,
                                                                             old.payload_len)
        assert names[new.class_id] == header.traffic_class
        assert new.parent == header.parent
        assert new_tenants.get(new.tenant_id, bytes(16)) == tenants.get(old.tenant_id, bytes(16)) == header.tenant
        assert new.expires_ms == store.segments.segments[new.segment].bucket_end * 1000 >= old.expires_ms
        assert await read_all(store, block.key) == payload
    assert store.accounting.live_bytes == sum(len(r[1]) + len(r[3]) for r in recs)


async def test_the_newest_copy_of_a_key_wins_a_rebuild(store_at, tmp_path):
    clock = Clock()
    store = await store_at(clock)
    (block, header_bytes, header, first), = records(1, namespace=NS_SMALL)
    others = records(3, seed=5, namespace=NS_SMALL)
    await put_all(store, [(block, header_bytes, header, first)] + others)
    await store.delete([block.key])
    second = os.urandom(NS_SMALL.block_bytes)
    header_bytes, second = build_record(block, second, NS_SMALL.num_layers, "chat")
    assert await store.put(decode_header(header_bytes), header_bytes, [second]) == PutResult.STORED
    await store.close()
    shutil.rmtree(tmp_path / "data" / "index")

    store = await store_at(clock)
    assert await read_all(store, block.key) == second
    assert store.accounting.live_bytes == (len(header_bytes) + len(second)) * 4


async def test_a_rebuild_skips_damaged_records_and_finds_the_whole_ones_after_them(store_at, tmp_path):
    clock = Clock()
    store = await store_at(clock)
    recs = records(3, seed=6, namespace=NS_SMALL)  # all in one segment
    await put_all(store, recs)
    await store.close()
    path, = (tmp_path / "data" / "segments").glob("*.sealed")
    stored_len = FRAME_BYTES + len(recs[0][1]) + len(recs[0][3])  # each record behind its frame
    with open(path, "r+b") as f:
        f.seek(stored_len - 1)  # the last payload byte of the first record
        byte = f.read(1)
        f.seek(stored_len - 1)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.seek(stored_len + FRAME_BYTES + 60)  # the second record's header (its key): its header checksum fails
        f.write(b"\x00" * 8)
    shutil.rmtree(tmp_path / "data" / "index")

    store = await store_at(clock)
    assert [isinstance(await read_all(store, r[0].key), Miss) for r in recs] == [True, True, False]
    assert await read_all(store, recs[2][0].key) == recs[2][3]
    assert path.exists()


async def test_a_deleted_block_stays_deleted_across_a_restart(store_at):
    """A trusted index is the proof a record is dead: reconciling never brings a deleted block back."""
    clock = Clock()
    store = await store_at(clock)
    recs = records(4, seed=7, namespace=NS_SMALL)
    await put_all(store, recs)
    await store.delete([recs[1][0].key])
    await store.close()
    store = await store_at(clock)
    assert isinstance(await read_all(store, recs[1][0].key), Miss)
    assert store.lookup([r[0].key for r in recs]) == 1



async def test_segments_that_lost_their_frame_key_are_set_aside_never_deleted_and_the_daemon_starts_empty(
        store_at, tmp_path, caplog):
    """Without the key, nothing in the segments can be told from bytes a tenant sent (a data directory from before
    frames, or a key lost): they are kept aside for the operator, and nothing in them is served."""
    clock = Clock()
    store = await store_at(clock)
    recs = records(3, seed=8, namespace=NS_SMALL)
    await put_all(store, recs)
    await store.close()
    segments_dir = tmp_path / "data" / "segments"
    files = sorted(p.name for p in segments_dir.iterdir() if p.name != KEY_FILE)
    (segments_dir / KEY_FILE).unlink()
    with caplog.at_level(logging.ERROR):
        store = await store_at(clock)
    aside, = tmp_path.glob("data/segments.unframed-*")
    assert sorted(p.name for p in aside.iterdir()) == files, "every segment kept as it was"
    assert "moved the segments aside" in caplog.text
    assert store.lookup([r[0].key for r in recs]) == 0
    await put_all(store, recs[:1])  # and the daemon goes on, with a key of its own
    assert await read_all(store, recs[0][0].key) == recs[0][3]
    assert (segments_dir / KEY_FILE).exists()


async def test_an_entry_pointing_into_a_payload_at_a_well_formed_record_is_no_record(store_at, tmp_path):
    """An index that points where a tenant's payload holds a whole, well-formed record of the key (a stale or
    foreign index) is trusted no more than a scan would be: without the daemon's frame there, the entry is
    dropped at start-up and `kvstore fsck` names it."""
    clock = Clock()
    store = await store_at(clock)
    (victim, victim_header, _, _), = records(1, seed=9, namespace=NS_SMALL)
    forged_payload = b"\xaa" * NS_SMALL.block_bytes
    forged_header, _ = build_record(victim, forged_payload, NS_SMALL.num_layers, "chat")
    (carrier, carrier_header, carrier_parsed, payload), = records(1, seed=10, namespace=NS)
    inside = forged_header + forged_payload
    await put_all(store, [(carrier, carrier_header, carrier_parsed, inside + payload[len(inside) :])])
    entry = store.index.get(carrier.key)
    await store.close()
    index = Index(tmp_path / "data" / "index", 1 << 24, 1 << 30, fsync=True)
    forged_entry = replace(entry, offset=entry.offset + entry.header_len, header_len=len(forged_header),
                           payload_len=len(forged_payload), parent=victim.parent)
    index.submit(index.put_op(victim.key, forged_entry)).result()
    index.close()
    assert any("no frame" in problem for problem in check(tmp_path / "data").problems)
    store = await store_at(clock)
    assert store.lookup([victim.key]) == 0 and store.lookup([carrier.key]) == 1
