"""Expert-parallel load balancing: tokens per device before and after DeepSeek's plan, under drift, and on real ranks.

    python bench/eplb.py [--json]

Routing comes from `engine.experts.trace.SkewedRouting` (log-normal expert popularity, drifting; its docstring
cites the shape), since the tiny random models route almost evenly; the tiny model's own routing on real text is
reported beside it. Every figure is max/mean tokens per device per step and MoE layer: the median over steps and
layers, with the 10th and 90th percentiles.

1. The trace's fit: contiguous EP32, 256 experts, top 8, beside TensorRT-LLM's DeepSeek-R1 figure (2.56).
2. Simulated devices (4, 8, 16; 64 experts, top 8, 4 layers, one redundant slot per device; hierarchical with
   4 devices a node and 8 groups): plain expert parallelism; balanced (planned from the previous window of
   steps, static popularity); drifting popularity with the plan made once, and re-planned every --every steps.
   The plan's compute time.
3. Real gloo ranks (2 and 4 spawned processes; 16 experts, top 4, hidden 512, intermediate 1024, 2 MoE layers,
   one redundant slot per rank, 128 tokens a rank a step): contiguous, then rebalanced from the recorded window
   (the pause: loads' all-reduce + plan + weights moved), then drifting with a rebalance every --every steps;
   step time balanced against unbalanced at 4 ranks. These ranks share 2 cores, so a step's time is the busiest
   rank's compute plus the others' contending for the cores: a lower bound on what balance saves with a core each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.experts.dispatch import ExpertParallelMoE  # noqa: E402
from engine.experts.planner import Plan, contiguous_plan, imbalance, plan  # noqa: E402
from engine.experts.trace import SIGMA, SkewedRouting  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402

TRTLLM_EP32 = 2.56  # DeepSeek-R1 at EP32 without replicas: (max - mean)/mean = 1.56 (TensorRT-LLM, the trace's cite)
STEPS, WINDOW = 60, 20


def spread(values: list[float]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"median": statistics.median(ordered), "p10": pick(0.1), "p90": pick(0.9)}


def simulated(devices: int, every: int) -> dict:
    layers, experts, top_k, tokens = 4, 64, 8, 128 * devices
    slots, groups, nodes = experts + devices, 8, max(1, devices // 4)

    def run(drift: float, replan_every: int | None) -> tuple[list[float], list[float], list[float]]:
        routing = SkewedRouting(layers, experts, top_k, drift_steps=drift, seed=devices)
        history = [routing.counts(tokens) for _ in range(WINDOW)]  # the window the first plan sees
        planned = plan(torch.stack(history).sum(0), slots, groups, nodes, devices)
        plain_ratios, ratios, plan_s = [], [], []
        for step in range(STEPS):
            if replan_every and step and step % replan_every == 0:
                started = time.perf_counter()
                planned = plan(torch.stack(history[-WINDOW:]).sum(0), slots, groups, nodes, devices)
                plan_s.append(time.perf_counter() - started)
            counts = routing.counts(tokens)
            history.append(counts)
            plain_ratios += imbalance(contiguous_plan(layers, experts, devices).device_loads(counts)).tolist()
            ratios += imbalance(planned.device_loads(counts)).tolist()
        return plain_ratios, ratios, plan_s

    plain, balanced, _ = run(0.0, None)
    drift_plain, stale, _ = run(25.0, None)
    _, periodic, plan_s = run(25.0, every)
    return {"devices": devices, "experts": experts, "slots": slots, "before": spread(plain),
            "balanced": spread(balanced), "drift_before": spread(drift_plain), "drift_plan_once": spread(stale),
            "drift_rebalanced": spread(periodic), "plan_ms": spread([s * 1e3 for s in plan_s]),
            "balanced_over_before": statistics.median(balanced) / statistics.median(plain)}


REAL = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1024,
        "num_local_experts": 16, "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 4096}


def real_rank(rank: int, ranks: int, every: int) -> dict:
    config = ModelConfig.from_dict(REAL)
    layers, experts, hidden, inter = config.num_layers, config.num_experts, config.hidden_size, config.intermediate_size
    tokens = 128
    generator = torch.Generator().manual_seed(0)  # the same weights on every rank; each keeps its slots
    weights = {}
    for layer in range(layers):
        p = f"layers.{layer}.mlp.experts."
        weights[p + "gate_up_proj"] = torch.randn(experts, hidden, 2 * inter, generator=generator) / hidden**0.5
        weights[p + "gate_up_proj_bias"] = torch.zeros(experts, 2 * inter)
        weights[p + "down_proj"] = torch.randn(experts, inter, hidden, generator=generator) / inter**0.5
        weights[p + "down_proj_bias"] = torch.zeros(experts, hidden)
    slots = experts + ranks
    moe = ExpertParallelMoE(config, weights, _contiguous_with_spares(layers, experts, ranks), None)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))  # (tokens, hidden)

    def phase(routing: SkewedRouting, steps: int, replan_every: int = 0) -> dict:
        ratios, times, pauses, window = [], [], [], []
        for step in range(steps):
            chosen_all = routing.chosen(tokens * ranks)  # (layers, tokens * ranks, k): the same on every rank
            mine = chosen_all[:, rank * tokens : (rank + 1) * tokens]
            window.append(torch.stack([torch.bincount(c.reshape(-1), minlength=experts) for c in chosen_all]))
            gates = torch.full(mine.shape[1:], 1 / mine.shape[-1])
            dist.barrier()
            started = time.perf_counter()
            for layer in range(layers):
                moe.forward(layer, x, mine[layer], gates)
            dist.barrier()
            times.append(time.perf_counter() - started)
            per_rank = torch.stack([moe.tokens_per_rank(layer, mine[layer]) for layer in range(layers)])
            dist.all_reduce(per_rank)  # (layers, ranks): rows each rank computed this step
            ratios += imbalance(per_rank).tolist()
            if replan_every and (step + 1) % replan_every == 0:
                pauses.append(rebalance(torch.stack(window[-WINDOW:]).sum(0)))
        return {"ratio": spread(ratios), "step_ms": spread([t * 1e3 for t in times]),
                "pause_ms": spread([p * 1e3 for p in pauses]) if pauses else None, "window": window}

    def rebalance(load: torch.Tensor) -> float:
        dist.barrier()
        started = time.perf_counter()
        moe.move_to(plan(load, slots, 1, 1, ranks))  # every rank sees the same trace: the same load, the same plan
        return time.perf_counter() - started

    static = SkewedRouting(layers, experts, config.experts_per_token, seed=3)
    phase(static, 2)  # warm-up
    before = phase(static, 20)
    move_s = rebalance(torch.stack(before["window"]).sum(0))
    after = phase(static, 20)
    drifting = phase(SkewedRouting(layers, experts, config.experts_per_token, drift_steps=10.0, seed=4), 30, every)
    return {name: {k: v for k, v in result.items() if k != "window"}
            for name, result in (("before", before), ("balanced", after), ("drift_rebalanced", drifting))} | {
        "move_ms": move_s * 1e3}


def _contiguous_with_spares(layers: int, experts: int, ranks: int) -> Plan:
    """Plain expert parallelism in the slot layout with one spare slot a rank, the spare a second copy of the rank's
    first expert (its load split within the rank: no device's load changes)."""
    per = experts // ranks
    rows = [e for r in range(ranks) for e in list(range(r * per, (r + 1) * per)) + [r * per]]
    slot_expert = torch.tensor(rows).expand(layers, -1).clone()
    replicas = torch.ones(layers, experts, dtype=torch.int64)
    replicas[:, torch.arange(ranks) * per] = 2
    return Plan(slot_expert, replicas, ranks)


def tiny_model_routing() -> dict:
    """The DEMO-shaped random gpt-oss model's own routing of real text: max/mean over experts and over 4 devices."""
    import tempfile

    from engine.checkpoints.random_model import DEMO, write_random_model
    from engine.experts.stats import LoadStats
    from engine.model.decoder import Chunk, Decoder
    from engine.model.kv import PagePool, RequestKV
    from engine.text.real_text import docstring

    text = " ".join(docstring(name) for name in ("json.dumps", "os.path.join", "functools.lru_cache",
                                                  "itertools.groupby", "collections.Counter"))
    ids = [b % DEMO["vocab_size"] for b in text.encode()][:1024]  # bytes as token ids: the random model has no
    with tempfile.TemporaryDirectory() as folder:                 # tokenizer, so real text enters byte by byte
        write_random_model(folder, DEMO)
        model = Decoder.from_pretrained(folder, "float32")
    stats = LoadStats(model.config.num_layers, model.config.num_experts, 1)
    original = model._moe

    def counting(p: str, x: torch.Tensor) -> torch.Tensor:
        logits = model._linear(x, p + "mlp.router")
        stats.record(int(p.split(".")[1]), torch.topk(logits, model.config.experts_per_token, dim=-1).indices)
        return original(p, x)

    model._moe = counting  # type: ignore[method-assign]
    kv = RequestKV(model.config, PagePool(model.config, 8, 256, model.dtype, model.device))
    kv.reserve(len(ids))
    model.forward([Chunk(kv, torch.tensor(ids), 0)])
    load = stats.window_load()  # (layers, experts)
    per_expert = imbalance(load)
    return {"tokens": len(ids), "experts": model.config.num_experts,
            "expert_max_over_mean": spread(per_expert.tolist()),
            "device_max_over_mean_4": spread(imbalance(contiguous_plan(model.config.num_layers, 8, 4)
                                                       .device_loads(load)).tolist())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print every figure as JSON at the end")
    parser.add_argument("--every", type=int, default=10, help="steps between rebalances under drift")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from engine.experts.launch import run_ranks

    fit = SkewedRouting(8, 256, 8, seed=1).counts(4096)
    fit_ratio = float(imbalance(contiguous_plan(8, 256, 32).device_loads(fit)).mean())
    results: dict = {"trace": {"sigma": SIGMA, "ep32_before": fit_ratio, "trtllm_ep32": TRTLLM_EP32,
                               "ratio_to_trtllm": fit_ratio / TRTLLM_EP32}}
    print(f"trace: contiguous EP32 max/mean {fit_ratio:.2f}, TensorRT-LLM's DeepSeek-R1 {TRTLLM_EP32} "
          f"(x{fit_ratio / TRTLLM_EP32:.2f})")
    results["simulated"] = []
    for devices in (4, 8, 16):
        r = simulated(devices, args.every)
        results["simulated"].append(r)
        m = lambda key: f"{r[key]['median']:.2f} [{r[key]['p10']:.2f}, {r[key]['p90']:.2f}]"
        print(f"{devices:>2} devices: before {m('before')}  balanced {m('balanced')} (x{r['balanced_over_before']:.2f})"
              f"  drift: plain {m('drift_before')}, planned once {m('drift_plan_once')}, rebalanced every "
              f"{args.every} {m('drift_rebalanced')}  plan {r['plan_ms']['median']:.1f} ms")
    results["real"] = {}
    for ranks in (2, 4):
        per_rank = run_ranks(real_rank, ranks, args.every, timeout_s=300)
        r = per_rank[0]
        r["move_ms_max"] = max(p["move_ms"] for p in per_rank)
        results["real"][ranks] = r
        ratio = lambda key: (f"{r[key]['ratio']['median']:.2f} [{r[key]['ratio']['p10']:.2f}, "
                             f"{r[key]['ratio']['p90']:.2f}]")
        speed = r["balanced"]["step_ms"]["median"] / r["before"]["step_ms"]["median"]
        print(f"{ranks} gloo ranks: before {ratio('before')}  balanced {ratio('balanced')}  drift rebalanced every "
              f"{args.every} {ratio('drift_rebalanced')};  step {r['before']['step_ms']['median']:.1f} ms -> "
              f"{r['balanced']['step_ms']['median']:.1f} ms (x{speed:.2f});  weights moved in {r['move_ms_max']:.1f} ms"
              f", drift pauses {r['drift_rebalanced']['pause_ms']['median']:.1f} ms")
    results["tiny_model_real_text"] = tiny = tiny_model_routing()
    print(f"tiny model on real text ({tiny['tokens']} tokens): max/mean per expert "
          f"{tiny['expert_max_over_mean']['median']:.2f}, per device of 4 "
          f"{tiny['device_max_over_mean_4']['median']:.2f}")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
