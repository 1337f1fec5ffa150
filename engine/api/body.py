"""JSON as the APIs take it, from a client's body or from a model's tool call: finite numbers only, and shallow
and short enough that everything done with it afterwards (rendering the tools into the prompt, the template,
the response) stays far inside Python's recursion limit and linear time.

    value = decode(raw)  # a request body, or ApiError(400)
    check_shape(value, max_depth=64, max_items=4096)  # or ApiError(400) naming the field
    value = loads(text)  # a model's tool call: ValueError for NaN, Infinity, 1e999
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.api.errors import ApiError


def loads(text: str | bytes) -> Any:
    """JSON without NaN, Infinity or a number too large for a float (`1e999` would be inf): ValueError.
    RecursionError for nesting past the parser's own limit."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is not a finite number")
    return value


def decode(raw: bytes) -> Any:
    """A request body: valid JSON, finite numbers, no lone surrogate; else ApiError(400). Its shape is
    `check_shape`'s to check."""
    try:
        value = loads(raw)
        json.dumps(value, ensure_ascii=False).encode()  # a lone surrogate (\ud800) cannot be text
    except (ValueError, RecursionError, UnicodeEncodeError):
        raise ApiError(400, "the request body is not valid JSON (or holds NaN, Infinity, a number too large, a "
                            "lone surrogate or nesting too deep)") from None
    return value


def check_shape(value: Any, max_depth: int, max_items: int, dotted: bool = False) -> None:
    """ApiError(400) for an array or object past `max_items` entries or nested past `max_depth`, naming the field
    (`dotted`: Anthropic's `messages.0.content`, else OpenAI's `messages[0].content`); iterative, so no depth
    can overflow the stack, and once over each container."""
    stack: list[tuple[Any, tuple]] = [(value, ())] if isinstance(value, (dict, list)) else []
    while stack:
        item, path = stack.pop()
        if len(path) >= max_depth:
            where = _name(path, dotted)[:200]
            raise ApiError(400, f"the request body nests deeper than {max_depth} levels at {where}", where)
        if len(item) > max_items:
            where = _name(path, dotted) or "the request body"
            raise ApiError(400, f"{where} holds {len(item)} items; at most {max_items} are accepted",
                           _name(path, dotted) or None)
        entries = item.items() if isinstance(item, dict) else enumerate(item)
        stack.extend((v, (*path, k)) for k, v in entries if isinstance(v, (dict, list)))


def within(value: Any, max_depth: int, max_items: int) -> bool:
    """Whether `value` passes `check_shape` (for JSON a model wrote)."""
    try:
        check_shape(value, max_depth, max_items)
    except ApiError:
        return False
    return True


def _name(path: tuple, dotted: bool) -> str:
    if dotted:
        return ".".join(str(k) for k in path)
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else f".{k}" if out else str(k)
    return out
