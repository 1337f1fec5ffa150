"""A daemon's Stats as structured samples: what the Stats RPC carries and `KVClient.server_stats` returns.

A `Sample` is one Prometheus sample as /metrics has it (histogram buckets left out): its name
(`kvstore_hits_total`, `kvstore_rpc_seconds_count`), its labels and its value. Label values are kept as
they are, whatever characters they hold, so nothing here parses a `name{label=value}` string.

    stats = client.server_stats()[address]
    stats.value("kvstore_hits_total", tier="dram")   # one tier's hits
    stats.value("kvstore_hits_total")                # every tier's
    stats.by("kvstore_misses_total", "cause")        # {cause: misses}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str] = field(default_factory=dict, hash=False)
    value: float = 0.0

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        """Named `name`, with at least `labels` (each with that value)."""
        return self.name == name and all(self.labels.get(k) == v for k, v in labels.items())

    def text(self) -> str:
        """The sample as /metrics writes it, `name{label="value",...}`: for people to read, not to parse."""
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{_escaped(v)}"' for k, v in self.labels.items()) + "}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "labels": dict(self.labels), "value": self.value}


class Stats:
    """One daemon's samples, or several daemons' added up (`Stats.sum`)."""

    __slots__ = ("samples",)

    def __init__(self, samples: Iterable[Sample] = ()) -> None:
        self.samples: tuple[Sample, ...] = tuple(samples)

    @classmethod
    def from_pb(cls, response: Any) -> Stats:
        """From a StatsResponse's `samples` (a daemon older than them sends none)."""
        return cls(Sample(s.name, dict(s.labels), s.value) for s in response.samples)

    @classmethod
    def sum(cls, many: Iterable[Stats]) -> Stats:
        """Samples of the same name and labels added up across `many` (counters and gauges alike)."""
        total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for stats in many:
            for s in stats.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                total[key] = total.get(key, 0.0) + s.value
        return cls(Sample(name, dict(labels), value) for (name, labels), value in total.items())

    def value(self, name: str, /, **labels: str) -> float:
        """The sum of the samples named `name` that carry `labels` (all of them if none given); 0 if none do."""
        return sum((s.value for s in self.samples if s.matches(name, labels)), 0.0)

    def by(self, name: str, label: str, /, **labels: str) -> dict[str, float]:
        """{value of `label`: sum} over the samples named `name` that carry `label` (and `labels`)."""
        out: dict[str, float] = {}
        for s in self.samples:
            if label in s.labels and s.matches(name, labels):
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.samples]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stats) and self.samples == other.samples

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Stats({len(self.samples)} samples)"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
