"""Saving a handed-over conversation's reply to the store as it fills blocks, so the next turn (whose
prompt holds this one's prompt and reply) finds it cached.

Write-behind through the prefill engine's client, in the chain the prompt's blocks went to: the exact
chain, or the replayed chain where the prompt's KV descends from a bounded replay (`PrefillResult.exact`).
A block is saved once every position of it is in the KV (the last sampled token never is), with the
bytes its pages hold. For a hybrid model the sliding window is captured at each block boundary the
sequence passes, only the latest kept (one per sequence), and kept when the sequence ends (the window tier
under that block's key and the request's session, and the store's window record): the next turn resumes
exactly from it, in this process or any other.

A sequence preempted between decode steps saves its state through the store, as a prefill hands a prompt
over to another process (`engine.prefill.handoff`: its blocks are saved already, the partial block and the window
go in a continuation record), and resumes from it by a prefill of its tokens `from_handoff`: only its last
token is computed again. Where that state is gone by then, the prefill falls back (loads what is stored,
or recomputes) and the chain follows what it got. A sequence preempted while still (re)prefilling
recomputes from scratch, which is exact: on the exact chain it goes on saving where it was; on the
replayed chain it moves to the exact chain and saves every block again from the first (as the prefill
engine does when it recomputes), dropping the replayed window it held.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.kv import RequestKV, WindowState
from engine.prefill import handoff
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import PrefillRequest, PrefillResult
from kvstore.block import Namespace, identity_tokens
from kvstore.eviction import ReuseHint


@dataclass
class ReplyChain:
    """Where one handed-over sequence's blocks go, and how far they went."""

    result: PrefillResult
    namespace: Namespace  # the chain's: exact, or the replayed twin
    exact: bool
    saved: int  # leading full blocks already in the store or queued for it
    window: WindowState | None = None  # the sliding window at the latest block boundary passed

    def identity(self, tokens: list[int]) -> list[int]:
        """The ids the chain keys `tokens` (prompt and reply, or a leading part) by: the prompt's images'
        placeholders drawn from their digests."""
        return identity_tokens(tokens, [image.span for image in self.result.request.images])


class ReplySaver:
    def __init__(self, prefill: PrefillEngine) -> None:
        self.prefill = prefill
        self.block_tokens = prefill.block_tokens
        self.hybrid = prefill.window_tier is not None

    def chain(self, result: PrefillResult) -> ReplyChain | None:
        """The chain a handed-over result's reply extends; None where there is no store to save to."""
        if self.prefill.client is None:
            return None
        namespace = self.prefill.chain_namespace(result.request, result.exact)
        return ReplyChain(result, namespace, result.exact, len(result.blocks))

    def before_chunk(self, chain: ReplyChain, kv: RequestKV, start: int, n: int) -> None:
        """Have the forward capture the window at the last block boundary in (start, start + n], if any."""
        if self.hybrid:
            boundary = (start + n) // self.block_tokens * self.block_tokens
            kv.capture_at = {boundary} if boundary > start else set()

    def after_chunk(self, chain: ReplyChain, kv: RequestKV, tokens: list[int], computed: int) -> None:
        """Once the KV holds positions [0, computed): save the blocks that filled, take the captured window."""
        for state in kv.captured.values():
            if not (chain.exact and state.window_from):  # a replayed window never goes with an exact chain
                chain.window = state
        kv.captured = {}
        full = computed // self.block_tokens
        if full > chain.saved:
            blocks = chain.namespace.blocks(chain.identity(tokens[: full * self.block_tokens]))[chain.saved:]
            result = chain.result
            hint = ReuseHint(result.stored_tokens // self.block_tokens, full, result.request.turn)
            self.prefill.save_blocks(blocks, kv.block_table[chain.saved : full], result.request, hint)
            chain.saved = full

    def save_state(self, chain: ReplyChain, kv: RequestKV, tokens: list[int]) -> PrefillRequest | None:
        """Save the state of a sequence about to give up its KV, which holds every token but the last (its
        blocks are saved already); the prefill request that resumes it, or None where it could not be queued."""
        client = self.prefill.client  # present: a chain exists only where there is a store
        found = handoff.continuation(chain.namespace, chain.identity(tokens))
        if client is None or kv.length != found.position or chain.saved < len(found.blocks):
            return None
        window = WindowState(found.position, kv.rings, kv.window_from) if kv.rings is not None else None
        record = [(found.record, handoff.encode(kv, found.position, window))]
        if not client.save(record, 1, handoff.HANDOFF_CLASS):
            return None
        request = chain.result.request
        return PrefillRequest(list(tokens), request.salt, request.traffic_class, request.session_id,
                              request.namespace, request.turn, exact=chain.exact, from_handoff=True,
                              images=request.images, tenant=request.tenant)

    def resumed(self, chain: ReplyChain, result: PrefillResult) -> None:
        """The prefill that resumed a preempted sequence saved its blocks in the chain its KV came from."""
        if result.exact != chain.exact:
            chain.namespace = self.prefill.chain_namespace(chain.result.request, result.exact)
            chain.exact, chain.window = result.exact, None
        chain.saved = len(result.blocks)

    def preempted(self, chain: ReplyChain) -> None:
        """The sequence gave up its KV and will recompute it exactly."""
        if not chain.exact:
            chain.namespace = self.prefill.chain_namespace(chain.result.request, exact=True)
            chain.exact, chain.saved, chain.window = True, 0, None

    def finished(self, chain: ReplyChain, tokens: list[int]) -> None:
        """The sequence ends: keep its latest window for the next turn."""
        state, chain.window = chain.window, None
        if state is not None:
            block = chain.namespace.blocks(chain.identity(tokens[: state.position]))[-1]
            # the prompt's window stays in the tier beside it: the same prompt sent again resumes there
            self.prefill.keep_window(block, state, chain.result.request, chain.namespace, keep_older=True)
