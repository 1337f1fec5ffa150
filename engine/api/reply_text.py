"""A reply's text as its tokens come: decoded incrementally, cut at a stop string, and held back where what
follows could still change it.

Decoding the whole reply again at every token costs O(n²) over a reply; here only the tokens since the
last clean boundary are decoded (twice: with and without the newest, the difference being the new text),
which also keeps a tokenizer's leading-space handling right, since both decodes start at the same token.
A byte-level token that ends half a UTF-8 character decodes to U+FFFD: such text waits for its next token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.api.conversation import CALL_FENCE


class ReplyText:
    def __init__(self, detokenize: Callable[[list[int]], str], stop_token_ids: Sequence[int],
                 stop: Sequence[str], hold_tool_calls: bool = False) -> None:
        """`hold_tool_calls`: never release text from where a tool call (`CALL_FENCE`) begins or may begin."""
        self.detokenize, self.stop_ids, self.stop = detokenize, set(stop_token_ids), tuple(stop)
        self.hold_tool_calls = hold_tool_calls
        self.tokens: list[int] = []
        self.text = ""  # decoded so far, cut at the first stop string
        self.stop_sequence: str | None = None  # the stop string that ended the text, once one has
        self.sent = 0  # characters of `text` released
        self._prefix = self._read = 0  # tokens[_prefix:_read] decode to the tail of `text` already taken
        self._searched = 0  # characters of `text` already searched for stop strings

    def add(self, token: int) -> str:
        """Record a token; the new text it makes safe to release."""
        if token not in self.stop_ids and self.stop_sequence is None:
            self.tokens.append(token)
            self._decode(final=False)
        return self._release(self._ready())

    def finish(self) -> str:
        """The rest of the text, at the end of the reply (the caller decides whether held text goes out)."""
        self._decode(final=True)
        return self._release(len(self.text))

    def _decode(self, final: bool) -> None:
        before = self.detokenize(self.tokens[self._prefix : self._read])
        after = self.detokenize(self.tokens[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
            self._cut_at_stop()

    def _cut_at_stop(self) -> None:
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self._searched - longest + 1)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            at, self.stop_sequence = min(found)
            self.text = self.text[:at]
        self._searched = len(self.text)

    def _ready(self) -> int:
        """How much of `text` can go out: not what may be the start of a stop string or a tool call."""
        if self.stop_sequence is not None:
            return len(self.text)
        ready = len(self.text) - max((len(s) - 1 for s in self.stop), default=0)
        if self.hold_tool_calls:
            fence = self.text.find(CALL_FENCE)
            if fence < 0:
                fence = len(self.text) - _partial_suffix(self.text, CALL_FENCE)
            ready = min(ready, fence)
        return ready

    def _release(self, ready: int) -> str:
        end = max(self.sent, ready)
        new, self.sent = self.text[self.sent : end], end
        return new


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a beginning of `marker` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
