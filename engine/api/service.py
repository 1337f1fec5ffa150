"""Between the APIs and the engines: a `Prompt` in, its reply's text as it comes and then the `Reply` out.

The API modules parse and render; this does what every API needs in between: the prompt's ids (in the
encoder's processes), the request to the serving loop (engine.serving.loop) with the tenant's salt and
traffic class, the text released as tokens come (never a stop string, never a tool call's text), the tool
calls split from the reply, the metrics, the store's advice, and cancelling a reply whose client went away.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.api.advice import Advisor
from engine.api.conversation import (
    CALL_FENCE,
    LENGTH,
    STOP,
    TOOL_CALLS,
    ImagePart,
    Prompt,
    Reply,
    chat_messages,
    conversation_id,
    split_tool_calls,
)
from engine.api.errors import ApiError
from engine.api.fair import FairGate
from engine.api.metrics import ApiMetrics
from engine.api.reply_text import ReplyText
from engine.api.store_state import STORE_UNREACHABLE, StoreState
from engine.api.tokenize import PromptEncoder
from engine.decode import DecodeError, DecodeRequest, DecodeResult
from engine.decode.request import CONTEXT, MAX_TOKENS
from engine.prefill import PrefillRequest
from engine.prefill.request import COLD, PromptImage
from engine.serving.loop import ServingBusy, ServingClosed, ServingLoop
from engine.text.chat_prompt import ChatPromptError, split_images
from engine.vision.images import DecodeBudget, DecodedImage, ImageBusy, ImageError, ImageLimits, decode_data_url
from engine.vision.stage import VisionStage
from kvstore.block import Block, ImageSpan


class Service:
    def __init__(self, runner: ServingLoop, tokenizer: Any, encoder: PromptEncoder, stop_token_ids: Sequence[int],
                 advisor: Advisor | None = None, max_in_flight: int = 128, max_in_flight_per_tenant: int = 64,
                 gate: FairGate | None = None, store: StoreState | None = None, vision: VisionStage | None = None,
                 image_limits: ImageLimits = ImageLimits(), decode_budget: DecodeBudget | None = None) -> None:
        """`vision`: the stage image parts go through (None: a request with an image is refused, 400).
        `decode_budget`: the bytes images being decoded may hold (None: 2 GiB, half of it per tenant)."""
        self.runner, self.tokenizer, self.encoder, self.advisor = runner, tokenizer, encoder, advisor
        self.store = store or StoreState(None)  # whether the store's daemons answer (engine/api/store_state.py)
        self.vision, self.image_limits = vision, image_limits
        self.decode_budget = decode_budget or DecodeBudget(2 << 30, 1 << 30)
        # requests in the engines at once, shared fairly between tenants (engine/api/fair.py)
        self.gate = gate or FairGate(runner.engine.config.max_running, 0)
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_in_flight, self.max_in_flight_per_tenant = max_in_flight, max_in_flight_per_tenant
        self.in_flight: Counter[str] = Counter()  # requests admitted and not yet done, by tenant
        if runner.prefill is None:
            raise ValueError("the API serves prompts: its serving loop needs a prefill engine")
        self.prefill = runner.prefill
        client = self.prefill.client
        writes = (lambda: {"pending_bytes": client.write_behind.pending_bytes, **client.write_behind.counters}
                  ) if client is not None else dict

        def engine_load() -> dict[str, int]:  # the loop's Load (a TypedDict) as the plain counts metrics read
            load = runner.load
            return {"running": load["running"], "waiting": load["waiting"], "kv_tokens": load["kv_tokens"],
                    "queued_tokens": load["queued_tokens"], "kv_capacity": load["kv_capacity"]}

        self.metrics = ApiMetrics(engine_load, lambda: advisor.advised if advisor else {}, writes)

    async def generate(self, prompt: Prompt, tenant: str, traffic_class: str, overloaded: int = 429
                       ) -> AsyncIterator[list[int] | str | Reply]:
        """The prompt's ids, then text as it becomes safe to send, then the Reply. ApiError (before the ids)
        for a prompt the template refuses or a server or tenant at its limit of requests in flight (status
        `overloaded`), and (before any text) for a request the engine refuses. A caller that stops
        iterating early (its client went away) cancels the generation."""
        full = sum(self.in_flight.values()) >= self.max_in_flight
        if full or self.in_flight[tenant] >= self.max_in_flight_per_tenant:
            raise ApiError(overloaded, "too many requests in flight; retry later",
                           kind="overloaded_error" if overloaded == 529 else "rate_limit_error")
        self.in_flight[tenant] += 1
        try:
            ids, images = await self._encode(prompt, tenant, overloaded)
            yield ids
            async with self.gate.slot(tenant):  # waits while the tenant holds its share of the engines
                async for item in self._generated(prompt, ids, images, tenant, traffic_class, overloaded):
                    yield item
        finally:
            self.in_flight[tenant] -= 1

    async def _generated(self, prompt: Prompt, ids: list[int], images: tuple[PromptImage, ...], tenant: str,
                         traffic_class: str, overloaded: int) -> AsyncIterator[str | Reply]:
        """The text, then the Reply, of a prompt in the engines; cancels the generation if left early."""
        ticket = None
        try:
            started, loop = time.monotonic(), asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()

            def on_token(token: int) -> None:
                loop.call_soon_threadsafe(events.put_nowait, ("token", token))

            def on_done(result: DecodeResult | None, error: Exception | None) -> None:
                loop.call_soon_threadsafe(events.put_nowait, ("done", (result, error)))

            # the tenant's salt comes from its API key, never from the request body
            prefill = PrefillRequest(ids, salt=tenant, traffic_class=traffic_class, session_id=conversation_id(prompt),
                                     images=images)
            request = DecodeRequest(prefill, prompt.sampling, on_token=on_token)
            text = ReplyText(self.tokenizer.decode, self.stop_token_ids, prompt.sampling.stop, bool(prompt.tools))
            try:
                ticket = self.runner.submit(request, on_done, tenant)
            except ServingClosed:
                raise ApiError(503, "the server is shutting down; retry later", kind="overloaded_error") from None
            except ServingBusy:  # a loop built with bounds of its own: the same answer as this API's own limits
                raise ApiError(overloaded, "too many requests in flight; retry later",
                               kind="overloaded_error" if overloaded == 529 else "rate_limit_error") from None
            first, called = True, False
            while True:
                kind, value = await events.get()
                if kind == "token":
                    if first:
                        self.metrics.ttft.observe(time.monotonic() - started)
                        first = False
                    if called:
                        continue  # sampled before the cancel landed: past the call, never sent
                    if new := text.add(value):
                        yield new
                    if prompt.tools and CALL_FENCE in text.text and split_tool_calls(text.text, prompt.tools)[1]:
                        called = True  # a whole tool call: the reply ends there (its result arrives as cancelled)
                        self.runner.cancel(ticket)
                    continue
                result, error = value
                ticket = None  # done: nothing to cancel
                if isinstance(error, DecodeError):  # the engine refused the request
                    raise ApiError(400, str(error), "max_tokens" if str(error).startswith("max_tokens") else None)
                if error is not None:  # the engine failed
                    raise ApiError(500, str(error), kind="server_error")
                held = text.finish()
                content, calls = split_tool_calls(text.text, prompt.tools) if prompt.tools else (text.text, [])
                if not calls and held:
                    yield held
                reason = TOOL_CALLS if calls else LENGTH if result.finish_reason in (MAX_TOKENS, CONTEXT) else STOP
                reply = Reply(content, calls, reason, len(ids), len(result.tokens), result.cached_tokens,
                              text.stop_sequence, result.tokens)
                self._finished(reply, started)
                path = result.prefill_path or "none"
                if path == COLD and self.store.missing_store():  # not a prompt the store lacks: no store to ask
                    path = STORE_UNREACHABLE
                self.metrics.prefill_paths.labels(path, result.window_source or "none").inc()
                self.metrics.drafts.labels("accepted").inc(result.accepted_drafts)
                self.metrics.drafts.labels("rejected").inc(result.drafted - result.accepted_drafts)
                self._advise(tenant, traffic_class, prefill.identity() + result.tokens, goes_on=bool(calls))
                yield reply
                return
        finally:
            if ticket is not None:
                self.runner.cancel(ticket)
                self.metrics.cancelled.inc()

    async def _encode(self, prompt: Prompt, tenant: str, overloaded: int = 429
                      ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt's ids, and its images with their encoder outputs (`engine.vision.stage`); ApiError with
        status `overloaded` while images being decoded hold the decode budget."""
        started = time.monotonic()
        parts = [part for message in prompt.messages for part in message.images]
        if parts and self.vision is None:
            raise ApiError(400, "this server takes no images: start kvstore-api with --vision to enable them",
                           "messages")
        if len(parts) > self.image_limits.max_images:
            raise ApiError(400, f"{len(parts)} images is more than the limit of {self.image_limits.max_images} a "
                                "request", "messages")
        decoded = await asyncio.to_thread(self._decode_images, parts, tenant, overloaded) if parts else []
        image_tokens = self.vision.tokens_per_image if self.vision is not None and parts else 0
        try:
            marked = await self.encoder.encode(chat_messages(prompt), image_tokens=image_tokens)
        except ChatPromptError as exc:
            raise ApiError(400, str(exc), "messages") from None
        ids, starts = split_images(marked, image_tokens) if parts else (marked, [])
        self.metrics.encode.observe(time.monotonic() - started)
        if not parts:
            return ids, ()
        assert self.vision is not None and len(starts) == len(decoded), "each image part left one mark"
        rows = await asyncio.to_thread(self.vision.embeds, decoded, tenant)
        return ids, tuple(PromptImage(ImageSpan(start, image_tokens, image.digest), embeds)
                          for start, image, embeds in zip(starts, decoded, rows, strict=True))

    def _decode_images(self, parts: Sequence[ImagePart], tenant: str, overloaded: int) -> list[DecodedImage]:
        """Off the event loop, one at a time: each part's pixels as the tower takes them, or ApiError naming the
        first bad one (400), or the first that does not fit the decode budget now (`overloaded`)."""
        assert self.vision is not None, "images are decoded only for a server with a vision stage"
        hold = functools.partial(self.decode_budget.hold, tenant)
        out = []
        for i, part in enumerate(parts):
            url = part.data if part.media_type is None else f"data:{part.media_type};base64,{part.data}"
            try:
                out.append(decode_data_url(url, self.image_limits, part.caller_id, hold, self.vision.resized))
            except ImageBusy as exc:
                raise ApiError(overloaded, f"image {i}: {exc}", "messages",
                               kind="overloaded_error" if overloaded == 529 else "rate_limit_error") from None
            except ImageError as exc:
                raise ApiError(400, f"image {i}: {exc}", "messages") from None
        return out

    def blocks(self, tenant: str, tokens: Sequence[int]) -> list[Block]:
        """The full blocks of `tokens` in the tenant's namespace: what the store holds of them."""
        return self.prefill.namespace(tenant).blocks(tokens)

    def close(self) -> None:
        """Stop the engines, then store what they queued for the store, then end the encoder's processes."""
        self.runner.close()
        if self.prefill.client is not None:
            self.prefill.client.close()
        self.encoder.close()

    def close_conversation(self, tenant: str, tokens: Sequence[int]) -> None:
        if self.advisor is not None:
            self.advisor.closed(self.blocks(tenant, tokens))

    def _advise(self, tenant: str, traffic_class: str, tokens: Sequence[int], goes_on: bool) -> None:
        if self.advisor is not None:
            self.advisor.replied(self.blocks(tenant, tokens[:-1]), traffic_class, time.monotonic(), goes_on)

    def _finished(self, reply: Reply, started: float) -> None:
        m = self.metrics
        m.duration.observe(time.monotonic() - started)
        m.prompt_tokens.inc(reply.prompt_tokens)
        m.cached_tokens.inc(reply.cached_tokens)
        m.completion_tokens.inc(reply.completion_tokens)
        m.finished.labels(reply.finish_reason).inc()
