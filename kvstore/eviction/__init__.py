"""Eviction policies behind one interface (`EvictionPolicy`)."""

from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.lru import LRU

POLICIES = {"lru": LRU}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()


__all__ = ["EvictionPolicy", "LRU", "POLICIES", "make_policy"]
