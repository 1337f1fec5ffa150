"""What a prefill engine takes and returns, and the errors it raises for bad input."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.model.kv import RequestKV
from kvstore.block import Block, ImageSpan, Namespace, identity_tokens, tenant_of

# How a request's prefix was obtained.
COLD = "cold"  # the store held nothing of it
CACHED = "cached"  # loaded from the store (and, for sliding layers, the window state: `window_source`)
WINDOW_MISSING = "window_missing"  # the store held a prefix but its window state was gone: recomputed exactly
REPLAYED = "replayed"  # the store held a prefix, its window state was gone: rebuilt by replaying its last
#                        R tokens (an approximation; `engine.window`)
NOT_WORTH = "not_worth"  # loading was estimated slower than recomputing
LOAD_FAILED = "load_failed"  # the load delivered less than planned (a daemon died, a block failed
#                              verification): the rest was recomputed
HANDED_OVER = "handed_over"  # continued from the state another process's prefill handed over through the
#                              store (`from_handoff`): only the last token was computed here
PATHS = (COLD, CACHED, WINDOW_MISSING, REPLAYED, NOT_WORTH, LOAD_FAILED, HANDED_OVER)


class PrefillError(ValueError):
    """A request the engine cannot serve; raised at submit, nothing else is disturbed."""


@dataclass(frozen=True)
class PromptImage:
    """An image in a prompt: where its placeholder tokens are, its content hash (both in `span`: the prompt's
    blocks are keyed by it, kvstore.block.identity_tokens), and what the model reads at the placeholders."""

    span: ImageSpan
    embeds: torch.Tensor  # (span.length, hidden) the vision encoder's outputs (engine/vision)


def chunk_embeds(images: Sequence[PromptImage], start: int, n: int) -> tuple[tuple[int, torch.Tensor], ...]:
    """The image rows that fall in tokens [start, start + n), as a `Chunk`'s embeds: (offset in it, rows)."""
    rows = []
    for image in images:
        first, end = max(image.span.start, start), min(image.span.start + image.span.length, start + n)
        if first < end:
            rows.append((first - start, image.embeds[first - image.span.start : end - image.span.start]))
    return tuple(rows)


@dataclass
class PrefillRequest:
    tokens: Sequence[int]
    salt: str = ""  # the tenant's namespace salt: prefixes are shared only within one salt
    traffic_class: str = "chat"  # the store's retention class ("chat", "agent", ...)
    session_id: str | None = None  # a session's newer window state replaces its older one
    namespace: Namespace | None = None  # if given, must be this model's namespace
    turn: int = 0  # earlier turns of the conversation the prompt holds (its assistant messages): for eviction
    exact: bool = False  # never use a replayed (approximate) window or KV: bit-exact continuation, at full cost
    # Prefill -> decode across processes (engine.prefill.handoff): the prefill side sets `hand_off`, and besides the
    # prompt's blocks saves what a decode instance needs to continue it; the decode side sets `from_handoff`
    # and continues from that (or, where it is gone, from whatever the store holds: `PrefillResult.path`).
    hand_off: bool = False
    from_handoff: bool = False
    images: tuple[PromptImage, ...] = ()  # in prompt order; their placeholders are ordinary token ids in `tokens`
    # The tenant, tenant_of(salt) (16 bytes), in place of `salt`: what a request from another process carries,
    # the salt never being sent (docs/design.md section 3). None: the tenant of `salt`.
    tenant: bytes | None = None

    def tenant_digest(self) -> bytes:
        """The request's tenant: `tenant`, else the digest of its salt."""
        return self.tenant if self.tenant is not None else tenant_of(self.salt)

    def identity(self) -> list[int]:
        """The ids the prompt's chain is keyed by: its tokens, each image's placeholders drawn from its digest."""
        return identity_tokens(self.tokens, [image.span for image in self.images])


@dataclass
class PrefillResult:
    request: PrefillRequest
    first_token: int
    logits: torch.Tensor  # (vocab,) of the last prompt token, float32 on the CPU
    kv: RequestKV  # the request's KV (pages + window), for a decode engine; release() when done
    prompt_tokens: int
    stored_tokens: int  # leading tokens the store held
    loaded_tokens: int  # leading tokens loaded rather than computed
    path: str  # one of PATHS
    sources: dict[str, int] = field(default_factory=dict)  # loaded blocks by source: "host" or "daemon"
    ttft_s: float = 0.0  # submit to first token
    chunks: int = 0  # steps that computed part of it
    blocks: tuple[Block, ...] = ()  # the prompt's full blocks: once the reply is done,
    # client.advise(blocks, continues) tells the store whether the conversation goes on
    replayed_tokens: int = 0  # tokens of the stored prefix recomputed to rebuild the window (path "replayed")
    exact: bool = True  # False where the KV descends from a replay, in this request or an earlier turn
    handed_off: bool = False  # `hand_off`: the continuation record was queued for the store (flush() to wait)
    id: int = -1  # the id submit() returned
    # A hybrid model's path "cached" resumed from the window as of the prefix's end, kept in this process's
    # host tier ("host") or read from the store's window record ("store", window_bytes of it); None otherwise
    window_source: str | None = None
    window_bytes: int = 0
