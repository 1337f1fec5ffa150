"""A plain greedy loop on the engine: the prompt prefilled, then one token per forward, argmax each time.

    from tests.engine.greedy import greedy
    reply = greedy(engine, prompt_ids, 32, stop_ids={tokenizer.eos_token_id})   # token ids of the reply

`engine` is a `PrefillEngine` (the prompt goes through the store: cached prefix, window tier, saves) or a
bare `Decoder` (the prompt computed alone, no store). Enough to decode short replies and to check the
engine's tokens against `transformers`' `generate(do_sample=False)`; the decode engine (batching,
speculation) is a part of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import PrefillRequest

DECODER_BLOCK_TOKENS = 256  # page size of the private pool a bare Decoder decodes in


def greedy(engine_or_model: PrefillEngine | Decoder, prompt_ids: Sequence[int], n_tokens: int,
           stop_ids: Collection[int] = (), session_id: str | None = None) -> list[int]:
    """The `n_tokens` (or fewer) token ids greedy decoding appends to `prompt_ids`.

    Decoding ends early after a token of `stop_ids`, which is included (as `generate` includes its EOS).
    With a PrefillEngine the prompt is prefilled through it (submitted under `session_id`, so the next
    turn resumes from its window state) and the reply decodes in that request's KV pages, which are
    released at the end; the engine must have nothing else pending, and its pool must hold prompt and
    reply. With a Decoder the prompt is computed in one chunk in a pool of its own.
    """
    if n_tokens < 0:
        raise ValueError(f"greedy: n_tokens must be >= 0, got {n_tokens}")
    if not prompt_ids:
        raise ValueError("greedy: the prompt is empty; at least one token is needed")
    if n_tokens == 0:
        return []
    total = len(prompt_ids) + n_tokens - 1  # the last token is emitted, never fed back
    if isinstance(engine_or_model, PrefillEngine):
        model = engine_or_model.model
        result = engine_or_model.prefill(PrefillRequest(list(prompt_ids), session_id=session_id))
        kv, token = result.kv, result.first_token
    elif isinstance(engine_or_model, Decoder):
        model = engine_or_model
        pool = PagePool(model.config, -(-total // DECODER_BLOCK_TOKENS), DECODER_BLOCK_TOKENS, model.dtype,
                        model.device)
        kv = RequestKV(model.config, pool)
        kv.reserve(len(prompt_ids))
        (logits,) = model.forward([Chunk(kv, torch.tensor(list(prompt_ids), dtype=torch.long), 0)])
        token = int(logits.argmax())
    else:
        raise ValueError(f"greedy: expected a PrefillEngine or a Decoder, got {type(engine_or_model).__name__}")
    try:
        kv.reserve(total)
        reply = [token]
        while len(reply) < n_tokens and token not in stop_ids:
            position = len(prompt_ids) + len(reply) - 1
            (logits,) = model.forward([Chunk(kv, torch.tensor([token], dtype=torch.long), position)])  # (vocab,)
            token = int(logits.argmax())
            reply.append(token)
        return reply
    finally:
        kv.release()
