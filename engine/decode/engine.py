"""The decode engine: continuous batching over the paged KV.

    engine = DecodeEngine(model, prefill_engine_or_pool_or_None, DecodeConfig())
    rid = engine.submit(DecodeRequest(prompt_ids_or_prefill_result, SamplingParams(max_tokens=128)))
    for result in engine.run(): ...        # or engine.step() in the caller's own loop

Every step runs ONE `model.forward` over one chunk per running sequence: a single token for a sequence
that is decoding, a slice of its prompt for one that is (re)prefilling (at most
`prefill_tokens_per_step` such tokens a step, so long prompts do not stall the others). Sequences join
and leave between steps. A step is three phases: `_prepare` (admission, page growth, preemption, the
chunks), `_execute` (the forward) and `_complete` (sampling, stops, results). With `DecodeConfig.overlap`
a worker thread does, while step n's forward runs, what of step n+1's preparation does not wait for step
n's tokens: admission and the KV pages of every sequence's next token. The time
between one forward's end and the next one's start is kept in `idle_gaps_s`.

KV memory: a sequence is admitted when pages for all its uncomputed tokens are free; each step it grows
by the pages its new tokens need. When the pool is full, the youngest running sequence is preempted: its
KV is released and it re-queues at the front. A sequence whose reply goes to the store saves its state
there first and resumes from it when admitted again (one token recomputed); any other recomputes prompt
+ reply (exact). Its sampling generator travels with it, so a preempted sequence's tokens are those it
would have had alone.

Built on a prefill engine of this process (sharing its page pool), the engine continues what it prefills:
a `PrefillResult` handed over in place, or a `PrefillRequest` it submits to that engine itself. Each step
it takes the prefill engine's planned chunks into its own one forward, beside the decode tokens, with the
hook that holds each layer until their loads have put it in place (a second forward a step cost 6-11% of
every step on 2 cores, bench/mixed_step.py). With `from_handoff` the prefill continues from the state a
prefill process saved in the store (`engine.prefill.handoff`) and computes only the last prompt token.
Either way the decode engine takes over the request's KV and samples the first token from the prefill's
logits. As its reply fills KV blocks they are saved (write-behind) in the prompt's chain, and for a hybrid
model the window at the last block boundary is kept, so the next turn finds prompt and reply cached
(`engine.decode.saving`).
Prompt ids are computed here, without the store, and their replies are not saved.

Faults: a request whose own work raises in a step (its draw, its drafter, its stop check, its first token
after a prefill) ends alone with finish reason "error" (`DecodeResult.error` says what raised), its KV
freed; the other sequences go on. Only what is shared (the forward, the pool, the store) fails the step.

Speculative decoding (`DecodeConfig.speculative`; the parts in `engine.speculative`): each
sequence's n-gram drafter proposes up to γ tokens (made when the sequence is admitted, its index built on
a thread of its own: a queued request does no engine work); the DSpark schedule, from the drafts' calibrated
confidences and the SPS(B) profile, picks how many of each decoding sequence to verify; its chunk becomes
[last token, d_1..d_ℓ], scored at every position in the step's one forward (short chunks batched,
`engine.model.decode_attention.VerifyBatch`). Verification accepts a prefix (greedy: the argmax's; sampled:
the drafts equal to the target's own draws, made in turn with the request's generator as a plain step makes
them: rejection sampling for a deterministic drafter, `engine.speculative.verify`) and adds the target's token,
the tokens appended one by one so a stop inside the accepted run ends the reply there. The KV then forgets
the rejected positions (`RequestKV.rollback`: full layers by length, the window ring by restoring the slots
the drafts overwrote). Greedy replies are the same tokens as without speculation, and so are seeded
sampled ones: each token costs one draw, whatever was drafted, verified, cut for lack of pages or preempted
(up to floating point: a verifying forward batches positions differently from a plain step).

Expert parallelism (`DecodeConfig.expert_ranks` > 1, a MoE model; `engine.experts.serving`): the engine builds
an `ExpertParallelDecoder` from the model it is given, this process rank 0 of a gloo group whose other ranks are
spawned followers holding the rest of the experts. Each step that runs a forward tells the followers first
(`ExpertGroup.begin_step`), and after the forward and the step's sampling ends the step on every rank
(`end_step`): load statistics, and every `ExpertParallelConfig.rebalance_every` steps the rebalance, between
steps. A forward that raises leaves the ranks out of step: the next step raises, and the engine must be closed.
`close` ends the followers.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.decode.config import DecodeConfig
from engine.decode.errors import few
from engine.decode.request import CANCELLED, ERROR, DecodeError, DecodeRequest, DecodeResult
from engine.decode.sampling import make_generator, sample
from engine.decode.saving import ReplySaver
from engine.decode.sequence import DecodeSequence
from engine.experts.decoder import ExpertParallelConfig, check_layout
from engine.experts.serving import ExpertGroup
from engine.model.decoder import Chunk, Decoder, argmax_ids
from engine.model.kv import KVCapacityError, PagePool, RequestKV, RingCheckpoint
from engine.prefill.engine import PrefillEngine, PrefillStep
from engine.prefill.request import HANDED_OVER, PrefillError, PrefillRequest, PrefillResult, chunk_embeds
from engine.speculative.calibration import Calibration, Record
from engine.speculative.drafter import DraftToken, NGramDrafter
from engine.speculative.profile import ObservedSps, load_or_measure
from engine.speculative.schedule import schedule
from engine.speculative.verify import Verdict, verify_drawn, verify_greedy
from engine.text.token_ids import checked_token_ids

log = logging.getLogger(__name__)

# With nothing to compute until the store answers, how long a step waits for it before returning: its
# caller (the serving loop) takes the requests that came meanwhile, which may not need the store
STORE_WAIT_S = 0.05
DRAFT_RECORDS = 4096  # verified request steps kept for calibration and reports (DecodeEngine.draft_records)


@dataclass
class StepBatch:
    """One step's work, prepared on the host before the forward."""

    sequences: list[DecodeSequence]
    chunks: list[Chunk]  # one per sequence: its next tokens and where they start
    samples: list[bool]  # per sequence: does its chunk end at its last token, so a token is sampled
    # per sequence: the drafts its chunk verifies after its last token ([]: a plain chunk), and what their
    # positions overwrite in its window ring, restored where they are rejected
    drafts: list[list[DraftToken]]
    checkpoints: list[RingCheckpoint | None]


class DecodeEngine:
    def __init__(self, model: Decoder, kv_source: PagePool | PrefillEngine | None = None,
                 config: DecodeConfig = DecodeConfig()) -> None:
        """`kv_source`: the prefill engine whose results this engine continues (its pool is shared), a pool
        of this model's layout, or None for a pool of its own (config.kv_pages x config.block_tokens)."""
        if isinstance(kv_source, PrefillEngine):
            if kv_source.model.config != model.config:
                raise ValueError("DecodeEngine: the prefill engine runs another model; build both on one Decoder")
            pool = kv_source.pool
        elif isinstance(kv_source, PagePool):
            pool = kv_source
        elif kv_source is None:
            pool = PagePool(model.config, config.kv_pages, config.block_tokens, model.dtype, model.device)
        else:
            raise ValueError(f"DecodeEngine: kv_source must be a PrefillEngine, a PagePool or None, "
                             f"got {type(kv_source).__name__}")
        if pool.dtype != model.dtype:
            raise ValueError(f"DecodeEngine: the KV pool holds {pool.dtype}, the model computes in {model.dtype}; "
                             "build both in one dtype")
        if config.expert_ranks > 1:
            if not model.config.num_experts:
                raise ValueError(f"DecodeEngine: expert_ranks={config.expert_ranks} spreads a MoE model's experts "
                                 "over ranks; this model has a dense MLP (use expert_ranks=1)")
            check_layout(model.config, config.experts or ExpertParallelConfig(), config.expert_ranks)
            if isinstance(kv_source, PrefillEngine):
                # its own forwards (PrefillEngine.step, prefill) would run without the followers: not built yet
                raise ValueError("DecodeEngine: expert_ranks > 1 is built for an engine without a prefill engine "
                                 "(kv_source a PagePool or None)")
        self.model, self.pool, self.config = model, pool, config
        self._prefill = kv_source if isinstance(kv_source, PrefillEngine) else None
        self._saver = ReplySaver(self._prefill) if self._prefill is not None else None
        self._prefilling: dict[int, DecodeSequence] = {}  # prefill id -> the sequence it (re)fills
        self._waiting: list[DecodeSequence] = []  # submitted or preempted, oldest first
        self._running: list[DecodeSequence] = []  # admitted, oldest first: the last is preempted first
        # finished outside a step (at submit, cancelled): the next step returns them
        self._done: list[DecodeResult] = []
        self._ids = itertools.count()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="decode-ahead") if config.overlap else None
        self._indexer: ThreadPoolExecutor | None = None  # builds admitted sequences' draft indexes (made when needed)
        self.idle_gaps_s: deque[float] = deque(maxlen=4096)  # between consecutive steps' forwards (the
        #                                      device's idle time: sampling, bookkeeping, the next preparation)
        self._forward_ended: float | None = None
        # speculative decoding: SPS(B) for the schedule (not needed with a fixed draft count), the calibration
        self._sps = config.sps
        if config.speculative and config.sps is None and config.fixed_drafts is None:
            self._sps = ObservedSps(load_or_measure(model)[0])
        self._calibration = config.calibration if config.calibration is not None else Calibration(())
        self.draft_records: deque[Record] = deque(maxlen=DRAFT_RECORDS)  # per verifying request step
        # expert parallelism: started last, so nothing above that raises leaves follower processes behind. The
        # SPS profile above was measured on the one-process model: the timed forwards correct it (ObservedSps).
        self.experts: ExpertGroup | None = None
        if config.expert_ranks > 1:
            self.experts = ExpertGroup(model, config.expert_ranks, config.experts or ExpertParallelConfig())
            self.model = self.experts.model

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, request: DecodeRequest) -> int:
        """Validate and queue a request; its id. Raises DecodeError for bad input, leaving all else as it was.

        A handed-over PrefillResult's KV belongs to this engine once accepted (released when it finishes);
        a refused one stays the caller's."""
        sequence = self._sequence(request)
        if isinstance(request.prompt, PrefillRequest):
            assert self._prefill is not None, "_sequence refuses a PrefillRequest without a prefill engine"
            try:
                self._prefilling[self._prefill.submit(request.prompt)] = sequence
            except PrefillError as exc:
                raise DecodeError(str(exc)) from None
        elif isinstance(request.prompt, PrefillResult):
            self._continue_alone(sequence, request.prompt)
        else:
            self._waiting.append(sequence)
        return sequence.id

    def cancel(self, request_id: int) -> bool:
        """Stop a request now and free its KV; the next step returns it as "cancelled". False if unknown or done."""
        for queue in (self._waiting, self._running):
            for sequence in queue:
                if sequence.id == request_id:
                    queue.remove(sequence)
                    self._end(sequence)
                    self._done.append(sequence.result(CANCELLED))
                    return True
        for prefill_id, sequence in self._prefilling.items():
            if sequence.id == request_id and not sequence.cancelled:
                assert self._prefill is not None, "only a prefill engine's requests are prefilling"
                if self._prefill.cancel(prefill_id):  # its load stopped, its pages back: no more work for it
                    del self._prefilling[prefill_id]
                else:
                    sequence.cancelled = True  # its KV is freed when its prefill returns it
                self._done.append(sequence.result(CANCELLED))
                return True
        return False

    def step(self) -> list[DecodeResult]:
        """Admit what fits, feed every running sequence once (one forward), and return those that finished.

        Raises KVCapacityError when nothing runs and the oldest waiting sequence cannot get its pages
        (they are held outside this engine, e.g. by unreleased prefill results)."""
        finished, self._done = self._done, []
        prefill_moved = False  # the prefill engine computed (its requests may be holding pages others wait for)
        prefill = self._prefill
        prompts = None  # the prefill engine's chunks this step's one forward computes besides the decode chunks
        if prefill is not None and prefill.pending:
            try:  # with sequences to feed, a prompt whose load is in flight waits for it out of the step
                prompts = prefill.plan_step(others=bool(self._running or self._waiting))
            except KVCapacityError:  # it waits for pages; the running sequences may free them
                pass
        batch = self._prepare(sum(len(chunk.tokens) for chunk in prompts.chunks) if prompts is not None else 0)
        finished, self._done = finished + self._done, []  # sequences whose drafting failed in the preparation
        if batch.chunks or prompts is not None:
            if self.experts is not None:
                self.experts.begin_step()  # the followers answer this forward's MoE collectives
            logits = self._timed_execute(batch, prompts)
            try:
                finished += self._complete(batch, logits[:len(batch.chunks)])
                if prefill is not None and prompts is not None:
                    # each prompt's last token's (vocab,), or (1, vocab) where the forward scored drafts
                    last = [row if row.dim() == 1 else row[-1] for row in logits[len(batch.chunks):]]
                    self._continue_prompts(prefill.finish_step(prompts, last))
                    prefill_moved = True
                    finished, self._done = finished + self._done, []
            finally:  # the forward ran on every rank: the step ends on every rank, whatever raised here since
                if self.experts is not None:
                    self.experts.end_step()  # between steps: load statistics, the rebalance when due
        else:
            self._forward_ended = None  # idle: no gap to count until work comes
            if prefill is not None and prefill.waiting_on_store:
                prefill.wait_for_store(STORE_WAIT_S)  # nothing to compute here until the store answers
                return finished
        if not batch.chunks and not prefill_moved and not finished and (self._waiting or self._prefilling):
            raise KVCapacityError(f"{self.pool.free_pages} free KV pages cannot hold the oldest waiting sequence "
                                  "and nothing runs here to free more: release finished prefill results' KV")
        return finished

    def _continue_prompts(self, results: list[PrefillResult]) -> None:
        """The prompts the prefill engine finished: each continues here (or ends, its first token a stop)."""
        for result in results:
            self._continue_alone(self._prefilling.pop(result.id), result)

    def run(self) -> list[DecodeResult]:
        """Step until every submitted request has finished; results in completion order."""
        results = []
        while self.pending:
            results.extend(self.step())
        return results

    def close(self) -> None:
        """Stop the overlap's worker thread and the drafts thread (the engine can still step, without overlap),
        and the expert-parallel followers (with expert_ranks > 1 it cannot step after)."""
        if self.experts is not None:
            self.experts.stop()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._indexer is not None:
            self._indexer.shutdown()
            self._indexer = None

    @property
    def pending(self) -> int:
        return len(self._waiting) + len(self._running) + len(self._done) + len(self._prefilling)

    @property
    def running(self) -> int:
        """Sequences fed each step."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Sequences queued for admission (new, or preempted) or for their prefill."""
        return len(self._waiting) + len(self._prefilling)

    @property
    def kv_tokens(self) -> int:
        """Tokens held in the running sequences' KV: this instance's KV load."""
        return sum(s.computed for s in self._running)

    # -- validation ---------------------------------------------------------------------------------

    def _sequence(self, request: DecodeRequest) -> DecodeSequence:
        mc = self.model.config
        params = request.sampling
        if bad := [i for i in params.stop_token_ids if i >= mc.vocab_size]:
            raise DecodeError(f"stop_token_ids {few(bad)} lie outside the vocabulary [0, {mc.vocab_size})")
        detokenize = request.detokenize or self.config.detokenize
        if params.stop and detokenize is None:
            raise DecodeError("stop strings need a detokenize callable (token ids -> text): give one in "
                              "DecodeRequest.detokenize or DecodeConfig.detokenize, or use stop_token_ids")
        if isinstance(request.prompt, PrefillResult):
            prompt = self._handed_over_prompt(request.prompt)
        elif isinstance(request.prompt, PrefillRequest):
            if self._prefill is None:
                raise DecodeError("a PrefillRequest is prefilled by the engine's PrefillEngine: build the "
                                  "DecodeEngine on one (DecodeEngine(model, prefill_engine))")
            prompt = checked_token_ids(request.prompt.tokens, mc.vocab_size, DecodeError)
        else:
            prompt = checked_token_ids(request.prompt, mc.vocab_size, DecodeError)
        context = mc.max_position_embeddings
        if len(prompt) >= context:
            raise DecodeError(f"prompt of {len(prompt)} tokens leaves no room for a reply in the model's "
                              f"context of {context}")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > context:
            raise DecodeError(f"max_tokens {params.max_tokens} after a prompt of {len(prompt)} tokens passes the "
                              f"model's context of {context}: lower it to {context - len(prompt)} or less, or "
                              "give None to stop at the context (finish reason \"context\")")
        most = context if params.max_tokens is None else len(prompt) + params.max_tokens
        pages = -(-(most - 1) // self.pool.block_tokens)  # the last token is sampled, never fed
        if self.pool.layers and pages > self.pool.num_pages:
            raise DecodeError(f"prompt + max_tokens need up to {pages} KV pages; the pool has "
                              f"{self.pool.num_pages}: lower max_tokens or raise DecodeConfig.kv_pages")
        # no drafter yet: a queued request does no engine work (see _start_drafter)
        return DecodeSequence(next(self._ids), request, params, make_generator(params, self.model.device),
                              prompt, len(prompt), context, detokenize)

    def _continue_alone(self, sequence: DecodeSequence, result: PrefillResult) -> None:
        """`_continue`, where a raise (its sampling, its callbacks) ends this sequence alone, its KV freed."""
        try:
            self._continue(sequence, result)
        except Exception as exc:
            if sequence.kv is not result.kv:
                result.kv.release()
            self._done.append(self._fail(sequence, exc))

    def _continue(self, sequence: DecodeSequence, result: PrefillResult) -> None:
        """Take over a prefill's KV (the prompt's, or a preempted sequence's resumed) and sample the next token
        from its logits; the sequence then waits to run, or ends."""
        if sequence.cancelled:
            result.kv.release()
            return
        (token,) = sample(result.logits.to(self.model.device)[None], [sequence.params], [sequence.generator])
        sequence.kv, sequence.computed = result.kv, result.prompt_tokens
        if sequence.resume is not None:
            assert sequence.chain is not None, "only a sequence whose reply is saved resumes from the store"
            sequence.resume = None
            sequence.resumed_from_store += result.path == HANDED_OVER
            self._replies.resumed(sequence.chain, result)
        else:
            sequence.chain = self._saver.chain(result) if self._saver is not None else None
            sequence.prefill_path, sequence.cached_tokens = result.path, result.loaded_tokens
            sequence.window_source = result.window_source
        sequence.append(token)
        if result is sequence.request.prompt:
            sequence.token_times_s[-1] = 0.0  # it came with the prefill, before submit
        if (reason := sequence.finish_reason()) is not None:
            self._end(sequence)
            self._done.append(sequence.result(reason))
        else:
            self._waiting.append(sequence)

    def _handed_over_prompt(self, result: PrefillResult) -> list[int]:
        kv = result.kv
        if kv.pool is not self.pool:
            raise DecodeError("the PrefillResult's KV lives in another page pool: build the DecodeEngine on that "
                              "PrefillEngine (or its pool) to continue it in place")
        if kv.length != result.prompt_tokens or len(result.request.tokens) != result.prompt_tokens:
            raise DecodeError(f"the PrefillResult's KV holds {kv.length} of its {result.prompt_tokens} prompt "
                              "tokens: it was released or already decoded; hand over a fresh result")
        if any(s.kv is kv for s in (*self._waiting, *self._running, *self._prefilling.values())):
            raise DecodeError("this PrefillResult is already being decoded here")
        return list(result.request.tokens)

    # -- steps --------------------------------------------------------------------------------------

    def _prepare(self, prompt_tokens: int = 0) -> StepBatch:
        """Host side of a step: admit, plan each running sequence's tokens, grow its pages (preempting
        the youngest where the pool is full), and build the chunks. `prompt_tokens`: what the prefill
        engine's chunks add to the step's forward."""
        self._admit()
        budget = self.config.prefill_tokens_per_step
        planned: list[tuple[DecodeSequence, int]] = []
        for sequence in self._running:
            n = sequence.uncomputed
            if n > 1:  # (re)prefilling: from the step's prompt budget
                n = min(n, budget)
                budget -= n
            if n:
                planned.append((sequence, n))
        batch = StepBatch([], [], [], [], [])
        for sequence, n in planned:
            if sequence.kv is None or not self._grow(sequence, sequence.computed + n):
                continue  # preempted for an older sequence in this step
            start = sequence.computed
            batch.sequences.append(sequence)
            batch.chunks.append(Chunk(sequence.kv, torch.tensor(sequence.tokens[start : start + n]), start,
                                      chunk_embeds(sequence.request.images, start, n)))
            batch.samples.append(start + n == len(sequence.tokens))
            batch.drafts.append([])
            batch.checkpoints.append(None)
        if self.config.speculative:
            self._speculate(batch, prompt_tokens)
        for sequence, chunk in zip(batch.sequences, batch.chunks):  # after drafting: it sets the chunks' sizes
            if sequence.chain is not None:
                self._replies.before_chunk(sequence.chain, sequence.held_kv, chunk.start, len(chunk.tokens))
        return batch

    def _speculate(self, batch: StepBatch, prompt_tokens: int) -> None:
        """Extend the decoding chunks with drafts: each drafter proposes up to γ tokens, and the DSpark
        schedule (or `fixed_drafts`) picks how many of each to verify. The choice reads only confidences and
        the SPS profile, never the tokens this step will produce, which keeps verification lossless."""
        decoding = [i for i, (sequence, chunk) in enumerate(zip(batch.sequences, batch.chunks))
                    if batch.samples[i] and len(chunk.tokens) == 1 and sequence.drafter is not None]
        if not decoding:
            return
        config = self.config
        # a chunk's drafts must not wrap a window ring onto the chunk itself (W is one model's, for all)
        first = batch.sequences[decoding[0]].held_kv
        ring_room = first.window - 1 if first.rings is not None else config.gamma
        proposed: dict[int, list[DraftToken]] = {}
        failed: dict[int, Exception] = {}
        for i in decoding:
            sequence = batch.sequences[i]
            limit = min(config.gamma, sequence.draft_room(), ring_room)
            try:  # a drafter that raises ends its sequence alone, before the forward
                drafter = self._drafter(sequence)
                proposed[i] = drafter.propose(limit) if limit > 0 else []
            except Exception as exc:
                failed[i] = exc
        if failed:
            proposed = self._drop(batch, failed, proposed)
        decoding, proposals = list(proposed), list(proposed.values())
        if not decoding:
            return
        if config.fixed_drafts is not None:
            lengths = [min(config.fixed_drafts, len(drafts)) for drafts in proposals]
        elif not any(proposals):
            return
        else:
            sps = self._sps
            assert sps is not None, "made at start-up unless fixed_drafts is given"
            survivals = [self._calibration.survivals([d.confidence for d in drafts]) for drafts in proposals]
            # No ℓ changes a request's tokens (greedy: the argmax; seeded sampling: one draw per token, as
            # without drafts), so every decoding sequence shares the one DSpark choice. B counts the step's
            # other tokens too (prompt chunks): they share the forward, not the drafts' expected gain.
            others = sum(len(chunk.tokens) for chunk in batch.chunks) - len(decoding) + prompt_tokens
            lengths = schedule(survivals, (lambda b: sps(b + others)) if others else sps).lengths
        for i, drafts, length in zip(decoding, proposals, lengths):
            if not length:
                continue
            sequence, chunk = batch.sequences[i], batch.chunks[i]
            kv = sequence.held_kv
            try:
                kv.reserve(chunk.start + 1 + length)
            except KVCapacityError:  # drafts never preempt anyone: as many as the pages held have room for
                length = min(length, len(kv.block_table) * kv.block_tokens - chunk.start - 1)
                if length <= 0:
                    continue
            drafts = drafts[:length]
            batch.drafts[i] = drafts
            batch.checkpoints[i] = kv.checkpoint(chunk.start + 1, chunk.start + 1 + length)
            chunk.tokens = torch.tensor([sequence.tokens[-1], *(d.token for d in drafts)])  # (1 + ℓ,)

    def _drafter(self, sequence: DecodeSequence) -> NGramDrafter:
        """The sequence's drafter, its index over every token so far: the build started at admission is
        waited for (it ran beside the forwards since, so it is done unless the sequence decodes at once after
        admission), then the tokens appended since are fed."""
        if sequence.indexing is not None:
            sequence.indexing.result()  # re-raises what the build raised: this sequence's fault
            sequence.indexing = None
        drafter = sequence.drafter
        assert drafter is not None, "made at admission when speculating"
        if drafter.index.length < len(sequence.tokens):
            drafter.extend(sequence.tokens[drafter.index.length:])
        return drafter

    def _drop(self, batch: StepBatch, failed: dict[int, Exception], proposed: dict[int, list[DraftToken]]
              ) -> dict[int, list[DraftToken]]:
        """Take the failed rows out of the batch, ending their sequences (the next results); the proposals
        keyed by the rows left."""
        kept = [i for i in range(len(batch.sequences)) if i not in failed]
        for i, exc in failed.items():
            self._done.append(self._fail(batch.sequences[i], exc))
        for name in ("sequences", "chunks", "samples", "drafts", "checkpoints"):
            column = getattr(batch, name)
            setattr(batch, name, [column[i] for i in kept])
        row = {old: new for new, old in enumerate(kept)}
        return {row[i]: drafts for i, drafts in proposed.items()}

    def _timed_execute(self, batch: StepBatch, prompts: PrefillStep | None) -> list[torch.Tensor]:
        """The forward (the batch's chunks, then the prefill engine's planned ones), with the next step's pages
        reserved meanwhile on the worker thread (overlap). The forward stays on this thread: torch ops from a
        second thread bring a second OpenMP team, whose spinning threads slowed a batch-8 step on 2 cores from
        219 to 300 ms."""
        started = time.perf_counter()
        if self._forward_ended is not None:
            self.idle_gaps_s.append(started - self._forward_ended)
        ahead = self._worker.submit(self._prepare_ahead, batch) if self._worker is not None else None
        try:
            logits = self._execute(batch, prompts)
        finally:  # the worker touches the queues: done before anything (a fault's cancels too) reads them
            if ahead is not None:
                ahead.result()
        self._forward_ended = time.perf_counter()
        waited = prompts is not None and prompts.before_layer is not None  # on loads: not compute's time
        if isinstance(self._sps, ObservedSps) and self.model.device.type == "cpu" and not waited:
            # what a forward of B tokens costs here, for the schedule (on CUDA the call returns before the
            # kernels end: the profile, which synchronises, stands)
            fed = sum(len(chunk.tokens) for chunk in (*batch.chunks, *(prompts.chunks if prompts else ())))
            self._sps.observe(fed, self._forward_ended - started)
        return logits

    def _prepare_ahead(self, batch: StepBatch) -> None:
        """While step n computes (on the worker thread): admit what fits, and reserve the pages each
        sequence of it needs for its next token, so step n+1's `_prepare` only builds the chunks. The
        forward reads nothing this changes: reserving appends to a block table past the positions it
        reads, admission touches only queues and new sequences. Where the pool runs out, the next
        `_prepare` preempts as usual."""
        try:
            for sequence, chunk in zip(batch.sequences, batch.chunks):
                sequence.held_kv.reserve(chunk.start + len(chunk.tokens) + 1)
        except KVCapacityError:
            return
        self._admit()

    def _execute(self, batch: StepBatch, prompts: PrefillStep | None) -> list[torch.Tensor]:
        """The step's one forward, the batch's chunks then the prefill engine's (each full layer held until
        their loads have put it in place): the logits of each chunk's last token, (vocab,) each; where a chunk
        verifies drafts, of each of its positions, (1 + ℓ, vocab)."""
        extra, before_layer = (prompts.chunks, prompts.before_layer) if prompts is not None else ([], None)
        chunks = [*batch.chunks, *extra]
        if not any(batch.drafts):
            return self.model.forward(chunks, before_layer)
        return self.model.forward(chunks, before_layer, logits_for=[
            *(len(chunk.tokens) if drafts else 1 for chunk, drafts in zip(batch.chunks, batch.drafts)),
            *[1] * len(extra)])

    def _complete(self, batch: StepBatch, logits: list[torch.Tensor]) -> list[DecodeResult]:
        """Sample a token for every sequence whose chunk reached its end (or verify its drafts), and finish
        those that stop."""
        for sequence, chunk, drafts in zip(batch.sequences, batch.chunks, batch.drafts):
            if drafts:
                continue  # its KV keeps what verification accepts: see _verify
            sequence.computed += len(chunk.tokens)
            if sequence.chain is not None:
                self._replies.after_chunk(sequence.chain, sequence.held_kv, sequence.tokens, sequence.computed)
        rows = [i for i, sampled in enumerate(batch.samples) if sampled and not batch.drafts[i]]
        plain: dict[int, int] = {}  # batch row -> its sampled token
        faults: dict[int, Exception] = {}  # batch row -> what its sampling raised
        last = {i: logits[i] if logits[i].dim() == 1 else logits[i][-1] for i in rows}  # each (vocab,)
        if greedy := [i for i in rows if batch.sequences[i].params.greedy]:  # one argmax for them all
            plain = dict(zip(greedy, argmax_ids(torch.stack([last[i] for i in greedy])).tolist()))
        for i in rows:  # the draws row by row: one that raises ends its own sequence, not the batch
            if i not in plain:
                sequence = batch.sequences[i]
                try:
                    (plain[i],) = sample(last[i][None], [sequence.params], [sequence.generator])
                except Exception as exc:
                    faults[i] = exc
        finished = []
        for i, sequence in enumerate(batch.sequences):
            try:
                if i in faults:
                    raise faults[i]
                if batch.drafts[i]:
                    reason = self._verify(sequence, batch.chunks[i], batch.drafts[i], batch.checkpoints[i],
                                          logits[i])
                elif i in plain:
                    reason = sequence.append(plain[i])
                else:
                    continue
            except Exception as exc:  # its sampling, verification or stop check: it ends, the others go on
                finished.append(self._fail(sequence, exc))
                continue
            if reason is not None:
                self._running.remove(sequence)
                self._end(sequence)
                finished.append(sequence.result(reason))
        return finished

    def _verify(self, sequence: DecodeSequence, chunk: Chunk, drafts: list[DraftToken],
                checkpoint: RingCheckpoint | None, logits: torch.Tensor) -> str | None:
        """Accept a prefix of the drafts against the target's scores (logits (1 + ℓ, vocab): row i after the
        last token and drafts 1..i), append the accepted drafts and the target's own token one by one (a stop
        inside the accepted run ends the reply there, as without speculation), and take the KV back to the
        positions kept. The finish reason, or None."""
        if sequence.params.greedy:
            ids = torch.tensor([d.token for d in drafts], device=logits.device)  # (ℓ,)
            verdict: Verdict = verify_greedy(ids, logits)
        else:  # each row drawn as `sample` draws a plain step's token, with the request's own generator
            params, generator = [sequence.params], [sequence.generator]
            verdict = verify_drawn([d.token for d in drafts], lambda i: sample(logits[i:i + 1], params, generator)[0])
        sequence.drafted += len(drafts)
        sequence.accepted += verdict.accepted
        self.draft_records.append(Record(tuple(d.confidence for d in drafts), verdict.accepted))
        reason = None
        for token in verdict.tokens:
            if (reason := sequence.append(token)) is not None:
                break
        # the last token, the accepted drafts; never the token just appended (nor any past a stop)
        sequence.computed = min(chunk.start + 1 + verdict.accepted, len(sequence.tokens) - 1)
        kv = sequence.held_kv
        kv.rollback(sequence.computed, checkpoint)
        # a window captured at a boundary past the kept positions saw rejected drafts: captured again later
        kv.captured = {boundary: state for boundary, state in kv.captured.items() if boundary <= sequence.computed}
        if sequence.chain is not None:
            self._replies.after_chunk(sequence.chain, kv, sequence.tokens, sequence.computed)
        return reason

    def _admit(self) -> None:
        # sequences that hold KV (handed over) cost no pages: first, so none of them blocks the queue
        holding = [s for s in self._waiting if s.kv is not None]
        for sequence in holding[: self.config.max_running - len(self._running)]:
            self._waiting.remove(sequence)
            self._running.append(sequence)
            self._start_drafter(sequence)
        while self._waiting and len(self._running) < self.config.max_running:
            sequence = self._waiting[0]
            if sequence.resume is not None:  # its state is in the store: the prefill engine gets it back
                assert self._prefill is not None, "only a prefill engine's sequences are saved to the store"
                self._waiting.pop(0)
                # its continuation record may still be on its way: the prefill's lookups wait for it, not this thread
                self._prefilling[self._prefill.submit(sequence.resume)] = sequence
                continue
            kv = RequestKV(self.model.config, self.pool)
            try:
                kv.reserve(len(sequence.tokens))
            except KVCapacityError:
                return
            sequence.kv = kv
            self._running.append(self._waiting.pop(0))
            self._start_drafter(sequence)

    def _start_drafter(self, sequence: DecodeSequence) -> None:
        """On admission (once: a preempted sequence keeps its drafter), start building the drafter's index over
        the tokens so far on the drafts thread, off the step's own work: ~28 us a token, 0.1 s for a prompt of
        4,000. Pure Python, it runs while the forwards release the GIL."""
        if not self.config.speculative or sequence.drafter is not None:
            return
        if self._indexer is None:
            self._indexer = ThreadPoolExecutor(1, thread_name_prefix="decode-drafts")
        sequence.drafter = NGramDrafter(self.config.gamma)
        # a copy: the engine thread appends to the sequence's tokens meanwhile (they are fed by `_drafter`)
        sequence.indexing = self._indexer.submit(sequence.drafter.extend, list(sequence.tokens))

    def _grow(self, sequence: DecodeSequence, tokens: int) -> bool:
        """Pages for `tokens` positions of `sequence`, preempting the youngest running sequences while the
        pool is full; False if `sequence` itself was preempted."""
        while True:
            try:
                sequence.held_kv.reserve(tokens)
                return True
            except KVCapacityError:
                youngest = self._running.pop()
                resume = None
                if youngest.chain is not None and youngest.uncomputed == 1 and self.config.preempt_to_store:
                    resume = self._replies.save_state(youngest.chain, youngest.held_kv, youngest.tokens)
                if youngest.chain is not None and resume is None:
                    self._replies.preempted(youngest.chain)
                youngest.preempt(resume)
                self._waiting.insert(0, youngest)  # ahead of new requests; older victims end up first
                if youngest is sequence:
                    return False

    def _fail(self, sequence: DecodeSequence, exc: Exception) -> DecodeResult:
        """A sequence whose own work raised (sampling, drafting, its stop check): it ends with the error, its KV
        freed, and every other sequence goes on. Nothing of it is kept for a next turn."""
        log.error("request %d failed in the decode engine; it alone ends", sequence.id, exc_info=exc)
        if sequence in self._running:
            self._running.remove(sequence)
        if sequence in self._waiting:
            self._waiting.remove(sequence)
        self._release(sequence)
        return sequence.result(ERROR, f"{type(exc).__name__}: {exc}"[:1000])

    def _end(self, sequence: DecodeSequence) -> None:
        """A sequence is done (finished or cancelled): keep its window for the next turn, free its KV."""
        if sequence.chain is not None:
            self._replies.finished(sequence.chain, sequence.tokens)
        self._release(sequence)

    @property
    def _replies(self) -> ReplySaver:
        """The reply saver, which a sequence with a chain has: chains come from the prefill engine's results."""
        assert self._saver is not None, "a sequence with a reply chain came from this engine's prefill engine"
        return self._saver

    def _release(self, sequence: DecodeSequence) -> None:
        if sequence.kv is not None:
            sequence.kv.release()
            sequence.kv = None
