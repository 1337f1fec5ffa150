"""Accepting drafts against the target's scores: the rules that keep speculative decoding lossless.

One request's verification: ℓ drafts d_1..d_ℓ were fed after its last real token, and the target scored
all ℓ + 1 positions in one forward; row i of its scores is the target's next-token distribution after
the history and d_1..d_i. Both rules return the tokens to append: the accepted drafts, then one token of
the target's own (a correction at the first rejection, or a bonus token when all were accepted), so a
step always makes progress.

* Greedy: accept d_i while it equals the target's argmax at row i-1; then append that argmax.
* Sampling (Leviathan et al., Chen et al.): accept d_i with probability min(1, p(d_i) / q(d_i)); at the
  first rejection draw from the residual max(0, p − q), normalised; with all accepted draw the bonus from
  p at row ℓ (`verify_sampled`). The emitted tokens are then distributed exactly as the target's own samples.
* Sampling with a deterministic drafter (n-gram lookup, what the engine runs): q is a point mass at d_i,
  so the rule above accepts with probability p(d_i) and its residual is p without d_i, renormalised. Drawing
  the target's own token at each row and accepting d_i while it equals the draw (`verify_drawn`) is that
  same rule under a coupling that shares the draws: the same acceptance probability, the same residual,
  and one draw per emitted token from the very function plain decoding samples with, so a seeded reply is
  the one decoding without speculation gives, whatever the schedule chose to verify.

p is the distribution the request samples from (after temperature, top-k and top-p,
`engine.decode.sampling.candidates`), given dense over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.model.decoder import argmax_ids


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts accepted, 0..ℓ
    tokens: list[int]  # to append: the accepted drafts, then the target's token (accepted + 1 of them)


def verify_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> Verdict:
    """drafts (ℓ,) int64, logits (ℓ + 1, vocab): accept while draft == argmax."""
    assert drafts.dim() == 1 and logits.dim() == 2 and logits.shape[0] == drafts.shape[0] + 1
    best = argmax_ids(logits)  # (ℓ + 1,), the target's token at each row, as sampling.sample picks it
    matches = (best[:-1] == drafts).int()  # (ℓ,)
    accepted = int(matches.cumprod(0).sum())  # the length of the run of matches from the start
    return Verdict(accepted, drafts[:accepted].tolist() + [int(best[accepted])])


def verify_drawn(drafts: Sequence[int], draw: Callable[[int], int]) -> Verdict:
    """drafts d_1..d_ℓ of a deterministic drafter; draw(i) samples the target's token at row i (advancing
    the request's generator). Rows are drawn in order, and only until the first draw that differs from its
    draft: that draw is the correction, and with every draft matched the draw at row ℓ is the bonus."""
    tokens: list[int] = []
    for i, draft in enumerate(drafts):
        token = draw(i)
        if token != draft:
            return Verdict(i, tokens + [token])
        tokens.append(token)
    return Verdict(len(tokens), tokens + [draw(len(tokens))])


def verify_sampled(drafts: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> Verdict:
    """drafts (ℓ,) int64, probs (ℓ + 1, vocab) the target's sampling distributions (rows summing to 1),
    draft_probs (ℓ, vocab) the drafter's, or None for a deterministic drafter (q a point mass at each draft).
    Draws from `generator` only: ℓ uniforms, then one categorical draw."""
    assert drafts.dim() == 1 and probs.dim() == 2 and probs.shape[0] == drafts.shape[0] + 1
    n = drafts.shape[0]
    rows = torch.arange(n)
    p_draft = probs[rows, drafts]  # (ℓ,) the target's probability of each draft
    if draft_probs is None:
        ratio = p_draft  # q(d) = 1
    else:
        assert draft_probs.shape == (n, probs.shape[1])
        q_draft = draft_probs[rows, drafts]  # (ℓ,)
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=torch.finfo(q_draft.dtype).tiny),
                            torch.ones_like(p_draft))
    uniforms = torch.rand(n, generator=generator, dtype=probs.dtype, device=probs.device)  # (ℓ,), all at once
    rejected = (uniforms >= ratio).nonzero()  # u < min(1, ratio) accepts
    accepted = int(rejected[0, 0]) if rejected.numel() else n
    if accepted == n:  # all accepted: the bonus token from the target's next row
        last = probs[n]
    else:
        q = draft_probs[accepted] if draft_probs is not None else \
            torch.nn.functional.one_hot(drafts[accepted], probs.shape[1]).to(probs.dtype)
        last = residual(probs[accepted], q)
    token = int(torch.multinomial(last, 1, generator=generator))
    return Verdict(accepted, drafts[:accepted].tolist() + [token])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p − q) normalised, (vocab,); p itself where that is all zero (p ≤ q everywhere means p = q,
    and then a rejection has probability 0: only rounding gets here)."""
    rest = (p - q).clamp(min=0)
    total = rest.sum()
    return rest / total if total > 0 else p
