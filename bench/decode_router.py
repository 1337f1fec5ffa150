"""Placing decode requests on several instance processes: round-robin, least-requests, KV-aware, one run.

    python bench/decode_router.py [--instances 3] [--requests 200] [--speedup 8] [--json out.json] [--plot]

Instances: --instances `python -m engine.serving.instance` processes (engine.serving.processes), one torch thread
each, on a random-weight model shaped like a tiny Qwen3 (2 layers, hidden 64, 4 heads / 2 KV heads of 16,
vocab 512, context 8192), written to a temporary folder, each with a KV pool of --kv-pages (192) x
--block-tokens (64) = 12,288 tokens, so the trace's bursts fill it. They are started once; the three policies run
one after the other on the same instances, each beginning when the previous one has drained (every request
answered), after one warm-up request per instance.

Workload: the first --requests records of traces/conversation_trace.jsonl. Their lengths are the
trace's inputs divided by --scale (default 16: the mean input of ~14k tokens becomes ~900, the largest,
120k, ~7.5k, inside the model's context) and outputs by --output-scale (default 2: ~380 become ~190, so
that each instance decodes several requests at once), at least 1 token each; prompts are random
token ids (the same per request for every policy), replies greedy to exactly max_tokens (no stop token), so
every policy gets identical work. Arrivals replay at `timestamp / speedup` (timestamp in ms), measured
from the policy's start. The default x4 puts 200 requests into ~22 s, which keeps three instances on 2
cores busy (several thousand KV tokens each) without holding them at capacity; at x8 every instance sits
at its KV capacity with a queue, whatever the policy, and at x2 most arrivals find an idle instance, where
every policy places alike.

Routing: before placing each request the router asks every instance for its load (the Load RPC, all at
once; each answers at once from its state after its last step and the requests it has received since),
so it sees the requests placed a moment before as queued:
InstanceLoad.running = running + waiting, kv_tokens = KV held + the prompt tokens queued
(`engine.serving.client.to_instance_load`), kv_capacity = pages x block tokens; Router.place decides.

Measured per policy, while it runs, a sampler asks every instance's load every --poll-ms (50):
    router_kv_imbalance  the mean over time of max_i kv_i / mean_i kv_i, over the samples whose total KV (the
                         sum of the instances' kv_tokens: the KV their running sequences hold) is > 0, each
                         sample weighted by the time to the next one: 1 is perfectly even, N (instances) is
                         all KV on one instance
    kv_peak              the largest kv_i of any sample; kv_mean (over time) / kv_max per instance
    tpot p50 / p99       percentiles, over every output token after a request's first, of the gap to the
                         request's previous token (token_times_s differences): the time per output token
    ttft p50             the first token's time from the instance's submit (prompt processing + queueing)
    total_s              from the first arrival to the last reply
    placement_lag_max_s  how far the router fell behind the replayed arrival times (asking loads, sending)
All instances share the machine's cores, so a busy instance also slows the others a little; the figures
compare the policies with each other, not with a real deployment. `measure_routers` returns them all
(bench/decode.py may import it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from engine.checkpoints.random_model import write_random_model  # noqa: E402
from engine.decode.router import POLICIES, Router, RouterConfig  # noqa: E402
from engine.serving.client import to_instance_load  # noqa: E402
from engine.serving.messages import GenerateResult  # noqa: E402
from engine.serving.processes import Instances, start_instances  # noqa: E402
from kvstore.analytics.trace import CONVERSATION_TRACE  # noqa: E402

TRACE = CONVERSATION_TRACE
LENGTH_SCALE = 16  # trace input lengths / this: fits the tiny model's context and a few minutes of 2 CPU cores
# trace output lengths / this: replies long enough (~190 tokens) that each instance decodes several at once;
# at / 16 (~24 tokens) a request lived ~85 ms, under one running per instance, and the imbalance only said
# which instance held the current request (~2.2 for every policy)
OUTPUT_SCALE = 2
PLOT = Path(__file__).resolve().parents[1] / "docs" / "decode_router.png"  # --plot without a path
VOCAB = 512
MODEL = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
         "max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}


def load_trace(path: Path, count: int, scale: int = LENGTH_SCALE, output_scale: int = OUTPUT_SCALE) -> list[dict]:
    """The first `count` records as {"arrival_ms", "prompt_tokens", "max_tokens"}: input lengths / scale,
    output lengths / output_scale (each >= 1)."""
    records = []
    with open(path) as f:
        for line in f:
            if len(records) == count:
                break
            r = json.loads(line)
            records.append({"arrival_ms": float(r["timestamp"]),
                            "prompt_tokens": max(1, round(r["input_length"] / scale)),
                            "max_tokens": max(1, round(r["output_length"] / output_scale))})
    if not records:
        raise ValueError(f"no records in {path}")
    return records


def _prompt(index: int, length: int) -> list[int]:
    return np.random.default_rng(index).integers(0, VOCAB, length).tolist()


class Sampler(threading.Thread):
    """Every instance's kv_tokens every `period_s`, as (seconds since `t0`, [kv per instance])."""

    def __init__(self, instances: Instances, t0: float, period_s: float) -> None:
        super().__init__(name="kv-sampler", daemon=True)
        self.instances, self.t0, self.period_s = instances, t0, period_s
        self.samples: list[tuple[float, list[int]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            began = time.monotonic()
            loads = self.instances.loads()
            self.samples.append((began - self.t0, [load["kv_tokens"] for load in loads]))
            self._halt.wait(max(0.0, self.period_s - (time.monotonic() - began)))

    def stop(self) -> None:
        self._halt.set()
        self.join()


def kv_imbalance(samples: Sequence[tuple[float, Sequence[int]]], period_s: float) -> float:
    """router_kv_imbalance: the time-weighted mean of max_i kv_i / mean_i kv_i over the samples whose total
    KV is > 0; a sample stands for the time until the next one (the last: one period). NaN if none."""
    if not samples:
        return float("nan")
    t = np.array([s[0] for s in samples])
    kv = np.array([s[1] for s in samples], dtype=float)  # (samples, instances)
    weight = np.diff(t, append=t[-1] + period_s)
    busy = kv.sum(axis=1) > 0
    if not busy.any() or weight[busy].sum() <= 0:
        return float("nan")
    ratio = kv[busy].max(axis=1) / kv[busy].mean(axis=1)
    return float(np.average(ratio, weights=weight[busy]))


def _summarise(samples: list[tuple[float, list[int]]], period_s: float, replies: list[GenerateResult],
               placed: list[int], count: int, total_s: float, late_s: float) -> dict:
    kv = np.array([s[1] for s in samples], dtype=float).reshape(-1, count)  # (samples, instances)
    busy = kv[kv.sum(axis=1) > 0]
    imbalance = kv_imbalance(samples, period_s)
    weight = np.diff([s[0] for s in samples], append=samples[-1][0] + period_s) if samples else None
    gaps = np.array([b - a for r in replies for a, b in zip(r.token_times_s, r.token_times_s[1:])])
    first = np.array([r.token_times_s[0] for r in replies])
    pct = (lambda a, q: float(np.percentile(a, q)) * 1e3 if len(a) else float("nan"))
    return {
        "router_kv_imbalance": imbalance,
        "kv_peak": int(kv.max()) if kv.size else 0,
        "kv_mean_per_instance": [round(float(x), 1) for x in np.average(kv, axis=0, weights=weight)]
        if kv.size else [],
        "kv_max_per_instance": [int(x) for x in kv.max(axis=0)] if kv.size else [],
        "tpot_p50_ms": pct(gaps, 50), "tpot_p99_ms": pct(gaps, 99), "ttft_p50_ms": pct(first, 50),
        "total_s": total_s, "placement_lag_max_s": late_s,
        "requests_per_instance": [placed.count(i) for i in range(count)],
        "preemptions": sum(r.preemptions for r in replies), "samples": len(samples), "busy_samples": len(busy),
    }


def run_policy(instances: Instances, policy: str, records: Sequence[dict], speedup: float, poll_s: float,
               request_weight: float = 0.5, kv_weight: float = 0.5) -> tuple[dict, list[tuple[float, list[int]]]]:
    """Replay `records` through one policy; (its figures, its KV samples)."""
    router = Router(RouterConfig(policy=policy, request_weight=request_weight, kv_weight=kv_weight))
    futures: list[Future] = []
    placed: list[int] = []
    finished_at: list[float] = []
    t0 = time.monotonic()
    sampler = Sampler(instances, t0, poll_s)
    sampler.start()
    late = 0.0
    for index, record in enumerate(records):
        due = t0 + record["arrival_ms"] / 1000 / speedup
        if (wait := due - time.monotonic()) > 0:
            time.sleep(wait)
        late = max(late, time.monotonic() - due)  # how far placing fell behind the replayed arrivals
        loads = [to_instance_load(load) for load in instances.loads()]
        chosen = router.place(loads, record["prompt_tokens"])
        future = instances[chosen].client.generate(_prompt(index, record["prompt_tokens"]), record["max_tokens"])
        future.add_done_callback(lambda _: finished_at.append(time.monotonic()))
        futures.append(future)
        placed.append(chosen)
    replies = [f.result(timeout=600) for f in futures]
    sampler.stop()
    total = max(finished_at) - t0
    return _summarise(sampler.samples, poll_s, replies, placed, len(instances), total, late), sampler.samples


def measure_routers(requests: int = 200, instances: int = 3, speedup: float = 4.0, *, trace: Path = TRACE,
                    scale: int = LENGTH_SCALE, output_scale: int = OUTPUT_SCALE, repeats: int = 3,
                    poll_ms: float = 50.0, kv_pages: int = 192, block_tokens: int = 64,
                    max_running: int = 64, policies: Sequence[str] = POLICIES, request_weight: float = 0.5,
                    kv_weight: float = 0.5, model_dir: Path | None = None, plot: Path | None = None,
                    log: Any = print) -> dict:
    """Run every policy over the same replayed trace on the same instance processes, `repeats` times (the
    policies' order rotating); per policy the median of each figure (see the module docstring) over the
    repeats, with every run under "runs", and the setup under "setup"."""
    if min(requests, instances, scale, output_scale, repeats) < 1 or speedup <= 0 or poll_ms <= 0:
        raise ValueError("measure_routers: requests, instances, scale, output_scale, repeats >= 1; "
                         "speedup, poll_ms > 0")
    records = load_trace(trace, requests, scale, output_scale)
    capacity = kv_pages * block_tokens
    if (biggest := max(r["prompt_tokens"] + r["max_tokens"] for r in records)) > capacity:
        raise ValueError(f"a request needs {biggest} KV tokens; an instance holds {capacity}: raise kv_pages or scale")
    with tempfile.TemporaryDirectory(prefix="decode-router-") as tmp:
        if model_dir is None:
            model_dir = Path(tmp) / "model"
            write_random_model(model_dir, MODEL)
        began = time.monotonic()
        with start_instances(model_dir, instances, kv_pages=kv_pages, block_tokens=block_tokens,
                             max_running=max_running) as group:
            log(f"{instances} instances ready in {time.monotonic() - began:.1f} s")
            for instance in group:  # warm-up: the first forward's allocations land on no policy
                instance.client.generate(_prompt(10**6, 64), 4).result(60)
            runs: dict[str, list[dict]] = {policy: [] for policy in policies}
            series = {}
            for repeat in range(repeats):
                for policy in policies[repeat % len(policies):] + policies[: repeat % len(policies)]:
                    log(f"  repeat {repeat + 1}/{repeats} {policy}: {len(records)} requests over "
                        f"{records[-1]['arrival_ms'] / 1000 / speedup:.1f} s of replayed arrivals ...")
                    figures, series[policy] = run_policy(group, policy, records, speedup, poll_ms / 1000,
                                                         request_weight, kv_weight)
                    runs[policy].append(figures)
    results = {policy: _medians(policy_runs) for policy, policy_runs in runs.items()}
    if plot is not None:
        _plot(series, plot)
    setup = {"instances": instances, "requests": len(records), "speedup": speedup, "length_scale": scale,
             "output_scale": output_scale, "repeats": repeats,
             "poll_ms": poll_ms, "kv_capacity_per_instance": capacity, "block_tokens": block_tokens,
             "max_running": max_running, "request_weight": request_weight, "kv_weight": kv_weight,
             "model": MODEL, "trace": str(trace),
             "mean_prompt_tokens": float(np.mean([r["prompt_tokens"] for r in records])),
             "mean_max_tokens": float(np.mean([r["max_tokens"] for r in records]))}
    return {"setup": setup, **results}


def _medians(runs: list[dict]) -> dict:
    """Each scalar figure's median over the runs, with its [min, max] under "<name>_range"; all runs kept."""
    out: dict[str, Any] = {}
    for name, value in runs[0].items():
        if isinstance(value, (int, float)):
            values = [run[name] for run in runs]
            out[name] = float(np.median(values))
            out[f"{name}_range"] = [min(values), max(values)]
    out["runs"] = runs
    return out


def _plot(series: dict[str, list[tuple[float, list[int]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(9, 2.6 * len(series)), sharex=True, squeeze=False)
    for ax, (policy, samples) in zip(axes[:, 0], series.items()):
        t = [s[0] for s in samples]
        kv = np.array([s[1] for s in samples])
        for i in range(kv.shape[1] if kv.size else 0):
            ax.plot(t, kv[:, i], lw=0.9, label=f"instance {i}")
        ax.set_title(policy)
        ax.set_ylabel("KV tokens")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the policy's first arrival")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--speedup", type=float, default=4.0, help="arrivals replay at timestamp / speedup")
    parser.add_argument("--scale", type=int, default=LENGTH_SCALE, help="trace input lengths are divided by this")
    parser.add_argument("--output-scale", type=int, default=OUTPUT_SCALE,
                        help="trace output lengths are divided by this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--poll-ms", type=float, default=50.0)
    parser.add_argument("--kv-pages", type=int, default=192)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--request-weight", type=float, default=0.5)
    parser.add_argument("--kv-weight", type=float, default=0.5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", nargs="?", const=PLOT, type=Path,
                        help="KV per instance over time, per policy (default docs/decode_router.png)")
    args = parser.parse_args()
    try:
        figures = measure_routers(args.requests, args.instances, args.speedup, trace=args.trace, scale=args.scale,
                                  output_scale=args.output_scale, repeats=args.repeats, poll_ms=args.poll_ms,
                                  kv_pages=args.kv_pages, block_tokens=args.block_tokens,
                                  request_weight=args.request_weight, kv_weight=args.kv_weight, plot=args.plot)
    except ValueError as e:
        parser.error(str(e))
    s = figures["setup"]
    print(f"\n{s['instances']} instances, {s['requests']} trace requests (inputs / {s['length_scale']}, outputs / "
          f"{s['output_scale']}: mean prompt {s['mean_prompt_tokens']:.0f}, mean reply {s['mean_max_tokens']:.0f} "
          f"tokens), arrivals x{s['speedup']:g}, KV capacity {s['kv_capacity_per_instance']} tokens per instance; "
          f"medians (min..max) over {s['repeats']} repeats")
    print(f"{'policy':>15} {'kv imbalance':>19} {'kv peak':>8} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12} "
          f"{'TTFT p50 ms':>12} {'preempted':>9}  last run: requests / KV mean per instance")
    for policy in POLICIES:
        if policy in figures:
            f = figures[policy]
            low, high = f["router_kv_imbalance_range"]
            last = f["runs"][-1]
            print(f"{policy:>15} {f['router_kv_imbalance']:6.3f} ({low:.3f}..{high:.3f}) {f['kv_peak']:8.0f} "
                  f"{f['tpot_p50_ms']:12.2f} {f['tpot_p99_ms']:12.2f} {f['ttft_p50_ms']:12.1f} "
                  f"{f['preemptions']:9.0f}  "
                  f"{last['requests_per_instance']} / {last['kv_mean_per_instance']}")
    print("\n" + "   ".join(f"router_kv_imbalance[{p}] = {figures[p]['router_kv_imbalance']:.3f}"
                            for p in POLICIES if p in figures))
    if args.plot:
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
