"""The decode instance's messages (proto/decode.proto) to and from the engine's objects, with no engine.

What a request is refused for here needs nothing but the request: its fields, and the model's context.
What needs the engine (token ids outside the vocabulary, a reply past the context, KV pages) is refused
by DecodeEngine.submit, on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from engine.decode import DecodeError, DecodeRequest, DecodeResult, SamplingParams
from engine.decode.errors import few
from engine.prefill import PrefillRequest
from engine.serving.loop import Load
from engine.serving.proto import pb
from kvstore.block import tenant_of

STORE_FIELDS = ("from_handoff", "tenant", "traffic_class", "session_id")


class RequestRefused(ValueError):
    """A request the instance refuses (INVALID_ARGUMENT), for it alone."""


def parse(message_type, raw: bytes):
    """A message from the bytes a client sent; RequestRefused if they are not one (gRPC's own deserializer
    would end the call INTERNAL) or hold fields this protocol does not have."""
    try:
        message = message_type.FromString(raw)
    except ProtobufDecodeError:
        raise RequestRefused(f"expected a valid {message_type.DESCRIPTOR.name} message") from None
    known_fields(message)
    return message


def known_fields(message) -> None:
    """RequestRefused if `message` holds fields this protocol does not have: a field of a newer protocol,
    ignored, would change the answer without a word (every RPC refuses them alike)."""
    if unknown := sorted({field.field_number for field in UnknownFieldSet(message)}):
        raise RequestRefused(f"{message.DESCRIPTOR.name}: fields {few(unknown)} are not in this instance's "
                             "protocol")


def decode_request(message: pb.GenerateRequest, store: bool, context: int) -> DecodeRequest:
    """The engine's request for a GenerateRequest; RequestRefused saying why not. With a `store`, the prompt
    is a PrefillRequest (prefilled through the store, the reply saved)."""
    known_fields(message)
    length = message.WhichOneof("length")
    if length is None or (length == "to_context" and not message.to_context):
        raise RequestRefused("GenerateRequest: max_tokens (>= 1) or to_context (true: stop at the model's "
                             "context) is required")
    prompt = list(message.prompt)
    if not prompt:
        raise RequestRefused("GenerateRequest: empty prompt: at least one token is needed")
    if len(prompt) >= context:  # refused before it queues anything
        raise RequestRefused(f"GenerateRequest: prompt of {len(prompt)} tokens leaves no room for a reply in the "
                             f"model's context of {context}")
    try:
        sampling = SamplingParams(
            max_tokens=message.max_tokens if length == "max_tokens" else None, temperature=message.temperature,
            top_k=message.top_k, top_p=message.top_p if message.HasField("top_p") else 1.0,
            seed=message.seed if message.HasField("seed") else None, stop_token_ids=tuple(message.stop_token_ids))
    except DecodeError as exc:
        raise RequestRefused(f"GenerateRequest: {exc}") from None
    given = [name for name in STORE_FIELDS
             if (message.from_handoff if name == "from_handoff" else message.HasField(name))]
    if not store:
        if given:
            raise RequestRefused(f"GenerateRequest: {', '.join(given)} need a store, and this instance has none "
                                 "(it was started without --servers)")
        return DecodeRequest(prompt, sampling)
    if message.HasField("traffic_class") and not message.traffic_class:
        raise RequestRefused("GenerateRequest: traffic_class, when given, must name a class")
    if message.HasField("tenant") and len(message.tenant) != 16:
        raise RequestRefused(f"GenerateRequest: tenant is 16 bytes (kvstore.block.tenant_of of the salt), not "
                             f"{len(message.tenant)}")
    # the tenant, never the salt, comes over the wire (docs/design.md section 3); unset: the empty salt's
    tenant = bytes(message.tenant) if message.HasField("tenant") else tenant_of("")
    return DecodeRequest(PrefillRequest(prompt, traffic_class=message.traffic_class or "chat",
                                        session_id=message.session_id if message.HasField("session_id") else None,
                                        from_handoff=message.from_handoff, tenant=tenant), sampling)


def result_message(result: DecodeResult) -> pb.Result:
    return pb.Result(tokens=result.tokens, finish_reason=result.finish_reason, token_times_s=result.token_times_s,
                     prompt_tokens=result.prompt_tokens, preemptions=result.preemptions,
                     recomputed_tokens=result.recomputed_tokens, resumed_from_store=result.resumed_from_store,
                     cached_tokens=result.cached_tokens, prefill_path=result.prefill_path or "")


def load_message(load: Load) -> pb.LoadReply:
    return pb.LoadReply(**load)


def load_of(message: pb.LoadReply) -> Load:
    return Load(running=message.running, waiting=message.waiting, kv_tokens=message.kv_tokens,
                queued_tokens=message.queued_tokens, kv_capacity=message.kv_capacity)


@dataclass(frozen=True)
class GenerateResult:
    """A finished reply as a client receives it (pb.Result)."""

    tokens: list[int]  # a final stop token included
    finish_reason: str  # stop_token, max_tokens, context or cancelled
    token_times_s: list[float]  # per token, seconds from the engine's submit
    prompt_tokens: int
    preemptions: int
    recomputed_tokens: int
    resumed_from_store: int
    cached_tokens: int
    prefill_path: str | None  # with a store, how the prompt's KV came; None without one

    @classmethod
    def of(cls, message: pb.Result) -> GenerateResult:
        return cls(list(message.tokens), message.finish_reason, list(message.token_times_s), message.prompt_tokens,
                   message.preemptions, message.recomputed_tokens, message.resumed_from_store,
                   message.cached_tokens, message.prefill_path or None)
