"""What the client counts: ClientStats, since it started (`client.stats`), and PutSummary, of one put.

A module of its own, below every other of the client's, so that each component that counts can take
the one ClientStats it is handed without importing the client that made it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class PutSummary:
    stored: int = 0
    existed: int = 0
    failed: int = 0


@dataclass(slots=True)
class ClientStats:
    lookups: int = 0
    hit_blocks: int = 0
    miss_causes: Counter = field(default_factory=Counter)  # verified-miss and error causes
    tier_hits: Counter = field(default_factory=Counter)  # blocks served by "host" (this process) or "daemon"
    shard_errors: Counter = field(default_factory=Counter)  # address -> failed calls
    data_fallbacks: Counter = field(default_factory=Counter)  # address -> calls its data channel refused, sent by gRPC
    bytes_read: int = 0
    bytes_written: int = 0
    membership_changes: int = 0  # times the set of daemons changed after the client started
    copies_made: int = 0  # copies of hot blocks this client put on members that lacked them
    copy_reads: int = 0  # blocks read from a copy's holder (or a moved block's previous owner), not the owner
    handed_off: int = 0  # moved blocks this client found on their previous owner and copied to the new one
    # Blocks whose bytes failed their checksums here, named to the daemon that sent them (Verify)
    corrupt_reported: int = 0  # blocks reported (the reports the daemons answered)
    corrupt_confirmed: int = 0  # of them, blocks the daemons found a corrupt copy of and dropped
    # Prefetches into the host tier (prefetch.py, AsyncKVClient.prefetch)
    prefetched: int = 0  # blocks a prefetch put in the host tier
    prefetch_used: int = 0  # of them, read (their first pin by a get or a load)
    prefetch_wasted: int = 0  # of them, evicted before any read
    prefetch_refused: int = 0  # blocks not prefetched for want of room: past prefetch_bytes, or no free host slot
    prefetch_cancelled: int = 0  # queued blocks cancel_prefetch took back
    prefetch_missed: int = 0  # blocks a prefetch did not get: not stored, failed verification, or a daemon failed
    prefetch_too_large: int = 0  # blocks larger than a host slot, never kept there
