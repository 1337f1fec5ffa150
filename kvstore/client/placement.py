"""Rendezvous (highest-random-weight) placement of block keys over daemons.

Thaler & Ravishankar, "Using name-based mappings to increase hit rates" (1998): each key goes to
the member with the highest score H(member, key). When a member leaves, only its keys move, and they
spread evenly over the others; when it returns, exactly those keys come back.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def score(member: str, key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key, seed=xxhash.xxh3_64_intdigest(member.encode()))


def place(key: bytes, members: Sequence[str]) -> str:
    """The member that owns `key`; `members` must not be empty."""
    return max(members, key=lambda member: score(member, key))


def ranked(key: bytes, members: Sequence[str], n: int) -> list[str]:
    """The first `n` members for `key` in rendezvous order: the owner, then where its copies go. Every client
    computes the same list, and a member joining or leaving shifts it by at most one place."""
    return sorted(members, key=lambda member: score(member, key), reverse=True)[:n]
