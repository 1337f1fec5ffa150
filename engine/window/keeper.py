"""One prefill engine's sliding-window state: the host tier and the store's window records of its sessions.

The keeper keeps a session's latest window in the host tier and, write-behind, as the window record of
the block it follows, and deletes the session's older record once the newer one is settled; it reads a
record back for a resumed prefix whose window the tier does not hold. The engine's client is passed to
each call rather than kept: an engine may be handed another client (a restarted daemon's).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from functools import partial

from engine.model.kv import RequestKV, WindowState
from engine.window import record as window_records
from engine.window.replay import REPLAYED_SUFFIX, default_replay_tokens
from engine.window.tier import WindowTier
from kvstore.block import Block, Namespace
from kvstore.client import KVClient, PutSummary

MAX_SESSIONS_TRACKED = 65_536  # sessions whose latest window record is remembered, to delete it once superseded


@dataclass(frozen=True)
class StoredWindow:
    """A window read from the store's window record."""

    state: WindowState
    nbytes: int  # the record's payload
    own_record: Block | None  # the record, where the reader's session saved it: superseded once it keeps a newer


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

    def keep(self, client: KVClient | None, block: Block, state: WindowState, chain: Namespace,
             session_id: str | None, superseded: Block | None = None) -> bool:
        """Keep `state`, the sliding window as of the end of `block` (a block of `chain`), as the latest state
        of the session `session_id` (sessions are per tenant): in the tier under the block's key, and in
        the store as the block's window record (write-behind). The session's older record is deleted, since
        its next turn never resumes from an earlier boundary: the last one this keeper saved for it, and
        `superseded`, a record of this session another engine saved (the one this request resumed from).
        Requests of no session delete nothing: their records expire. False if the tier cannot keep it."""
        session = _session(block, session_id)
        kept = self.tier.put(block.key, state, session)
        replayed_into_exact = state.window_from and not chain.model_id.endswith(REPLAYED_SUFFIX)
        if client is not None and self.store_records and not replayed_into_exact:
            record = window_records.window_record(chain, block)
            payload = window_records.encode(state, window_records.session_tag(session))
            settle = partial(self._settle_record, client, session, record, superseded)
            if not client.save([(record, payload)], 1, window_records.WINDOW_CLASS, then=settle):
                settle(None)  # dropped: the older records are superseded all the same
        return kept

    def keep_captured(self, client: KVClient | None, captured: dict[int, WindowState], blocks: list[Block],
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

    def _settle_record(self, client: KVClient, session: str | None, record: Block, superseded: Block | None,
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

    def read_record(self, client: KVClient, chain: Namespace, blocks: list[Block], count: int, kv: RequestKV,
                    exact: bool, session_id: str | None) -> StoredWindow | None:
        """The window as of the end of the first `count` of `blocks` (a chain in `chain`, exact or replayed), from
        the store's window record, as rings for `kv`; None (the cause counted in `misses`) where it is absent
        or not that window: never an error."""
        if not self.store_records:
            return None
        found = client.get([window_records.window_record(chain, blocks[count - 1])])
        if not found:  # absent, expired, or refused by verification (the client counts which)
            self.misses["absent"] += 1
            return None
        try:
            state, session = window_records.decode(found[0].payload, count * self.block_tokens, kv.rings, exact)
        except window_records.CorruptWindow as exc:
            self.misses[exc.cause] += 1
            return None
        own = session and session == window_records.session_tag(_session(found[0].block, session_id))
        return StoredWindow(state, len(found[0].payload), found[0].block if own else None)


def _session(block: Block, session_id: str | None) -> str | None:
    """A session qualified by its tenant (the block's): another tenant's session of the same name is another."""
    return f"{block.tenant.hex()}/{session_id}" if session_id is not None else None
