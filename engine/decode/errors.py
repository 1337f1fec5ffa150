"""The one error the decode engine raises for bad input, and how its messages name many values."""

from collections.abc import Sequence

SHOWN = 5  # values an error message names at most; the rest are counted


class DecodeError(ValueError):
    """A request the decode engine cannot serve: raised for that request alone, nothing else is disturbed."""


def few(values: Sequence[object], shown: int = SHOWN) -> str:
    """`values` for an error message, bounded: the first few and how many there are. A message goes back to
    the client whole (a gRPC status's trailer, an HTTP body), so 200,000 refused ids must not all be in it."""
    if len(values) <= shown:
        return f"[{', '.join(map(str, values))}]"
    return f"[{', '.join(map(str, values[:shown]))}, ...] ({len(values)} in all)"
