"""The decode instance's wire messages (engine.decode.serve): parsing and checking a line, with no engine.

Called by the instance's reader threads: it touches no engine state. The protocol itself is described in
engine/decode/serve.py.
"""

from __future__ import annotations

import json
from typing import Any

from engine.decode.request import DecodeRequest
from engine.decode.sampling import SamplingParams
from engine.prefill.request import PrefillRequest

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "stop_token_ids")
STORE_FIELDS = {"from_handoff": bool, "salt": str, "traffic_class": str, "session_id": str}  # with --servers
GENERATE_FIELDS = {"op", "id", "prompt", "max_tokens", *SAMPLING_FIELDS}


class ProtocolError(ValueError):
    """A line or request the instance refuses; answered with an error for it alone."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true must not pass for the id 1


def _request_id(message: dict) -> str | int:
    rid = message.get("id")
    if not (is_int(rid) or isinstance(rid, str)):
        raise ProtocolError(f"id must be a string or an integer, got {rid!r}")
    return rid


def parse_generate(message: dict, store: bool = False) -> DecodeRequest:
    """The DecodeRequest of a generate message; ProtocolError or DecodeError saying why not. With a `store`,
    its prompt is a PrefillRequest (prefilled through the store, the reply saved)."""
    if unknown := sorted(set(message) - GENERATE_FIELDS - (set(STORE_FIELDS) if store else set())):
        hint = " (stop strings need a tokenizer, which an instance has not: use stop_token_ids)" \
            if "stop" in unknown else ""
        raise ProtocolError(f"generate: unknown fields {unknown}{hint}")
    prompt = message.get("prompt")
    if not isinstance(prompt, list) or not all(is_int(t) for t in prompt):
        raise ProtocolError("generate: prompt must be a list of integer token ids")
    if "max_tokens" not in message:
        raise ProtocolError("generate: max_tokens is required (an integer >= 1, or null to stop at the context)")
    sampling = {name: message[name] for name in SAMPLING_FIELDS if name in message}
    if "stop_token_ids" in sampling:
        ids = sampling["stop_token_ids"]
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise ProtocolError("generate: stop_token_ids must be a list of integers")
        sampling["stop_token_ids"] = tuple(ids)
    params = SamplingParams(max_tokens=message["max_tokens"], **sampling)  # DecodeError for bad values
    if not store:
        return DecodeRequest(prompt, params)
    fields = {name: message[name] for name in STORE_FIELDS if name in message}
    for name, value in fields.items():
        if not isinstance(value, STORE_FIELDS[name]):
            raise ProtocolError(f"generate: {name} must be a {STORE_FIELDS[name].__name__}, got {value!r}")
    return DecodeRequest(PrefillRequest(prompt, **fields), params)


def prompt_tokens(request: DecodeRequest) -> int:
    prompt = request.prompt
    return len(prompt.tokens if isinstance(prompt, PrefillRequest) else prompt)


def parse_line(line: bytes, store: bool = False) -> tuple[str, dict, DecodeRequest | None]:
    """(op, message, the DecodeRequest of a generate): everything about a line that needs no engine."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an over-long int, nesting past the stack
        raise ProtocolError(f"not a JSON line: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a JSON object")
    op = message.get("op")
    if op == "generate":
        _request_id(message)
        return op, message, parse_generate(message, store)
    if op == "cancel":
        _request_id(message)
        return op, message, None
    if op in ("load", "shutdown"):
        return op, message, None
    raise ProtocolError(f"unknown op {op!r}: one of generate, cancel, load, shutdown")
