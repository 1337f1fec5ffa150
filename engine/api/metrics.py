"""The API server's Prometheus metrics (GET /metrics), in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ApiMetrics:
    def __init__(self, engine_load: Callable[[], dict[str, int]], advised: Callable[[], dict[str, int]],
                 store_writes: Callable[[], dict[str, int]] = dict) -> None:
        """`engine_load`: the engines' running, waiting and KV tokens; `advised`: conversations the store was
        advised of, by why; `store_writes`: the write-behind queue's pending bytes and its blocks by outcome;
        all read at each scrape."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstore_api_requests", "Requests answered, by API and HTTP status",
                                ["api", "status"], registry=r)
        self.prompt_tokens = Counter("kvstore_api_prompt_tokens", "Prompt tokens of finished replies", registry=r)
        self.cached_tokens = Counter("kvstore_api_cached_prompt_tokens", "Prompt tokens the store held", registry=r)
        # how each prompt's KV came (engine.prefill.request.PATHS) and, for a hybrid model's cached prompt,
        # where its sliding window came from: this process's window tier ("host") or the store ("store")
        self.prefill_paths = Counter("kvstore_api_prefill_paths", "Prompts by prefill path and window source",
                                     ["path", "window"], registry=r)
        self.completion_tokens = Counter("kvstore_api_completion_tokens", "Tokens generated", registry=r)
        self.finished = Counter("kvstore_api_replies", "Replies, by how they ended", ["reason"], registry=r)
        self.cancelled = Counter("kvstore_api_cancelled", "Replies cancelled because the client went away", registry=r)
        self.ttft = Histogram("kvstore_api_time_to_first_token_seconds", "Request received to first token",
                              buckets=_SECONDS, registry=r)
        self.duration = Histogram("kvstore_api_reply_seconds", "Request received to the reply's end",
                                  buckets=_SECONDS, registry=r)
        self.encode = Histogram("kvstore_api_prompt_encode_seconds", "Chat template and tokenizer, per prompt",
                                buckets=_SECONDS, registry=r)
        advice = Gauge("kvstore_api_advised_conversations", "Conversations the store was advised of, by why",
                       ["why"], registry=r)
        for why in ("goes_on", "ended", "idle"):
            advice.labels(why).set_function(lambda why=why: advised().get(why, 0))
        load = Gauge("kvstore_api_engine", "The engines' load at the scrape", ["what"], registry=r)
        for what in ("running", "waiting", "kv_tokens"):
            load.labels(what).set_function(lambda what=what: engine_load().get(what, 0))
        writes = Gauge("kvstore_api_store_writes", "Write-behind to the store: bytes pending, blocks by outcome",
                       ["what"], registry=r)
        for what in ("pending_bytes", "queued", "stored", "existed", "failed", "dropped"):
            writes.labels(what).set_function(lambda what=what: store_writes().get(what, 0))
