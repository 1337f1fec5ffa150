"""The API server's Prometheus metrics (GET /metrics), in a registry of its own.

Every count of requests, tokens and replies is the tenant's: labelled with the tenant of the request it is
counted in (`TENANT`, which the server sets from the API key), so that a tenant's scrape shows its own counts
and never another's (`exposition(tenant)`); the operator's scrape (`exposition(None)`) shows every tenant's.
The engines' load, the store's write-behind and the advice are the server's, shown to both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# The tenant a request is counted for: set by the server from the API key, in the request's own context (its
# task, and the tasks it starts, which copy it)
TENANT: ContextVar[str] = ContextVar("kvstore_api_tenant", default="")

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ApiMetrics:
    def __init__(self, engine_load: Callable[[], dict[str, int]], advised: Callable[[], dict[str, int]],
                 store_writes: Callable[[], dict[str, int]] = dict) -> None:
        """`engine_load`: the engines' running, waiting and KV tokens; `advised`: conversations the store was
        advised of, by why; `store_writes`: the write-behind queue's pending bytes and its blocks by outcome;
        all read at each scrape."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = _Tenants(Counter("kvstore_api_requests", "Requests answered, by API and HTTP status",
                                         ["tenant", "api", "status"], registry=r))
        self.prompt_tokens = _Tenants(Counter("kvstore_api_prompt_tokens", "Prompt tokens of finished replies",
                                              ["tenant"], registry=r))
        self.cached_tokens = _Tenants(Counter("kvstore_api_cached_prompt_tokens", "Prompt tokens the store held",
                                              ["tenant"], registry=r))
        # how each prompt's KV came (engine.prefill.request.PATHS) and, for a hybrid model's cached prompt,
        # where its sliding window came from: this process's window tier ("host") or the store ("store")
        self.prefill_paths = _Tenants(Counter("kvstore_api_prefill_paths", "Prompts by prefill path and window source",
                                              ["tenant", "path", "window"], registry=r))
        self.completion_tokens = _Tenants(Counter("kvstore_api_completion_tokens", "Tokens generated", ["tenant"],
                                                  registry=r))
        # speculative decoding: drafts verified, by whether they were accepted (each accepted one a token that
        # took no forward of its own): accepted / all is the acceptance rate
        self.drafts = _Tenants(Counter("kvstore_api_draft_tokens", "Draft tokens verified, by outcome",
                                       ["tenant", "outcome"], registry=r))
        self.finished = _Tenants(Counter("kvstore_api_replies", "Replies, by how they ended", ["tenant", "reason"],
                                         registry=r))
        self.cancelled = _Tenants(Counter("kvstore_api_cancelled", "Replies cancelled because the client went away",
                                          ["tenant"], registry=r))
        self.ttft = _Tenants(Histogram("kvstore_api_time_to_first_token_seconds", "Request received to first token",
                                       ["tenant"], buckets=_SECONDS, registry=r))
        self.duration = _Tenants(Histogram("kvstore_api_reply_seconds", "Request received to the reply's end",
                                           ["tenant"], buckets=_SECONDS, registry=r))
        self.encode = _Tenants(Histogram("kvstore_api_prompt_encode_seconds", "Chat template and tokenizer, per "
                                         "prompt", ["tenant"], buckets=_SECONDS, registry=r))
        advice = Gauge("kvstore_api_advised_conversations", "Conversations the store was advised of, by why",
                       ["why"], registry=r)
        for why in ("goes_on", "ended", "idle"):
            advice.labels(why).set_function(_reading(advised, why))
        load = Gauge("kvstore_api_engine", "The engines' load at the scrape", ["what"], registry=r)
        for what in ("running", "waiting", "kv_tokens"):
            load.labels(what).set_function(_reading(engine_load, what))
        writes = Gauge("kvstore_api_store_writes", "Write-behind to the store: bytes pending, blocks by outcome",
                       ["what"], registry=r)
        for what in ("pending_bytes", "queued", "stored", "existed", "failed", "dropped"):
            writes.labels(what).set_function(_reading(store_writes, what))

    def exposition(self, tenant: str | None) -> bytes:
        """The text format of a scrape: the tenant's own counts (without the tenant label) and the server's
        gauges; None: every tenant's counts, labelled."""
        return generate_latest(self.registry if tenant is None else _Scoped(self.registry, tenant))


def _reading(source: Callable[[], dict[str, int]], name: str) -> Callable[[], int]:
    """A gauge's callback: `name`'s count in what `source` reports at the scrape (0 when it names none)."""
    return lambda: source().get(name, 0)


class _Tenants:
    """A metric whose first label is the tenant, filled in from TENANT: `labels`, `inc` and `observe` take the
    metric's other labels, as on a metric without it."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric

    def labels(self, *values: str) -> Any:
        return self.metric.labels(TENANT.get(), *values)

    def inc(self, amount: float = 1) -> None:
        self.metric.labels(TENANT.get()).inc(amount)

    def observe(self, value: float) -> None:
        self.metric.labels(TENANT.get()).observe(value)


class _Scoped:
    """A registry's metrics as one tenant may see them: the gauges, and of each count its samples only."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry, self.tenant = registry, tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.type == "gauge":  # the server's: every count and histogram here is a tenant's
                yield family
                continue
            scoped = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                if sample.labels.get("tenant") == self.tenant:
                    labels = {k: v for k, v in sample.labels.items() if k != "tenant"}
                    scoped.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
            yield scoped
