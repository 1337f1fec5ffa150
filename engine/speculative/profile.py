"""SPS(B): target forward steps per second at B verified tokens, measured on this machine and cached.

The DSpark schedule (`engine.speculative.schedule`) trades expected accepted tokens against the cost
of verifying more positions. On a GPU a forward of 1 or 64 tokens costs about the same; on this CPU
every verified position also pays for the output head (262k entries for Gemma 3), so SPS falls steeply
with B. Hence measured, not assumed: at start-up a verification-shaped forward (chunks of up to γ + 1
tokens after a context, logits at every position as verification needs) is timed at a few B, best of a
few rounds over them, like the prefill's chunk cost fit (`engine.prefill.cost.measure`); a B timed slower than a
larger one is timed again.

The times are made non-decreasing in B (pool-adjacent-violators: more tokens never cost less, and a
noisy sample must not tell the scheduler otherwise), interpolated linearly, and extrapolated past the
last B along the last segment; SPS = 1 / seconds is then non-increasing.

Cached as JSON under $KVSTORE_PROFILE_CACHE (else ~/.cache/kvstore/profiles), one file per key: the
model's identity (its config and a fingerprint of its weights), the torch version and the machine (host,
CPU, threads, device), so a profile is reused only where it was measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV

FORMAT = 3  # of the cached file; bump when what is written or measured changes
CACHE_ENV = "KVSTORE_PROFILE_CACHE"
GRID = (1, 2, 4, 8, 16, 32, 64, 128, 192)  # B timed: one request alone up to 32 requests verifying 5 drafts each
PER_REQUEST = 6  # tokens per chunk: the last real token + γ = 5 drafts
CONTEXT = 128  # positions each chunk attends to before it
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class SpsProfile:
    tokens: tuple[int, ...]  # B, increasing
    seconds: tuple[float, ...]  # the fitted forward time at each B, non-decreasing

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("an SPS profile needs one time per B, at least one")
        if any(b >= c for b, c in zip(self.tokens, self.tokens[1:])) or self.tokens[0] < 1:
            raise ValueError(f"an SPS profile's B must increase from 1 or more, got {self.tokens}")
        if any(s <= 0 or not math.isfinite(s) for s in self.seconds) or \
                any(s > t for s, t in zip(self.seconds, self.seconds[1:])):
            raise ValueError(f"an SPS profile's times must be positive and non-decreasing, got {self.seconds}")

    @classmethod
    def fitted(cls, samples: Sequence[tuple[int, float]]) -> SpsProfile:
        """From timed (B, seconds) samples: averaged per B, then made non-decreasing (PAVA)."""
        by_b: dict[int, list[float]] = {}
        for b, s in samples:
            by_b.setdefault(int(b), []).append(float(s))
        tokens = sorted(by_b)
        blocks = [[sum(by_b[b]) / len(by_b[b]), 1, 1] for b in tokens]  # [mean, weight, points]
        merged: list[list[float]] = []
        for block in blocks:  # pool adjacent violators: merge while a block is below the one before
            merged.append(block)
            while len(merged) > 1 and merged[-2][0] > merged[-1][0]:
                last, before = merged.pop(), merged.pop()
                weight = before[1] + last[1]
                merged.append([(before[0] * before[1] + last[0] * last[1]) / weight, weight, before[2] + last[2]])
        seconds = [mean for mean, _, points in merged for _ in range(int(points))]
        return cls(tuple(tokens), tuple(seconds))

    def step_seconds(self, b: int) -> float:
        """The forward time at B tokens: linear between measured B, flat below the first, along the last
        segment past the last."""
        ts, ss = self.tokens, self.seconds
        if b <= ts[0]:
            return ss[0]
        for i in range(1, len(ts)):
            if b <= ts[i]:
                return ss[i - 1] + (ss[i] - ss[i - 1]) * (b - ts[i - 1]) / (ts[i] - ts[i - 1])
        slope = (ss[-1] - ss[-2]) / (ts[-1] - ts[-2]) if len(ts) > 1 else 0.0
        return ss[-1] + slope * (b - ts[-1])

    def sps(self, b: int) -> float:
        """Target forward steps per second at B tokens: the callable the schedule takes."""
        return 1.0 / self.step_seconds(b)

    __call__ = sps

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, data: dict) -> SpsProfile:
        return cls(tuple(int(b) for b in data["tokens"]), tuple(float(s) for s in data["seconds"]))


class ObservedSps:
    """SPS(B) as this engine's own forwards show it: the start-up profile, corrected per stretch of B.

    The profile times a bare verification-shaped forward after a short context; a serving step attends to
    longer ones and to whatever else the machine runs, and on one CPU here its forwards took 1.2-1.3x the
    profile, with a steeper rise in B (7 against 3 ms a token past B = 32). So every timed forward updates,
    for the stretch of the profile's grid its B falls in, an exponential average of observed / profiled
    seconds; a stretch not yet seen borrows the ratio of the nearest one seen. Choosing a dearer B than
    the profile says shows its real cost at once; a B the profile makes look dear is not tried (the
    scheduler errs towards fewer drafts)."""

    def __init__(self, profile: SpsProfile, weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"an average's weight must be in (0, 1], got {weight}")
        self.profile, self.weight = profile, weight
        self.ratios: dict[int, float] = {}  # stretch of the grid -> observed / profiled seconds

    def _stretch(self, b: int) -> int:
        """The index of the first profiled B at or past b (one past the last beyond it)."""
        tokens = self.profile.tokens
        return next((i for i, t in enumerate(tokens) if b <= t), len(tokens))

    def observe(self, b: int, seconds: float) -> None:
        """A forward of `b` tokens took `seconds`."""
        if b < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        stretch, ratio = self._stretch(b), seconds / self.profile.step_seconds(b)
        before = self.ratios.get(stretch)
        self.ratios[stretch] = ratio if before is None else before + self.weight * (ratio - before)

    def step_seconds(self, b: int) -> float:
        stretch = self._stretch(b)
        ratio = self.ratios.get(stretch)
        if ratio is None:
            nearest = min(self.ratios, key=lambda s: (abs(s - stretch), s), default=None)
            ratio = 1.0 if nearest is None else self.ratios[nearest]
        return self.profile.step_seconds(b) * ratio

    def sps(self, b: int) -> float:
        return 1.0 / self.step_seconds(b)

    __call__ = sps

    def __repr__(self) -> str:
        return f"ObservedSps({self.profile}, observed / profiled by stretch {self.ratios})"


def model_identity(model: Decoder) -> str:
    """A digest of the model's config and a fingerprint of its weights (names, shapes, dtypes, and a few
    values of each tensor): a different checkpoint of the same shapes gets its own profile."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    for name in sorted(model.w):
        tensor = model.w[name]
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def machine_identity(model: Decoder) -> dict:
    device = model.device
    identity = {"host": platform.node(), "arch": platform.machine(), "cpu": platform.processor(),
                "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        identity["device_name"] = torch.cuda.get_device_name(device)
    return identity


def cache_key(model: Decoder, grid: Sequence[int], per_request: int, context: int) -> dict:
    return {"format": FORMAT, "model": model_identity(model), "torch": torch.__version__,
            "machine": machine_identity(model), "dtype": str(model.dtype), "grid": list(grid),
            "per_request": per_request, "context": context}


def cache_dir(directory: Path | str | None = None) -> Path:
    """Where profiles live: `directory`, else $KVSTORE_PROFILE_CACHE, else ~/.cache/kvstore/profiles."""
    if directory is not None:
        return Path(directory).expanduser().absolute()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().absolute()
    return Path.home() / ".cache" / "kvstore" / "profiles"


def layout(b: int, per_request: int) -> list[int]:
    """B tokens as chunks of at most `per_request`, as even as can be: ceil(B / per_request) requests."""
    requests = -(-b // per_request)
    return [b // requests + (i < b % requests) for i in range(requests)]


def measure(model: Decoder, grid: Sequence[int] = GRID, per_request: int = PER_REQUEST, context: int = CONTEXT,
            repeats: int = 3, retimes: int = 2) -> SpsProfile:
    """Time a verification-shaped forward at each B of `grid`, best of `repeats` rounds over the grid
    (after one warm-up each).

    A B timed slower than a larger B is an outlier (more tokens never cost less): it is timed again, up to
    `retimes` more rounds of `repeats`, keeping the best, before the fit pools what still disagrees. On a
    shared machine one slow sample at B=1 would otherwise flatten the whole small-B end of the curve."""
    limit = model.config.max_position_embeddings
    context = max(0, min(context, limit - per_request))
    most = max(len(layout(b, per_request)) for b in grid)
    pages_each = -(-(context + per_request) // BLOCK_TOKENS)
    pool = PagePool(model.config, most * pages_each, BLOCK_TOKENS, model.dtype, model.device)
    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def timed(b: int) -> float:
        sizes = layout(b, per_request)
        kvs = [RequestKV(model.config, pool) for _ in sizes]
        try:
            for kv, n in zip(kvs, sizes):
                kv.reserve(context + n)
            chunks = [Chunk(kv, torch.zeros(n, dtype=torch.long), context) for kv, n in zip(kvs, sizes)]
            synchronize()
            began = time.perf_counter()
            model.forward(chunks, all_logits=True)  # verification scores every position
            synchronize()
            return time.perf_counter() - began
        finally:
            for kv in kvs:
                kv.release()

    def best_of_rounds(bs: Sequence[int]) -> dict[int, float]:
        """Best of `repeats` rounds, each timing every B once: a slow spell of a shared machine then costs
        one round of every B, not every sample of the B timed during it."""
        best = dict.fromkeys(bs, math.inf)
        for _ in range(repeats):
            for b in bs:
                best[b] = min(best[b], timed(b))
        return best

    for b in grid:  # a first run warms allocations and kernels up, untimed
        timed(b)
    times = best_of_rounds(grid)
    for _ in range(retimes):
        ordered = sorted(times)
        slow = [b for b, c in zip(ordered, ordered[1:]) if times[b] > times[c]]
        if not slow:
            break
        for b, again in best_of_rounds(slow).items():
            times[b] = min(times[b], again)
    return SpsProfile.fitted(sorted(times.items()))


def load_or_measure(model: Decoder, directory: Path | str | None = None, grid: Sequence[int] = GRID,
                    per_request: int = PER_REQUEST, context: int = CONTEXT,
                    repeats: int = 3) -> tuple[SpsProfile, bool]:
    """The cached profile for this model, torch and machine, else measured and cached; (profile, measured)."""
    key = cache_key(model, grid, per_request, context)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir(directory) / f"sps-{name}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return SpsProfile.from_dict(data["profile"]), False
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or stale: measured again and overwritten
    profile = measure(model, grid, per_request, context, repeats)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({"key": key, "profile": profile.to_dict()}, indent=2))
    temporary.replace(path)  # whole or absent, never half written
    return profile, True


def format_profile(profile: SpsProfile) -> str:
    """The profile as a table: B, forward ms, steps/s, and tokens/s were every position accepted."""
    lines = [f"{'B':>5} {'ms/step':>9} {'steps/s':>9} {'B*steps/s':>10}"]
    for b, s in zip(profile.tokens, profile.seconds):
        lines.append(f"{b:>5} {1e3 * s:>9.2f} {1 / s:>9.1f} {b / s:>10.0f}")
    return "\n".join(lines)


def report(profile: SpsProfile) -> None:
    print(format_profile(profile), flush=True)
