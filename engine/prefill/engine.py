"""The prefill engine: a client of the store.

Per request: look up the cached prefix (any shard), ask the client whether loading beats recomputing,
load it layer-pipelined into the request's KV pages while the first chunk computes, compute the rest
in chunks the scheduler sizes to a time budget per step, save the new full blocks (write-behind) and
the sliding-window state, and return the first token, its logits and the KV.

A sliding-window layer's state cannot be rebuilt exactly from the stored blocks, so a hybrid model
resumes exactly only where it has that prefix's window: from the window tier in host memory, or else from
the window record the engine that kept it saved in the store, so that a restarted engine or another
instance resumes exactly too. Where both are gone, the engine loads the prefix and rebuilds an
approximate window by bounded replay if that saves much, or else recomputes exactly; a request or tenant
that needs bit-exact continuation is never replayed. `engine.window` owns all of it: its `WindowKeeper`
plans where a prompt's window comes from (`WindowPlan`), and the engine decides whether to load. Blocks
computed after a replay are approximate: they are saved in a namespace of their own (the model identity +
REPLAYED_SUFFIX), which exact requests never read and later turns of the replayed conversation do.
`PrefillResult.path` says which way each request went.

Nothing here waits on the store on the engine's thread, so a slow or paused daemon delays only the
requests that need it: an admitted request's lookups (its prefix, its window record, a hand-off's
continuation record) run on a thread of their own, and the request takes part in steps once they are
answered; a request whose load is still in flight joins a step only when it would hold up nothing else
(then its first chunk overlaps the load, layer by layer), and otherwise once the load is in.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_any
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model.decoder import Chunk, Decoder, argmax_ids
from engine.model.dtype import AUTO
from engine.model.kv import KVCapacityError, PagePool, RequestKV, WindowState
from engine.model.weights import model_identity
from engine.prefill import cost as chunk_cost
from engine.prefill import handoff
from engine.prefill.config import PrefillConfig
from engine.prefill.request import (
    CACHED,
    COLD,
    HANDED_OVER,
    LOAD_FAILED,
    NOT_WORTH,
    REPLAYED,
    WINDOW_MISSING,
    PrefillError,
    PrefillRequest,
    PrefillResult,
    PromptImage,
    chunk_embeds,
)
from engine.prefill.scheduler import Waiting, plan_step
from engine.text.token_ids import checked_token_ids
from engine.window.keeper import REPLAY, WindowKeeper, WindowPlan
from engine.window.replay import REPLAYED_SUFFIX, replayed_namespace
from engine.window.tier import WindowTier
from kvstore.block import Block, KVLayout, Namespace, identity_tokens, image_safe_prefix, tenant_of
from kvstore.client import StoreClient
from kvstore.client.assembly import Buffer
from kvstore.client.loading import LoadCancelled, LoadHandle
from kvstore.client.torch_kv import PagedKV
from kvstore.codec import RAW
from kvstore.eviction import ReuseHint


@dataclass
class _Active:
    id: int
    request: PrefillRequest
    tokens: torch.Tensor  # (n,) int64
    identity: list[int]  # what its chains are keyed by: the tokens, images' placeholders drawn from their digests
    namespace: Namespace
    blocks: list[Block]  # the chain the prompt's blocks are looked up, loaded and saved in
    submitted: float
    kv: RequestKV = field(init=False, repr=False)  # pages reserved at admission: a queued request has none yet
    start: int = 0  # tokens in the KV: loaded or computed
    stored: int = 0  # leading blocks the store holds
    save_from: int = 0  # first block to save when done
    load: LoadHandle | None = None
    loaded: int = 0  # blocks loaded (planned, then final)
    path: str = COLD
    sources: dict = field(default_factory=dict)
    chunks: int = 0
    replayed: int = 0  # stored tokens recomputed to rebuild the window
    exact: bool = True  # False once `blocks` is the replayed chain
    window_source: str | None = None  # where the window it resumed from came from: "host" or "store"
    window_bytes: int = 0  # bytes of the window record loaded from the store
    own_record: Block | None = None  # that record, where this request's session saved it: superseded when done
    looking: Future[_Found] | None = None  # its lookups in the store, while they run (off the engine thread)
    handoff_mark: int | None = None  # from a hand-off: the write-behind saves queued before it (its record's)
    handoff_tried: int = 0  # from a hand-off: the continuation records (exact, replayed) found unusable


@dataclass(frozen=True)
class _HandedOver:
    """A hand-off's continuation record found in the store, with its chain's full blocks stored."""

    tried: int  # which of the records a request may continue from this is (0: the exact chain's)
    space: Namespace
    exact: bool
    found: handoff.Continuation
    payload: Buffer


@dataclass(frozen=True)
class _Found:
    """What the store holds for a request, looked up off the engine thread: a hand-off's continuation, or the
    stored prefix of its exact chain (`stored` blocks) and where its window comes from (`plan`)."""

    handed_over: _HandedOver | None = None
    stored: int = 0
    plan: WindowPlan | None = None


@dataclass
class PrefillStep:
    """One planned step of the prefill engine: its chunks, computed by `step`'s own forward or by a caller's."""

    chosen: list[tuple[_Active, int]]  # (request, tokens) in plan order
    chunks: list[Chunk]  # one per chosen request
    # the forward's hook holding each full layer until the loads these chunks read have put it in place
    # (None: no load in flight)
    before_layer: Callable[[int], None] | None


def stored_layout(model: Decoder, codec: str = RAW) -> KVLayout:
    """What the store keeps of `model`'s KV: its full-attention layers, in its dtype, encoded with `codec`."""
    mc = model.config
    return KVLayout(num_layers=len(mc.full_layers), kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                    dtype=str(model.dtype).removeprefix("torch."), codec=codec)


def stored_block_bytes(model: Decoder, block_tokens: int, codec: str = RAW) -> int:
    """The most payload bytes one stored block of `model`'s KV takes: a host tier's slot size."""
    layout = stored_layout(model, codec)
    bound = layout.block_codec(block_tokens)
    return (bound.max_slot_bytes if bound is not None else layout.layer_bytes(block_tokens)) * layout.num_layers


class PrefillEngine:
    def __init__(self, model: Decoder, client: StoreClient | None, config: PrefillConfig, model_id: str) -> None:
        mc = model.config
        if not mc.full_layers:
            raise ValueError("the prefill engine needs a model with at least one full-attention layer to store")
        self.model, self.client, self.config = model, client, config
        if model_id.endswith(REPLAYED_SUFFIX):
            raise ValueError(f"a model identity may not end in {REPLAYED_SUFFIX!r}: that names the namespace of "
                             "another model's replayed (approximate) KV")
        self.model_id = model_id
        self.block_tokens = config.block_tokens
        self.layout = stored_layout(model, config.kv_codec)
        self.pool = PagePool(mc, config.kv_pages, config.block_tokens, model.dtype, model.device)
        # a hybrid model's sliding-window state (engine.window); None for a model without sliding layers
        self.windows = WindowKeeper(config.block_tokens, mc.sliding_window or 0, config.window_tier_bytes,
                                    config.store_windows, config.replay_tokens, config.replay_min_prefix_factor,
                                    ) if mc.sliding_layers else None
        self._full_index = {layer: i for i, layer in enumerate(mc.full_layers)}
        self._namespaces: OrderedDict[bytes, Namespace] = OrderedDict()
        self._queue: list[_Active] = []  # submitted, waiting for KV pages
        self._active: dict[int, _Active] = {}  # admitted, oldest first
        self._ids = itertools.count()
        self._lookups: ThreadPoolExecutor | None = None  # the store calls of admitted requests (made when needed)
        self.cost = config.cost or self.measure_cost()

    @classmethod
    def from_pretrained(cls, path: Path | str, client: StoreClient | None, config: PrefillConfig = PrefillConfig(),
                        dtype: torch.dtype | str = AUTO, device: str = "cpu") -> PrefillEngine:
        """The engine on the model in `path`, computing in `dtype` (`engine.model.dtype.resolve`)."""
        return cls(Decoder.from_pretrained(path, dtype, device), client, config,
                   config.model_id or model_identity(path))

    @property
    def window_tier(self) -> WindowTier | None:
        """The host tier of sliding-window states; None for a model without sliding layers."""
        return self.windows.tier if self.windows is not None else None

    @property
    def window_misses(self) -> Counter[str]:
        """Window records looked up and not used, by cause."""
        return self.windows.misses if self.windows is not None else Counter()

    @property
    def replay_tokens(self) -> int:
        """R, the tokens bounded replay recomputes; 0 where the engine never replays."""
        return self.windows.replay_tokens if self.windows is not None else 0

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one stored block (the client's host tier slot size)."""
        return stored_block_bytes(self.model, self.block_tokens, self.config.kv_codec)

    def namespace(self, salt: str = "", tenant: bytes | None = None) -> Namespace:
        """This model's namespace in the tenant of `salt`, or in `tenant` (tenant_of(salt)) where given."""
        tenant = tenant_of(salt) if tenant is None else tenant
        space = self._namespaces.get(tenant)
        if space is None:
            space = self._namespaces[tenant] = Namespace.of_tenant(self.model_id, self.layout, self.block_tokens,
                                                                   tenant)
            if len(self._namespaces) > 1024:
                self._namespaces.popitem(last=False)
        return space

    # -- a conversation's chain, for the decode engine that continues a result ----------------------

    def chain_namespace(self, request: PrefillRequest, exact: bool = True,
                        namespace: Namespace | None = None) -> Namespace:
        """The namespace whose chain holds the KV of `request`'s conversation: the request's own (its
        `namespace`, else its salt's) for exact KV, or that namespace's replayed twin (model identity +
        REPLAYED_SUFFIX) for KV that descends from a bounded replay (`PrefillResult.exact` False)."""
        if namespace is None:
            namespace = (request.namespace if request.namespace is not None
                         else self.namespace(tenant=request.tenant_digest()))
        return namespace if exact else replayed_namespace(namespace)

    def save_blocks(self, blocks: Sequence[Block], pages: Sequence[int], request: PrefillRequest,
                    hint: ReuseHint) -> bool:
        """Queue `blocks`, whose KV lies in `pages` of this engine's pool, for write-behind under the request's
        traffic class. Their bytes are copied now (the pages may be reused once this returns); the store I/O
        runs in the background. False where there is no client or its queue had no room (the blocks dropped)."""
        if self.client is None or not blocks:
            return False
        items = [(block, self._payload(page)) for block, page in zip(blocks, pages, strict=True)]
        return self.client.save(items, self.layout.num_layers, request.traffic_class, hint)

    def keep_window(self, block: Block, state: WindowState, request: PrefillRequest, chain: Namespace,
                    superseded: Block | None = None, keep_older: bool = False) -> bool:
        """Keep `state`, the sliding window as of the end of `block` (a block of `chain`), as the latest state
        of the request's session, in host memory and in the store (`WindowKeeper.keep`). False if the tier
        cannot keep it, or the model has no sliding layers."""
        if self.windows is None:
            return False
        return self.windows.keep(self.client, block, state, chain, request.session_id, superseded, keep_older)

    def prefetch(self, blocks: Sequence[Block]) -> None:
        """The next turn of the conversation whose full blocks (prompt and reply, in one of this engine's
        namespaces) are `blocks` is coming: bring them into the client's host tier, and have the window at
        their end ready (held in the window tier, or its record read ahead: `WindowKeeper.prefetch`). On any
        thread but the engine's: it may wait on the store for the record (the blocks come in the client's
        background)."""
        if self.client is None or not blocks:
            return
        self.client.prefetch(blocks)
        chain = next((space for space in list(self._namespaces.values()) if space.digest == blocks[0].namespace),
                     None)
        if self.windows is not None and chain is not None:
            self.windows.prefetch(self.client, chain, blocks[-1])

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, request: PrefillRequest) -> int:
        """Validate and queue a request; its id. Raises PrefillError for bad input."""
        mc = self.model.config
        tokens = checked_token_ids(request.tokens, mc.vocab_size, PrefillError)
        if not isinstance(request.turn, int) or request.turn < 0:
            raise PrefillError(f"turn must be a non-negative integer, got {request.turn!r}")
        if len(tokens) > mc.max_position_embeddings:
            raise PrefillError(f"prompt of {len(tokens)} tokens exceeds the model's context of "
                               f"{mc.max_position_embeddings}")
        pages = -(-len(tokens) // self.block_tokens)
        if pages > self.pool.num_pages:
            raise PrefillError(f"prompt needs {pages} KV pages; the engine has {self.pool.num_pages}")
        if request.tenant is not None:
            if not isinstance(request.tenant, bytes) or len(request.tenant) != 16:
                raise PrefillError("a request's tenant is 16 bytes (kvstore.block.tenant_of of its salt), got "
                                   f"{request.tenant!r:.40}")
            if request.salt:
                raise PrefillError("a request names its tenant by its salt or by its tenant, not by both")
        namespace = self.namespace(tenant=request.tenant_digest())
        if request.namespace is not None:
            given = request.namespace
            # the digest too: a namespace object whose fields were changed after it was built must not pass
            if ((given.model_id, given.layout, given.block_tokens) != (self.model_id, self.layout, self.block_tokens)
                    or given.with_model_id(self.model_id).digest != given.digest):
                raise PrefillError(f"namespace {given!r} does not match this model "
                                   f"({self.model_id}, {self.layout}, {self.block_tokens}-token blocks)")
            namespace = given
        for flag in ("exact", "hand_off", "from_handoff"):
            if not isinstance(getattr(request, flag), bool):
                raise PrefillError(f"{flag} must be True or False, got {getattr(request, flag)!r}")
        identity = self._identity(request, tokens)
        active = _Active(next(self._ids), request, torch.tensor(tokens, dtype=torch.long), identity, namespace,
                         namespace.blocks(identity), time.perf_counter())
        if request.from_handoff and self.client is not None:
            active.handoff_mark = self.client.write_behind.mark()
        self._queue.append(active)
        return active.id

    def _identity(self, request: PrefillRequest, tokens: list[int]) -> list[int]:
        """The ids `request`'s chains are keyed by; PrefillError for images that do not fit its prompt."""
        for image in request.images:
            if not isinstance(image, PromptImage):
                raise PrefillError(f"images must be PromptImage, got {type(image).__name__}")
            if tuple(image.embeds.shape) != (image.span.length, self.model.config.hidden_size):
                raise PrefillError(f"an image's embeds must be ({image.span.length}, "
                                   f"{self.model.config.hidden_size}), got {tuple(image.embeds.shape)}")
            if image.span.start + image.span.length > len(tokens):
                end = image.span.start + image.span.length
                raise PrefillError(f"an image's placeholders [{image.span.start}, {end}) run past the prompt's "
                                   f"{len(tokens)} tokens")
        try:
            return identity_tokens(tokens, [image.span for image in request.images])
        except ValueError as exc:
            raise PrefillError(str(exc)) from None

    def cancel(self, request_id: int) -> bool:
        """Drop a request now: a queued one leaves the queue; an admitted one stops its load (no byte lands
        after this returns) and gives its KV pages back. Nothing of it is saved (lookups still running are
        left to end unread). False if unknown or done."""
        for i, queued in enumerate(self._queue):
            if queued.id == request_id:
                del self._queue[i]
                return True
        active = self._active.pop(request_id, None)
        if active is None:
            return False
        if active.load is not None:
            active.load.cancel()
        active.kv.release()
        return True

    def run(self) -> list[PrefillResult]:
        """Step until every submitted request has its first token; results in completion order."""
        results = []
        while self._queue or self._active:
            results.extend(self.step())
        return results

    def prefill(self, request: PrefillRequest) -> PrefillResult:
        """One request alone, start to first token."""
        if self.pending:
            raise RuntimeError("prefill() serves one request alone; with others pending use submit() and run()")
        self.submit(request)
        (result,) = self.run()
        return result

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._active)

    @property
    def waiting_on_store(self) -> int:
        """Admitted requests that cannot compute until the store answers: their lookups run, or their loads do."""
        return sum(a.looking is not None or (a.load is not None and not a.load.done) for a in self._active.values())

    def wait_for_store(self, timeout: float | None = None) -> None:
        """With nothing to compute until the store answers (`plan_step` gave None while `waiting_on_store`):
        wait until the first request's lookups or load end, or `timeout`."""
        looking = [a.looking for a in self._active.values() if a.looking is not None]
        if looking:
            wait_any(looking, timeout, FIRST_COMPLETED)
            return
        for a in self._active.values():
            if a.load is not None and not a.load.done:
                a.load.wait(timeout)
                return

    def close(self) -> None:
        """Stop the lookups' thread once the lookups running end (the engine can still step: it makes another)."""
        if self._lookups is not None:
            self._lookups.shutdown(wait=False)
            self._lookups = None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block and continuation record queued for the store is stored (or failed): before
        telling a decode instance in another process to continue a `hand_off` request. False on timeout."""
        return self.client is None or self.client.write_behind.flush(timeout)

    # -- steps ------------------------------------------------------------------------------------

    def step(self) -> list[PrefillResult]:
        """Admit what fits, compute one planned step, and return the requests that finished in it."""
        planned = self.plan_step()
        if planned is None:
            self.wait_for_store()  # nothing else to compute
            return []
        return self.finish_step(planned, self.model.forward(planned.chunks, planned.before_layer))

    def plan_step(self, others: bool = False) -> PrefillStep | None:
        """Admit what fits and plan the next step's chunks (None: nothing to compute now). A caller that
        computes them in a forward of its own, beside other chunks (`others`), passes `planned.before_layer`
        to it (each full layer held until the loads have put it in place) and hands their logits to
        `finish_step`. With `others`, a request whose load is in flight waits for it out of the step, so
        that the store never holds up the caller's chunks."""
        self._admit()
        self._take_lookups()
        if not self._active:
            if self._queue:  # nothing running and the oldest still does not fit: pages are held elsewhere
                raise KVCapacityError(f"{self.pool.free_pages} free KV pages cannot hold the oldest request; "
                                      "release finished requests' KV (result.kv.release())")
            return None
        ready = [a for a in self._active.values() if a.looking is None]
        loading = [a for a in ready if a.load is not None and not a.load.done]
        if loading and (others or len(loading) < len(ready)):  # they would hold up the others' layers
            ready = [a for a in ready if a.load is None or a.load.done]
        if not ready:
            return None
        waiting = [Waiting(a.id, a.start, len(a.tokens) - a.start) for a in ready]
        plan = plan_step(waiting, self.cost, self.config.step_budget_s, self.block_tokens)
        chosen = [(self._active[rid], x) for rid, x in plan]
        chunks = [Chunk(a.kv, a.tokens[a.start : a.start + x], a.start, chunk_embeds(a.request.images, a.start, x))
                  for a, x in chosen]
        return PrefillStep(chosen, chunks, self._layer_waits([a.load for a, _ in chosen if a.load is not None]))

    def _layer_waits(self, loads: list[LoadHandle]) -> Callable[[int], None] | None:
        """The forward's hook that holds each full layer until the loads put it in place (None: no load)."""
        if not loads:
            return None

        def before_layer(layer: int) -> None:
            full = self._full_index.get(layer)
            if full is None:
                return
            for load in loads:
                try:
                    load.wait_layer(full, self.config.load_timeout_s)
                except (TimeoutError, LoadCancelled):
                    load.cancel()

        return before_layer

    def finish_step(self, planned: PrefillStep, logits: Sequence[torch.Tensor]) -> list[PrefillResult]:
        """After the forward of `planned.chunks` (logits: each chunk's last token's, (vocab,)): the requests
        that finished."""
        finished = []
        for (a, x), last in zip(planned.chosen, logits):
            if a.load is not None and not self._load_held(a, a.load):
                continue  # restarted from what did load
            a.start += x
            a.chunks += 1
            if a.start == len(a.tokens):
                finished.append(self._finish(a, last))
        return finished

    def _admit(self) -> None:
        while self._queue:
            a = self._queue[0]
            kv = RequestKV(self.model.config, self.pool)
            try:
                kv.reserve(len(a.tokens))
            except KVCapacityError:
                kv.release()
                return
            self._queue.pop(0)
            a.kv = kv
            if self.windows is not None and a.blocks:
                kv.capture_at.add(len(a.blocks) * self.block_tokens)  # the window the next turn resumes from
            if self.windows is not None and a.request.hand_off:
                kv.capture_at.add(len(a.tokens) - 1)  # the window a decode instance continues from
            self._active[a.id] = a
            self._look_up(a)

    def _look_up(self, a: _Active) -> None:
        """Start `a`'s lookups in the store, on the lookups' thread: `a` takes part in steps once they end."""
        if self.client is None or not (a.blocks or a.request.from_handoff):
            return
        if self._lookups is None:
            self._lookups = ThreadPoolExecutor(1, thread_name_prefix="prefill-lookups")
        a.looking = self._lookups.submit(self._find, self.client, a, a.identity, a.kv.rings,
                                         self._accepts_approximate(a))

    def _find(self, client: StoreClient, a: _Active, tokens: list[int], rings: torch.Tensor | None,
              accepts_approximate: bool) -> _Found:
        """On the lookups' thread: what the store holds for `a`. Store calls and checks only: it writes nothing
        of `a` (the engine thread applies what it finds) and does no tensor work (`rings` is read for its
        shape: torch ops here would bring a second OpenMP team, spinning against the engine's)."""
        if a.request.from_handoff:
            if a.handoff_mark is not None:  # the record of a sequence this process preempted may be on its way
                client.write_behind.wait_for(a.handoff_mark, self.config.handoff_wait_s)
            for tried, exact in enumerate((True, False) if accepts_approximate else (True,)):
                if tried < a.handoff_tried:
                    continue
                space = self.chain_namespace(a.request, exact, a.namespace)
                found = handoff.continuation(space, tokens)
                records = client.get([found.record])
                if records and (not found.blocks or client.lookup(found.blocks) == len(found.blocks)):
                    return _Found(_HandedOver(tried, space, exact, found, records[0].payload))
        if not a.blocks:
            return _Found()
        # a hit never ends where it holds too little of an image to tell it from another (kvstore.block)
        stored = image_safe_prefix(client.lookup(a.blocks), [i.span for i in a.request.images], self.block_tokens)
        if self.windows is None or rings is None:
            return _Found(None, stored, WindowPlan.without_window(a.blocks, stored, len(tokens), self.block_tokens))
        return _Found(None, stored, self.windows.plan(client, a.namespace, tokens, a.blocks, stored, rings,
                                                      accepts_approximate, a.request.session_id))

    def _take_lookups(self) -> None:
        """Act on the lookups that ended: continue the hand-offs, plan and start the loads."""
        for a in list(self._active.values()):
            if a.looking is not None and a.looking.done():
                found, a.looking = a.looking.result(), None
                if found.handed_over is not None:
                    self._continue_handoff(a, found.handed_over)
                elif found.plan is not None:
                    self._plan_prefix(a, found.stored, found.plan)

    def _plan_prefix(self, a: _Active, stored: int, plan: WindowPlan) -> None:
        """Given the stored prefix of `a`'s exact chain (`stored` blocks) and where its window comes from
        (`WindowKeeper.plan`), decide whether loading it beats recomputing, and start loading it."""
        client = self.client
        assert client is not None, "only a request with a store is looked up"
        B, tokens = self.block_tokens, a.tokens
        a.stored = a.save_from = stored
        if self.windows is not None:
            if plan.capture_at is not None:
                a.kv.capture_at.add(plan.capture_at)  # where this prompt leaves the stored prefix
            if plan.stored_window is not None:
                a.window_bytes, a.own_record = plan.stored_window.nbytes, plan.stored_window.own_record
        if plan.stored == 0:
            return  # cold
        if plan.resume == 0:
            a.path = WINDOW_MISSING if self.windows is not None else NOT_WORTH
            return
        kv_block_bytes = stored_block_bytes(self.model, self.block_tokens)  # raw, decoded: as the meter counts
        worth = client.tokens_worth_loading(plan.blocks, plan.resume, kv_block_bytes, len(tokens),
                                            self.cost.prefill_seconds) // B
        if worth and self.windows is not None:
            worth = plan.resume  # a hybrid model resumes only where it has (or rebuilds) the window
            if not self.windows.apply(plan, a.kv):
                a.path = WINDOW_MISSING  # the tier's window went since the plan
                return
        if worth == 0:
            a.path = NOT_WORTH
            return
        # Resumed: the prompt goes on in the plan's chain (an exact resume's KV is exact, a replay's not)
        a.blocks, a.stored, a.save_from, a.exact = plan.blocks, plan.stored, plan.stored, plan.exact
        a.start, a.replayed = worth * B - plan.replayed, plan.replayed
        if plan.source == REPLAY:
            a.path = REPLAYED
            if a.exact:  # what this request computes from here on is approximate: into the replayed chain
                a.blocks, a.save_from, a.exact = self._replayed_chain(a), 0, False
        else:
            a.path, a.window_source = CACHED, plan.source
        self._start_load(a, client, plan.blocks[:worth])

    def _start_load(self, a: _Active, client: StoreClient, blocks: list[Block]) -> None:
        """Start loading `blocks`, the leading blocks of `a`'s prefix, into its first pages, layer by layer."""
        sources = client.block_sources(blocks)
        a.sources = dict(Counter("host" if s == "host" else "daemon" for s in sources))
        a.loaded = len(blocks)
        a.load = client.load(blocks, PagedKV(self.pool.layers, a.kv.block_table[: len(blocks)]), len(blocks))

    def _continue_handoff(self, a: _Active, handed: _HandedOver) -> None:
        """Continue from the state another process handed over (engine.prefill.handoff): its chain's full blocks
        loaded, the partial block and the window from the continuation record, the last token to compute.
        Where the record is corrupt, the store is looked up again for the next record, or the normal path."""
        client = self.client
        assert client is not None, "only a request with a store is looked up"
        try:
            handoff.restore(handed.payload, a.kv, handed.found.position, handed.exact)
        except handoff.CorruptContinuation:
            a.handoff_tried = handed.tried + 1
            self._look_up(a)
            return
        full = len(handed.found.blocks)
        a.blocks, a.exact = handed.space.blocks(a.identity), handed.exact
        a.stored = a.save_from = a.loaded = full
        a.start, a.path = handed.found.position, HANDED_OVER
        if full:
            self._start_load(a, client, handed.found.blocks)

    def _accepts_approximate(self, a: _Active) -> bool:
        # A prompt with images is never replayed: the replayed chain's hit is not cut back where it holds too
        # little of an image (image_safe_prefix), so it could not tell two images apart as the exact chain does
        return not a.request.exact and a.namespace.tenant.hex() not in self.config.exact_tenants \
            and not a.request.images

    def _replayed_chain(self, a: _Active) -> list[Block]:
        return self.chain_namespace(a.request, exact=False, namespace=a.namespace).blocks(a.identity)

    def _load_held(self, a: _Active, load: LoadHandle) -> bool:
        """After a request's first chunk: did the whole planned load (`load`, a's) arrive? If not, restart from
        what did."""
        try:
            final = load.wait(self.config.load_timeout_s) // self.block_tokens
        except (TimeoutError, LoadCancelled):
            load.cancel()
            final = 0
        a.load = None
        if final >= a.loaded:
            return True
        if self.windows is not None:
            final = 0  # the window kept (or replayed) was for the planned boundary, not for this one
            a.window_source = None
            a.kv.window_from = a.kv.keep_full_before = a.replayed = 0
            a.kv.captured.clear()  # states the first chunk captured under the replay: recaptured exactly
            if not a.exact:  # recomputed from scratch, the KV is exact again: back to the exact chain
                a.blocks, a.exact = a.namespace.blocks(a.identity), True
        a.loaded = final
        a.start = final * self.block_tokens
        a.save_from = min(a.save_from, final)  # re-store what failed to load (it may have been corrupt)
        a.path = LOAD_FAILED
        return False

    def _finish(self, a: _Active, logits: torch.Tensor) -> PrefillResult:
        del self._active[a.id]
        full = len(a.blocks)
        if self.client is not None and a.save_from < full:
            items = [(a.blocks[i], self._payload(a.kv.block_table[i])) for i in range(a.save_from, full)]
            self.client.save(items, self.layout.num_layers, a.request.traffic_class,
                             ReuseHint(a.stored, full, a.request.turn))
        handed_off = a.request.hand_off and self._hand_off(a)
        if self.windows is not None:
            self.windows.keep_captured(self.client, a.kv.captured, a.blocks,
                                       self.chain_namespace(a.request, a.exact, a.namespace), a.request.session_id,
                                       a.own_record if a.path == CACHED else None)
        a.kv.capture_at, a.kv.captured = set(), {}
        # a copy of its own: the row may be a view into a whole step's logits (the decode engine's shared
        # forward), which the result would otherwise keep alive for as long as its reply decodes
        logits = logits.float().cpu().clone()
        return PrefillResult(a.request, int(argmax_ids(logits)), logits, a.kv, len(a.tokens),
                             a.stored * self.block_tokens, a.loaded * self.block_tokens, a.path, a.sources,
                             time.perf_counter() - a.submitted, a.chunks, tuple(a.blocks), a.replayed, a.exact,
                             handed_off, a.id, a.window_source, a.window_bytes)

    def _hand_off(self, a: _Active) -> bool:
        """Queue the continuation record of a `hand_off` request (its blocks are queued already)."""
        if self.client is None:
            return False
        found = handoff.continuation(self.chain_namespace(a.request, a.exact, a.namespace), a.identity)
        window = a.kv.captured.get(found.position) if self.windows is not None else None
        if self.windows is not None and window is None:
            return False
        payload = handoff.encode(a.kv, found.position, window)
        return self.client.save([(found.record, payload)], 1, handoff.HANDOFF_CLASS)

    def _payload(self, page: int) -> bytes:
        """A stored block's bytes: each full layer's page, layer-major:
        (full_layers, 2, block_tokens, kv_heads, head_dim)."""
        layers = torch.stack([layer[page] for layer in self.pool.layers])
        return layers.contiguous().view(torch.uint8).cpu().numpy().tobytes()

    # -- the cost model ---------------------------------------------------------------------------

    def measure_cost(self, repeats: int = 2) -> chunk_cost.ChunkCost:
        """Fit the chunk cost model on this machine, timing forwards over a small grid of (x, L)."""
        B = self.block_tokens
        limit = min(self.model.config.max_position_embeddings, self.pool.num_pages * B)
        # chunks of one and eight blocks, after prefixes of none, 8 and 32 blocks: the a·x·L term shows
        grid = [(x, start) for x in (B, 8 * B) for start in (0, 8 * B, 32 * B) if x + start <= limit]
        if len(grid) < 3:
            grid = [(x, 0) for x in (1, max(2, limit // 4), limit)]

        def run_chunk(x: int, start: int) -> None:
            kv = RequestKV(self.model.config, self.pool)
            try:
                kv.reserve(start + x)
                tokens = torch.zeros(x, dtype=torch.long)
                self.model.forward([Chunk(kv, tokens, start)])
            finally:
                kv.release()

        return chunk_cost.measure(run_chunk, grid, repeats)

