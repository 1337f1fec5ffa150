"""The decode engine's one config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.experts.decoder import ExpertParallelConfig
from engine.prefill.config import BLOCK_TOKENS, KV_PAGES
from engine.speculative.calibration import Calibration


@dataclass(frozen=True)
class DecodeConfig:
    max_running: int = 64  # sequences one step feeds; more wait in the queue
    prefill_tokens_per_step: int = 2048  # prompt (or recompute) tokens one step feeds besides the decode tokens
    kv_pages: int = KV_PAGES  # pages of the engine's own pool: used only when given no pool or prefill engine
    block_tokens: int = BLOCK_TOKENS  # tokens per page of that own pool
    detokenize: Callable[[Sequence[int]], str] | None = None  # token ids -> text, for stop strings
    # a preempted sequence whose reply goes to the store saves its state there and resumes from it (False:
    # it recomputes prompt + reply, as a sequence of bare token ids always does)
    preempt_to_store: bool = True
    # while a step's forward runs, a worker thread does the next step's host work that does not wait for its
    # tokens (admission, KV pages for every sequence's next token); see DecodeEngine.idle_gaps_s
    overlap: bool = False
    # speculative decoding, for more tokens per forward with the same reply: each decoding sequence's n-gram
    # drafter proposes up to `gamma` tokens, the DSpark schedule picks how many of each to verify in the step's
    # one forward, and verification keeps the target's tokens (greedy) or distribution (sampling) exactly. On
    # by default: the n-gram drafter runs for every model (bench/speculative.py: faster than not speculating at
    # batch 1 to 32)
    speculative: bool = True
    gamma: int = 5  # drafts per sequence and step at most (the DSpark schedule's γ)
    # SPS(B), target forward steps per second at B tokens; None: measured at start-up and cached
    # (`engine.speculative.profile.load_or_measure`), then corrected by the engine's own timed forwards
    # (`ObservedSps`; give one here to share what it learned between engines); any other callable as it is
    sps: Callable[[int], float] | None = None
    calibration: Calibration | None = None  # per-position temperatures of the confidences; None: raw ones
    fixed_drafts: int | None = None  # verify min(this, proposed) drafts every step instead of the schedule
    #                                  (a baseline to compare DSpark with)
    # expert parallelism (a MoE model only): its experts spread over this many gloo ranks on this host, this
    # process rank 0 and the others spawned followers (engine/experts/serving.py); 1: one process, as any model
    expert_ranks: int = 1
    # with expert_ranks > 1: redundant slots, the load window and rebalance_every (steps between rebalances,
    # run after a step's forward; 0: never); None: ExpertParallelConfig's defaults
    experts: ExpertParallelConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_tokens_per_step", "kv_pages", "block_tokens", "expert_ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeConfig: {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"DecodeConfig: gamma must be an integer >= 1, got {self.gamma!r}")
        f = self.fixed_drafts
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 0):
            raise ValueError(f"DecodeConfig: fixed_drafts must be an integer >= 0 or None, got {f!r}")
        if self.sps is not None and not callable(self.sps):
            raise ValueError(f"DecodeConfig: sps must be a callable (B -> steps/s) or None, got {self.sps!r}")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise ValueError(f"DecodeConfig: calibration must be a Calibration or None, got {self.calibration!r}")
        if self.experts is not None and not isinstance(self.experts, ExpertParallelConfig):
            raise ValueError(f"DecodeConfig: experts must be an ExpertParallelConfig or None, got {self.experts!r}")
        if self.experts is not None and self.expert_ranks == 1:
            raise ValueError("DecodeConfig: experts configures expert parallelism, which needs expert_ranks > 1 "
                             "(1 runs the model in one process)")
        for name in ("preempt_to_store", "overlap", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecodeConfig: {name} must be True or False, got {getattr(self, name)!r}")
        if self.detokenize is not None and not callable(self.detokenize):
            raise ValueError("DecodeConfig: detokenize must be a callable (token ids -> text) or None, "
                             f"got {type(self.detokenize).__name__}")
