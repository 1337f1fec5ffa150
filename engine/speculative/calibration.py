"""Calibrating draft confidences as DSpark does: one temperature per draft position, fitted on prefix survival.

A raw confidence c_k in (0, 1) is tempered in logit space, ĉ_k = σ(logit(c_k) / T_k). What the scheduler
uses is the prefix survival a_j = ĉ_1 · … · ĉ_j, the predicted probability that drafts 1..j are all
accepted; so T_k is fitted to make a_k calibrated against "the first k drafts were accepted", left to
right: T_1 on a_1, then T_2 on a_2 with T_1 fixed, and so on. Each fit minimises the expected calibration
error over a fixed log-spaced grid of temperatures (ECE is piecewise constant in T, so a gradient finds
nothing; the grid is deterministic); among temperatures whose ECE is within sampling noise of the least,
the lowest Brier score wins (see `fit`: ECE alone is minimised by a useless constant).

Data: one `Record` per verified request step: the raw confidences of the drafts that were verified, and
how many of them were accepted (a prefix). A position beyond the verified ones has no label and is left out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = 1  # of the JSON file; bump when what is written changes
BINS = 15  # equal-width ECE bins, the common choice
GRID = np.exp(np.linspace(np.log(0.02), np.log(50.0), 241))  # candidate temperatures
EPS = 1e-6  # confidences are clipped to [EPS, 1 - EPS] before the logit


@dataclass(frozen=True)
class Record:
    confidences: tuple[float, ...]  # raw confidence of each verified draft, positions 1..len
    accepted: int  # drafts accepted: 0..len(confidences)

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= len(self.confidences):
            raise ValueError(f"a record accepts 0..{len(self.confidences)} drafts, got {self.accepted}")


def temper(confidence: np.ndarray, temperature: float) -> np.ndarray:
    """σ(logit(c) / T), elementwise; T > 1 pulls towards 1/2, T < 1 pushes away from it."""
    c = np.clip(np.asarray(confidence, dtype=float), EPS, 1 - EPS)
    return 1.0 / (1.0 + np.exp(-np.log(c / (1 - c)) / temperature))


def ece(confidence: np.ndarray, label: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error: Σ_bins (n_bin / n) · |mean confidence − mean label|, equal-width bins."""
    confidence, label = np.asarray(confidence, dtype=float), np.asarray(label, dtype=float)
    if confidence.size == 0:
        return 0.0
    which = np.minimum((confidence * bins).astype(int), bins - 1)  # (n,) bin of each
    total = 0.0
    for b in np.unique(which):
        inside = which == b
        total += inside.sum() * abs(confidence[inside].mean() - label[inside].mean())
    return float(total / confidence.size)


def auroc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counted half
    (Mann-Whitney U over average ranks). NaN where one class is absent."""
    score, label = np.asarray(score, dtype=float), np.asarray(label).astype(bool)
    positives, negatives = int(label.sum()), int((~label).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    ranks = np.empty(score.size)
    sorted_scores = score[order]
    i = 0
    while i < score.size:  # average rank over each run of equal scores
        j = i
        while j + 1 < score.size and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[label].sum() - positives * (positives + 1) / 2
    return float(u / (positives * negatives))


def _position_data(records: Sequence[Record], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For records verifying at least k drafts: raw confidences (n, k) of drafts 1..k, and label (n,)
    "drafts 1..k all accepted", and the indices of those records."""
    chosen = [i for i, r in enumerate(records) if len(r.confidences) >= k]
    raw = np.array([records[i].confidences[:k] for i in chosen], dtype=float).reshape(len(chosen), k)
    label = np.array([records[i].accepted >= k for i in chosen], dtype=float)
    return raw, label, np.array(chosen, dtype=int)


@dataclass(frozen=True)
class Calibration:
    temperatures: tuple[float, ...]  # T_k for positions 1..len; positions beyond use the last

    def calibrated(self, confidences: Sequence[float]) -> list[float]:
        """ĉ_k for each position of one request's drafts."""
        if not confidences:
            return []
        if not self.temperatures:
            return [float(c) for c in confidences]
        temps = [self.temperatures[min(k, len(self.temperatures) - 1)] for k in range(len(confidences))]
        return [float(temper(np.array(c), t)) for c, t in zip(confidences, temps)]

    def survivals(self, confidences: Sequence[float]) -> list[float]:
        """a_j = Π_{k ≤ j} ĉ_k: the predicted probability that drafts 1..j are all accepted."""
        return np.cumprod(self.calibrated(confidences)).tolist() if confidences else []

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "temperatures": list(self.temperatures)})

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"a calibration of format {data.get('format')!r}, this code reads {FORMAT}")
        temperatures = tuple(float(t) for t in data["temperatures"])
        if not all(t > 0 and np.isfinite(t) for t in temperatures):
            raise ValueError(f"calibration temperatures must be finite and positive, got {temperatures}")
        return cls(temperatures)

    def save(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_text(self.to_json())
        temporary.replace(path)  # whole or absent, never half written

    @classmethod
    def load(cls, path: Path | str) -> Calibration:
        return cls.from_json(Path(path).read_text())


def ece_noise(samples: int, bins: int = BINS) -> float:
    """A bound on the ECE's sampling noise at `samples` points: a bin of n_b labels has a mean off by about
    0.5 / sqrt(n_b) at most, and Σ_b (n_b / n) · 0.5 / sqrt(n_b) ≤ 0.5 · sqrt(bins / n) (Cauchy-Schwarz)."""
    return 0.5 * (bins / max(samples, 1)) ** 0.5


def fit(records: Sequence[Record], positions: int, tolerance: float | None = None) -> Calibration:
    """T_1..T_positions, left to right, each minimising the ECE of a_k given the ones before it. A position
    with no labelled record keeps T = 1 (the raw confidence).

    ECE alone has a degenerate minimum: a huge T maps every confidence to about the base rate, which is
    calibrated and useless (on 63 real drafts it chose T = 28, collapsing a_1 to 0.48 for every request, so
    the scheduler could tell no request from another). So among the temperatures whose ECE is within
    `tolerance` of the least (default: `ece_noise`, the ECE differences sampling alone makes), the one with
    the lowest Brier score wins: Brier, a proper score, also rewards telling accepted from rejected."""
    temperatures: list[float] = []
    for k in range(1, positions + 1):
        raw, label, _ = _position_data(records, k)
        if label.size == 0:
            temperatures.append(1.0)
            continue
        before = np.prod([temper(raw[:, i], temperatures[i]) for i in range(k - 1)], axis=0) \
            if k > 1 else np.ones(label.size)  # (n,) a_{k-1}, from the temperatures already fitted
        scores = []  # (ece, brier, T) per candidate temperature
        for t in GRID:
            survival = before * temper(raw[:, k - 1], float(t))
            scores.append((ece(survival, label), float(np.mean((survival - label) ** 2)), float(t)))
        slack = ece_noise(label.size) if tolerance is None else tolerance
        least = min(e for e, _, _ in scores)
        temperatures.append(min((b, t) for e, b, t in scores if e <= least + slack)[1])
    return Calibration(tuple(temperatures))


@dataclass(frozen=True)
class PositionReport:
    position: int  # k, from 1
    samples: int  # records verifying at least k drafts
    accept_rate: float  # of those, the share with drafts 1..k all accepted
    ece: float  # of the prefix survival a_k
    auroc: float  # of a_k against "1..k accepted"; NaN where one class is absent


def report(calibration: Calibration, records: Sequence[Record], positions: int) -> list[PositionReport]:
    """Per-position ECE and AUROC of the prefix survival under `calibration` (Calibration(()) for raw)."""
    rows = []
    for k in range(1, positions + 1):
        raw, label, _ = _position_data(records, k)
        survival = np.array([calibration.survivals(list(row))[-1] for row in raw]) if label.size else np.array([])
        rows.append(PositionReport(k, int(label.size), float(label.mean()) if label.size else float("nan"),
                                   ece(survival, label), auroc(survival, label)))
    return rows
