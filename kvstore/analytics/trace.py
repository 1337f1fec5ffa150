"""Request traces in the Mooncake format (FAST'25 release): one JSON object a line.

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}

`hash_ids[i]` names the prefix up to and including the i-th block of `block_tokens` (512) input
tokens; the last block may be partial: len(hash_ids) == ceil(input_length / block_tokens).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# A one-hour sample of production chat traffic from the Mooncake FAST'25 release, shipped in the repository
# (traces/README.md: source, licence, sha256); the trace every hit-rate figure in docs/performance.md is on.
CONVERSATION_TRACE = Path(__file__).resolve().parents[2] / "traces" / "conversation_trace.jsonl"
CONVERSATION_TRACE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


GZIP_MAGIC = b"\x1f\x8b"


class TraceError(ValueError):
    def __init__(self, path: Path | str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.line = line


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    traffic_class: str = "chat"

    def block_tokens(self, block: int, block_tokens: int) -> int:
        """Tokens of the `block`-th block: full, or the remainder for the last one."""
        if block < len(self.hash_ids) - 1:
            return block_tokens
        return self.input_length - block_tokens * (len(self.hash_ids) - 1)


def read_trace(path: Path | str, block_tokens: int = 512, skip_bad: bool = False,
               errors: list[str] | None = None) -> Iterator[Request]:
    """The trace's requests in order; a bad line raises TraceError naming it, or is skipped with `skip_bad`.
    A request earlier than the one before it is a bad line: every replay's clock (TTLs, gaps) runs forward."""
    last_ms = 0
    # JSON gives every hash id of every line an int of its own (28 bytes); a block appears in every prompt
    # that holds it, so one object per distinct id keeps a million-request trace to a fraction
    interned: dict[int, int] = {}
    with open(path, "rb") as f:  # decoded line by line, so a line that is not UTF-8 is named like any other
        if f.read(2) == GZIP_MAGIC and not skip_bad:  # no line of it would make sense: say what it is
            raise TraceError(path, 1, "a gzip-compressed file: decompress it first (gunzip)")
        f.seek(0)
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                request = parse_line(decode(raw), block_tokens, interned)
                if request.timestamp_ms < last_ms:
                    raise ValueError(f"timestamp {request.timestamp_ms} goes back from {last_ms}: the trace must "
                                     "be in time order (sort it by timestamp)")
                last_ms = request.timestamp_ms
                yield request
            except ValueError as exc:
                if not skip_bad:
                    raise TraceError(path, number, str(exc)) from None
                if errors is not None:
                    errors.append(f"{path}:{number}: {exc}")


def decode(raw: bytes) -> str:
    """A line as text; ValueError saying where it is not UTF-8 (a binary file, most likely)."""
    if b"\0" in raw:  # UTF-8, but no text has it
        raise ValueError(f"not text (a NUL byte at column {raw.index(0) + 1}): a binary file?")
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}): "
                         "a binary file?") from None


def parse_line(line: str, block_tokens: int, interned: dict[int, int] | None = None) -> Request:
    """One line's request; with `interned`, its hash ids are the ints kept there (added if new)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    for name in ("timestamp", "input_length", "hash_ids"):
        if name not in record:
            raise ValueError(f"missing {name!r}")
    timestamp, length, ids = record["timestamp"], record["input_length"], record["hash_ids"]
    if (not isinstance(timestamp, (int, float)) or timestamp < 0
            or isinstance(timestamp, float) and not math.isfinite(timestamp)):  # JSON's NaN and 1e999 included
        raise ValueError(f"timestamp must be a non-negative number of ms, got {timestamp!r}")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"input_length must be a positive integer, got {length!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError("hash_ids must be a list of integers")
    blocks = -(-length // block_tokens)  # ceil in integers: a float overflows on a huge length
    if len(ids) != blocks:
        raise ValueError(f"{len(ids)} hash_ids for {length} input tokens; expected ceil({length}/{block_tokens})"
                         f" = {blocks}")
    output = record.get("output_length", 0)
    if not isinstance(output, int) or output < 0:
        raise ValueError(f"output_length must be a non-negative integer, got {output!r}")
    traffic_class = record.get("traffic_class", "chat")
    if not isinstance(traffic_class, str) or not traffic_class:
        raise ValueError("traffic_class must be a non-empty string")
    if interned is not None:
        ids = [interned.setdefault(h, h) for h in ids]
    return Request(int(timestamp), length, output, tuple(ids), traffic_class)


def conversation_turns(requests: Sequence[Request], block_tokens: int = 512) -> list[int]:
    """Per request, how many earlier turns of its conversation its prompt holds, as an engine knows
    from a chat prompt's messages; the trace has no messages, so it is rebuilt from the prefixes.

    A turn ends where its prompt's last full block does: a later prompt holding that block continues
    the conversation, one turn deeper. First blocks are left out, as they are system prompts shared by
    unrelated conversations."""
    tips: dict[int, int] = {}  # the last full block of an earlier prompt -> that prompt's turn
    turns = []
    for request in requests:
        full = request.hash_ids[: request.input_length // block_tokens]
        turn = 0
        for key in full[1:]:
            if key in tips:
                turn = tips[key] + 1
        turns.append(turn)
        if len(full) > 1:
            tips[full[-1]] = turn
    return turns


def continued_requests(requests: Sequence[Request], block_tokens: int = 512) -> list[bool]:
    """Whether each request's conversation goes on: a later prompt holds its last full block. (Known
    only in hindsight; the simulator draws the engines' continuation signal from it.)"""
    later: set[int] = set()
    continued = [False] * len(requests)
    for number in range(len(requests) - 1, -1, -1):
        full = requests[number].hash_ids[: requests[number].input_length // block_tokens]
        continued[number] = bool(full) and full[-1] in later
        later.update(full)
    return continued
