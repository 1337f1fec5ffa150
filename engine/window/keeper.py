"""One prefill engine's sliding-window state, and the plan that resumes a stored prefix with it.

A hybrid model resumes a stored prefix exactly only with its sliding layers' window as of the prefix's
end, which no block holds. For one prompt, `plan` says how far its stored prefix resumes, where the
window there comes from and what that costs: at the last boundary before the prompt's last token, the
host tier (`HOST`, this process's windows of active sessions) or else the store's window record
(`STORE`, saved by whichever engine served the session's last turn); where neither holds it, an earlier
boundary whose window the tier holds, or bounded replay at the last one (`REPLAY`: its last R tokens
recomputed, an approximate window) where that saves much and the request accepts an approximation; or
nothing, and the prompt is computed from scratch. The engine then decides whether loading beats
recomputing and, where it loads, `apply` sets the request's KV up.

Once a request is computed, `keep_captured` keeps the windows it captured: the session's latest in the
tier and, write-behind, as the record of the block it follows, the session's older record deleted once
the newer one is settled, on the write-behind thread: no call here waits on the store. The engine's client
is passed to each call rather than kept: an engine may be handed another client (a restarted daemon's).

When a session's next turn is known to be coming (its reply ended in a tool call), `prefetch` has its
window ready: held in the tier until that turn reads it (`WindowTier.hold`), or where the tier no longer
has it, the record at its chain's end read ahead, off the engine thread, for the plan to take from
memory. Records read ahead are bounded in bytes (as many as the tier's), the oldest dropped first, and
counted in `prefetches`: fetched, used, wasted (dropped unused), absent.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from functools import partial

import torch

from engine.model.kv import RequestKV, WindowState
from engine.window import record as window_records
from engine.window.replay import (
    REPLAYED_SUFFIX,
    begin_replay,
    default_replay_tokens,
    replayed_namespace,
    worth_replaying,
)
from engine.window.tier import WindowTier
from kvstore.block import Block, Namespace
from kvstore.client import PutSummary, StoreClient
from kvstore.client.assembly import Buffer, Deferred, Payload
from kvstore.codec import RAW

MAX_SESSIONS_TRACKED = 65_536  # sessions whose latest window record is remembered, to delete it once superseded
RECORD_SAVE_WAIT_S = 2.0  # how long a prefetch waits for the saves queued before it (the record's, likely)
# Where the window of a resumed prefix comes from (`PrefillResult.window_source` names the first two).
HOST = "host"  # this process's host tier
STORE = "store"  # the store's window record
REPLAY = "replay"  # rebuilt by bounded replay: approximate


@dataclass(frozen=True)
class StoredWindow:
    """A window read from the store's window record, checked; its rings are made where it is applied."""

    record: window_records.Checked
    nbytes: int  # the record's payload
    own_record: Block | None  # the record, where the reader's session saved it: superseded once it keeps a newer


@dataclass(frozen=True)
class WindowPlan:
    """Where a prompt's stored prefix resumes, where its window there comes from, and what that costs."""

    blocks: list[Block]  # the chain to load from: the prompt's exact chain, or the replayed one it went on in
    exact: bool  # whether `blocks` is the exact chain
    stored: int  # leading blocks of `blocks` the store holds
    resume: int  # leading blocks to load and resume after; 0: none, the prompt is computed from scratch
    source: str | None = None  # HOST, STORE or REPLAY where `resume` > 0 (None for a model without sliding layers)
    replayed: int = 0  # tokens of the prefix that REPLAY recomputes (R, or the whole prefix if shorter)
    stored_window: StoredWindow | None = None  # the window read from the store's record (STORE)
    capture_at: int | None = None  # where the prompt leaves the stored prefix, not resumed there: a window to keep

    @classmethod
    def without_window(cls, blocks: list[Block], stored: int, tokens: int, block_tokens: int) -> WindowPlan:
        """For a model without sliding layers: resume at the last stored boundary before the last token."""
        return cls(blocks, True, stored, resumable(stored, tokens, block_tokens))


def resumable(stored: int, tokens: int, block_tokens: int) -> int:
    """Of `stored` leading blocks, how many a prompt of `tokens` tokens can resume after: its last token is
    always computed, for its logits."""
    return min(stored, (tokens - 1) // block_tokens)


class WindowKeeper:
    def __init__(self, block_tokens: int, window: int, tier_bytes: int, store_records: bool,
                 replay_tokens: int | None, replay_min_prefix_factor: float) -> None:
        """`window`: the model's sliding window W; `replay_tokens`: R (None: the default for W, 0: never replay);
        `store_records`: save each session's latest window in the store too."""
        self.block_tokens = block_tokens
        self.tier = WindowTier(tier_bytes)
        self.store_records = store_records
        self.replay_tokens = default_replay_tokens(window) if replay_tokens is None else replay_tokens
        self.replay_min_prefix_factor = replay_min_prefix_factor
        self.misses: Counter[str] = Counter()  # window records looked up and not used, by cause
        self._session_records: OrderedDict[str, Block] = OrderedDict()  # session -> its latest window record
        self._records_lock = threading.Lock()  # the engine thread and the write-behind thread settle records
        self.prefetches: Counter[str] = Counter()  # window records read ahead of their turn, by what became of them
        self._prefetched: OrderedDict[bytes, Buffer] = OrderedDict()  # record key -> payload, oldest first
        self._prefetched_bytes = 0
        # records read ahead hold the windows of the sessions about to go on: room for as many as the tier
        self._prefetch_budget = tier_bytes
        self._prefetch_lock = threading.Lock()  # the threads that prefetch and the lookups' thread

    # -- resuming a stored prefix -----------------------------------------------------------------------

    def plan(self, client: StoreClient, namespace: Namespace, tokens: list[int], blocks: list[Block], stored: int,
             rings: torch.Tensor, accepts_approximate: bool, session_id: str | None) -> WindowPlan:
        """Where the prompt `tokens` resumes and where its window there comes from. `blocks` is its exact chain
        (in `namespace`), of which the store holds `stored` leading blocks; `rings` its KV's rings, whose shape
        and dtype a record must fit (only those are read: the plan is made off the engine thread and does no
        tensor work); `accepts_approximate`: it may be replayed; `session_id` (of the namespace's tenant) tells
        its session's own record from another's.

        A conversation that went on from a replay has its later blocks in the replayed chain: the plan takes
        that chain where it holds more of the prompt than the exact one, or as much and the window kept at
        its end. It resumes at the last resumable boundary whose window the tier or the store's record
        holds; where that is earlier than the last resumable boundary, a request that accepts an
        approximation is replayed at the last one instead, if that saves much (`worth_replaying`)."""
        B, n = self.block_tokens, len(tokens)
        may_replay = accepts_approximate and self.replay_tokens > 0
        exact = True
        if may_replay and (stored < len(blocks) or not self._kept(blocks, stored, n)):
            replayed = replayed_namespace(namespace).blocks(tokens)
            replayed_stored = client.lookup(replayed)
            if replayed_stored > stored or (replayed_stored == stored and self._kept(replayed, stored, n)
                                            and not self._kept(blocks, stored, n)):
                blocks, stored, exact = replayed, replayed_stored, False
        if stored == 0:
            return WindowPlan(blocks, exact, 0, 0)
        last = resumable(stored, n, B)
        resume, found = last, None  # blocks to resume after exactly: where the window is kept or recorded
        if resume and blocks[resume - 1].key not in self.tier:
            chain = namespace if exact else replayed_namespace(namespace)
            found = self.read_record(client, chain, blocks, resume, rings, exact, session_id)
        while resume and found is None and blocks[resume - 1].key not in self.tier:
            resume -= 1
        capture_at = stored * B if resume < stored else None
        if may_replay and resume < last and worth_replaying(last * B, resume * B, self.replay_tokens,
                                                            self.replay_min_prefix_factor):
            return WindowPlan(blocks, exact, stored, last, REPLAY, min(self.replay_tokens, last * B),
                              capture_at=capture_at)  # no record was found: it would have resumed at `last`
        source = (STORE if found is not None else HOST) if resume else None
        return WindowPlan(blocks, exact, stored, resume, source, 0, found, capture_at)

    def apply(self, plan: WindowPlan, kv: RequestKV) -> bool:
        """Set `kv`, into which the plan's `resume` blocks are to be loaded, to continue from there: the window
        restored, or the replay begun. False, `kv` untouched, where the tier's window went since the plan."""
        if plan.source == REPLAY:
            begin_replay(kv, plan.resume * self.block_tokens, self.replay_tokens)
            return True
        if plan.stored_window is not None:
            assert kv.rings is not None, "a window record is read only for a model with sliding layers"
            state: WindowState | None = plan.stored_window.record.state(kv.rings)
        else:
            state = self.tier.get(plan.blocks[plan.resume - 1].key)
        if state is None:
            return False
        kv.restore_window(state)
        return True

    def _kept(self, blocks: list[Block], stored: int, tokens: int) -> bool:
        """Whether the tier holds the window a prompt of `tokens` tokens would resume from in `blocks`."""
        last = resumable(stored, tokens, self.block_tokens)
        return last > 0 and blocks[last - 1].key in self.tier

    # -- keeping windows ---------------------------------------------------------------------------

    def keep(self, client: StoreClient | None, block: Block, state: WindowState, chain: Namespace,
             session_id: str | None, superseded: Block | None = None, keep_older: bool = False) -> bool:
        """Keep `state`, the sliding window as of the end of `block` (a block of `chain`), as the latest state
        of the session `session_id` (sessions are per tenant): in the tier under the block's key, and in
        the store as the block's window record (write-behind). The session's older record is deleted, since
        its next turn never resumes from an earlier boundary: the last one this keeper saved for it, and
        `superseded`, a record of this session another engine saved (the one this request resumed from).
        Requests of no session delete nothing: their records expire. False if the tier cannot keep it.
        `keep_older` (a reply's window, kept after its prompt's): the session's older state stays in the tier, as
        an ordinary one (WindowTier.put); its record in the store goes all the same: a record weighs as much as
        dozens of blocks, too much to keep for a prompt that may be sent again."""
        session = _session(block, session_id)
        kept = self.tier.put(block.key, state, session, keep_older)
        replayed_into_exact = state.window_from and not chain.model_id.endswith(REPLAYED_SUFFIX)
        if client is not None and self.store_records and not replayed_into_exact:
            record = window_records.window_record(chain, block)
            raw = window_records.encode(state, window_records.session_tag(session))  # the tensor copy: here
            codec = chain.layout.codec  # the encoding: on the write-behind thread, never the engine's
            payload: Payload = raw if codec == RAW else Deferred(partial(window_records.recoded, raw, codec), len(raw))
            # the older records go once this one's save is done, on the write-behind thread: never on the
            # engine's, and never before the save they are superseded by. Where the queue drops the save, they
            # stay: the session's is deleted after its next save that goes through, `superseded` expires.
            client.save([(record, payload)], 1, window_records.WINDOW_CLASS,
                        then=partial(self._settle_record, client, session, record, superseded))
        return kept

    def keep_captured(self, client: StoreClient | None, captured: dict[int, WindowState], blocks: list[Block],
                      chain: Namespace, session_id: str | None, superseded: Block | None) -> None:
        """Keep the windows a request captured at block boundaries of `blocks` (its chain, in `chain`): the one
        at the chain's end as the session's latest state (`keep`), the others (where the prompt left a stored
        shared prefix) in the tier alone."""
        exact = not chain.model_id.endswith(REPLAYED_SUFFIX)
        for boundary, state in sorted(captured.items()):
            if boundary % self.block_tokens or (exact and state.window_from):
                continue  # not a block boundary (a hand-off's); a replayed window never goes with an exact chain
            block = blocks[boundary // self.block_tokens - 1]
            if boundary == len(blocks) * self.block_tokens:  # the session's latest state
                self.keep(client, block, state, chain, session_id, superseded)
            else:
                self.tier.put(block.key, state)

    def _settle_record(self, client: StoreClient, session: str | None, record: Block, superseded: Block | None,
                       summary: PutSummary | None) -> None:
        """Once the save of `record`, `session`'s newest window record, is done (on the write-behind thread,
        in save order): remember it as the session's own only if the daemon stored it, since a record it
        answered EXISTS for was saved first by another session whose turn ended at the same boundary, and
        is that session's to supersede, not this one's; then delete the session's older records."""
        with self._records_lock:
            older = [self._session_records.pop(session, None) if session is not None else None, superseded]
            if summary is not None and summary.stored and session is not None:
                self._session_records[session] = record
                if len(self._session_records) > MAX_SESSIONS_TRACKED:
                    self._session_records.popitem(last=False)
        dead = {r.key: r for r in older if r is not None and r.key != record.key}
        if dead:
            client.delete(list(dead.values()))

    def read_record(self, client: StoreClient, chain: Namespace, blocks: list[Block], count: int, rings: torch.Tensor,
                    exact: bool, session_id: str | None) -> StoredWindow | None:
        """The window as of the end of the first `count` of `blocks` (a chain in `chain`, exact or replayed), from
        the store's window record, checked against `rings` (a request's: shape and dtype); None (the cause
        counted in `misses`) where it is absent or not that window: never an error."""
        if not self.store_records:
            return None
        record = window_records.window_record(chain, blocks[count - 1])
        payload = self._take_prefetched(record.key)
        if payload is None:
            found = client.get([record])
            if not found:  # absent, expired, or refused by verification (the client counts which)
                self.misses["absent"] += 1
                return None
            payload = found[0].payload
        try:
            checked = window_records.check(payload, count * self.block_tokens, rings, exact, chain.layout.codec)
        except window_records.CorruptWindow as exc:
            self.misses[exc.cause] += 1
            return None
        own = checked.session and checked.session == window_records.session_tag(_session(record, session_id))
        return StoredWindow(checked, len(payload), record if own else None)

    # -- reading ahead of a turn ---------------------------------------------------------------------

    def prefetch(self, client: StoreClient, chain: Namespace, block: Block) -> bool:
        """Have the window at the end of `block` (of `chain`: a conversation's last full block) ready for the turn
        that resumes there: held in the tier where it is there, else its record read from the store. On any
        thread but the engine's: it
        waits on the store. Whether that turn's window is held for it now."""
        if self.tier.hold(block.key):  # this process keeps it: held there until the turn reads it
            return True
        if not self.store_records or not self._prefetch_budget:
            return False
        record = window_records.window_record(chain, block)
        with self._prefetch_lock:
            if record.key in self._prefetched:
                return True
        client.write_behind.wait_for(client.write_behind.mark(), RECORD_SAVE_WAIT_S)  # it may just have been queued
        found = client.get([record])
        if not found:
            self.prefetches["absent"] += 1
            return False
        payload = found[0].payload
        if len(payload) > self._prefetch_budget:
            self.prefetches["too_large"] += 1
            return False
        with self._prefetch_lock:
            if record.key not in self._prefetched:
                self._prefetched[record.key] = payload
                self._prefetched_bytes += len(payload)
                self.prefetches["fetched"] += 1
            while self._prefetched_bytes > self._prefetch_budget:
                _, dropped = self._prefetched.popitem(last=False)
                self._prefetched_bytes -= len(dropped)
                self.prefetches["wasted"] += 1
            return record.key in self._prefetched

    def _take_prefetched(self, key: bytes) -> Buffer | None:
        with self._prefetch_lock:
            payload = self._prefetched.pop(key, None)
            if payload is not None:
                self._prefetched_bytes -= len(payload)
                self.prefetches["used"] += 1
            return payload


def _session(block: Block, session_id: str | None) -> str | None:
    """A session qualified by its tenant (the block's): another tenant's session of the same name is another."""
    return f"{block.tenant.hex()}/{session_id}" if session_id is not None else None
