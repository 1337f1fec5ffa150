"""The daemon's metrics: one Prometheus registry, served on /metrics and as samples over the Stats RPC."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.proto import pb
from kvstore.stats import Sample

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


RELEASE_CAUSES = {"aged": "age", "reclaimed": "share"}  # HotTier's PrefetchEnd -> kvstore_promotion_released cause


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.lookup_keys = Counter("kvstore_lookup_keys", "Keys asked for in Lookup", registry=r)
        self.lookup_hits = Counter("kvstore_lookup_hits", "Keys found by Lookup (leading run)", registry=r)
        self.hits = Counter("kvstore_hits", "Blocks served by Get, by tier", ["tier"], registry=r)
        self.class_hits = Counter("kvstore_class_hits", "Blocks served by Get, by traffic class", ["traffic_class"],
                                  registry=r)
        self.misses = Counter("kvstore_misses", "Blocks not served by Get, by cause", ["cause"], registry=r)
        self.bytes_read = Counter("kvstore_read_bytes", "Payload bytes served by Get", registry=r)
        self.hot_reads = Counter("kvstore_hot_reads", "Blocks served while hot (clients asked to keep copies)",
                                 registry=r)
        self.region_bytes = Counter("kvstore_region_read_bytes", "Payload bytes written into clients' shared memory",
                                    registry=r)
        self.bytes_written = Counter("kvstore_written_bytes", "Record bytes written by Put", registry=r)
        self.puts = Counter("kvstore_puts", "Put records, by result", ["result"], registry=r)
        self.evictions = Counter("kvstore_evictions", "Blocks evicted for capacity", registry=r)
        self.share_evictions = Counter("kvstore_share_evictions", "Blocks evicted because their tenant held more "
                                       "than tenant_max_share of the budget", registry=r)
        self.advised = Counter("kvstore_advised_blocks", "Held blocks engines advised on, by whether their "
                               "conversation goes on", ["continues"], registry=r)
        # Promotion (promotion.py): blocks copied from SSD into the DRAM tier before a Get asked for them
        self.promoted_blocks = Counter("kvstore_promoted_blocks", "Blocks promoted from SSD into the DRAM tier "
                                       "before a read, by reason: advice (Advise continues) or lookup (Lookup "
                                       "promote)", ["reason"], registry=r)
        self.promoted_bytes = Counter("kvstore_promoted_bytes", "Record bytes promoted into the DRAM tier, by reason",
                                      ["reason"], registry=r)
        self.promoted_used = Counter("kvstore_promoted_used_blocks", "Promoted blocks read from the DRAM tier "
                                     "(counted at their first read)", registry=r)
        self.promoted_used_bytes = Counter("kvstore_promoted_used_bytes", "Record bytes of promoted blocks read",
                                           registry=r)
        self.promoted_wasted = Counter("kvstore_promoted_wasted_blocks", "Promoted blocks evicted or discarded from "
                                       "the DRAM tier, or no longer held for a read, before any read", registry=r)
        self.promoted_wasted_bytes = Counter("kvstore_promoted_wasted_bytes", "Record bytes of promoted blocks "
                                             "that left the DRAM tier, or stopped being held, unread", registry=r)
        self.promotion_released = Counter("kvstore_promotion_released_blocks", "Unread promoted blocks no longer "
                                          "held for their read (left in the DRAM tier as plain entries; counted "
                                          "wasted too), by cause: age (unread for promote_max_age_s) or share "
                                          "(their tenant past its share while another's promotion needed room)",
                                          ["cause"], registry=r)
        self.promotion_dropped = Counter("kvstore_promotion_dropped_blocks", "Blocks asked for promotion and not "
                                         "promoted, by cause: queue_full, budget (promote_bytes of unread promoted "
                                         "blocks held), tenant_share (the block's tenant holds its share of "
                                         "promote_bytes, other tenants holding theirs), no_room (only pinned or "
                                         "unread promoted blocks to evict), "
                                         "gone (deleted, evicted or expired), unreadable (failed verification or "
                                         "an I/O error)", ["cause"], registry=r)
        self.promotion_in_dram = Counter("kvstore_promotion_in_dram_blocks", "Blocks asked for promotion that were "
                                         "in the DRAM tier already", registry=r)
        self.promotion_cancelled = Counter("kvstore_promotion_cancelled_blocks", "Queued blocks taken out of the "
                                           "promotion queue by Advise (continues false) or Delete", registry=r)
        self.promotion_queued = Gauge("kvstore_promotion_queued_blocks", "Blocks waiting to be promoted", registry=r)
        self.promoted_unread_bytes = Gauge("kvstore_promoted_unread_bytes", "Bytes of promoted blocks in the DRAM "
                                           "tier not read yet (at most promote_bytes)", registry=r)
        self.gets_in_flight = Gauge("kvstore_gets_in_flight", "Gets being served, both transports (promotion "
                                    "waits until all of them are waiting on their clients)", registry=r)
        self.gets_waiting_on_client = Gauge("kvstore_gets_waiting_on_client", "Gets being served that wait for "
                                            "their client to take bytes (promotion does not wait for them)",
                                            registry=r)
        # Checks of the daemon's own copies: a client's report (Verify) and the scrub (scrub.py)
        self.verified_blocks = Counter("kvstore_verified_blocks", "Held blocks checked again because a client "
                                       "found their bytes corrupt (Verify)", registry=r)
        self.verify_corrupt = Counter("kvstore_verify_corrupt", "Corrupt copies Verify found and dropped, by copy: "
                                      "dram (discarded from the DRAM tier) or ssd (the block removed)", ["copy"],
                                      registry=r)
        self.verify_skipped = Counter("kvstore_verify_skipped", "Keys a Verify named and did not check, by reason: "
                                      "rate (the caller's verify_bytes_per_s spent) or recent (checked within "
                                      "verify_recheck_s, not moved since: answered from that check)", ["reason"],
                                      registry=r)
        self.scrub_bytes = Counter("kvstore_scrub_bytes", "Record bytes the scrub read back and checked", registry=r)
        self.scrub_corrupt = Counter("kvstore_scrub_corrupt", "Corrupt blocks the scrub found and removed",
                                     registry=r)
        self.scrub_passes = Counter("kvstore_scrub_passes", "Scrub passes over the whole index completed",
                                    registry=r)
        self.expiries = Counter("kvstore_expiries", "Blocks dropped at the end of their TTL", registry=r)
        self.maintenance_passes = Counter("kvstore_maintenance_passes", "Background passes (expiry, eviction, "
                                          "compaction) completed", registry=r)
        self.compactions = Counter("kvstore_compactions", "Segments compacted or expired", ["reason"], registry=r)
        self.copied_forward = Counter("kvstore_copied_forward_bytes", "Live bytes copied by compaction", registry=r)
        self.disk_full = Counter("kvstore_disk_full", "Puts refused because the disk was full", registry=r)
        self.blocks = Gauge("kvstore_blocks", "Indexed blocks, by traffic class", ["traffic_class"], registry=r)
        self.live_bytes = Gauge("kvstore_live_bytes", "Bytes of indexed records", registry=r)
        self.disk_bytes = Gauge("kvstore_disk_bytes", "Bytes of segment files", registry=r)
        self.capacity_bytes = Gauge("kvstore_capacity_bytes", "Configured byte budget", registry=r)
        self.hot_bytes = Gauge("kvstore_hot_tier_bytes", "Bytes held in the DRAM tier", registry=r)
        self.access_log_dropped = Gauge("kvstore_access_log_dropped_lines", "Access log lines not written: past a "
                                        "call's cap or with the writer behind", registry=r)
        self.segments = Gauge("kvstore_segments", "Segment files", registry=r)
        self.index_entries = Gauge("kvstore_index_entries", "LMDB index entries", registry=r)
        self.index_map_bytes = Gauge("kvstore_index_map_bytes", "LMDB map size", registry=r)
        self.rpc_latency = Histogram("kvstore_rpc_seconds", "RPC latency", ["method"], buckets=_LATENCY_BUCKETS,
                                     registry=r)
        self.rpc_errors = Counter("kvstore_rpc_errors", "RPCs ended with an error status", ["method", "code"],
                                  registry=r)

    def prefetch_ended(self, how: str, nbytes: int) -> None:
        """A promoted block left the DRAM tier's unread state (HotTier's on_prefetch_end): "used", or else wasted:
        "wasted" (evicted or discarded), "aged" or "reclaimed" (no longer held, left in the tier)."""
        if how == "used":
            self.promoted_used.inc()
            self.promoted_used_bytes.inc(nbytes)
            return
        self.promoted_wasted.inc()
        self.promoted_wasted_bytes.inc(nbytes)
        if how in RELEASE_CAUSES:
            self.promotion_released.labels(cause=RELEASE_CAUSES[how]).inc()

    def samples(self) -> list[Sample]:
        """Every sample, labels as they are (histogram buckets and creation times left out)."""
        return [Sample(s.name, dict(sorted(s.labels.items())), float(s.value))
                for family in self.registry.collect() for s in family.samples
                if not s.name.endswith(("_bucket", "_created"))]

    def stats_response(self) -> pb.StatsResponse:
        """The Stats RPC's answer: the samples, and for one release the old flat `values` beside them."""
        samples = self.samples()
        return pb.StatsResponse(samples=[pb.Sample(name=s.name, labels=s.labels, value=s.value) for s in samples],
                                values=flatten(samples))


def flatten(samples: list[Sample]) -> dict[str, float]:
    """The old `name{label=value,...}` -> value form (deprecated: clients older than StatsResponse.samples)."""
    out: dict[str, float] = {}
    for s in samples:
        labels = ",".join(f"{k}={v}" for k, v in s.labels.items())
        out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
