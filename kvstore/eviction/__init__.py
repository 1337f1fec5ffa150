"""Eviction policies behind one interface (`EvictionPolicy`)."""

from kvstore.eviction.adaptive import Adaptive
from kvstore.eviction.base import EvictionPolicy, ReuseHint
from kvstore.eviction.lru import LRU
from kvstore.eviction.prefix import PrefixLFU
from kvstore.eviction.reuse import PrefixReuse
from kvstore.eviction.s3fifo import S3FIFO
from kvstore.eviction.sieve import SIEVE

POLICIES = ("lru", "s3fifo", "sieve", "prefix-lfu", "prefix-reuse", "adaptive")


def make_policy(name: str, capacity_bytes: int = 0) -> EvictionPolicy:
    """A policy by name; S3-FIFO sizes its queues from `capacity_bytes`, adaptive its shadow caches."""
    if name == "lru":
        return LRU()
    if name == "s3fifo":
        return S3FIFO(max(capacity_bytes, 1))
    if name == "sieve":
        return SIEVE()
    if name == "prefix-lfu":
        return PrefixLFU()
    if name == "prefix-reuse":
        return PrefixReuse()
    if name == "adaptive":
        return Adaptive(capacity_bytes)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["Adaptive", "EvictionPolicy", "LRU", "PrefixLFU", "PrefixReuse", "POLICIES", "ReuseHint", "S3FIFO", "SIEVE",
           "make_policy"]
