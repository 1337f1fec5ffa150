"""The model's configuration, read from a HuggingFace-style `config.json` and validated.

One dataclass covers the architectures the engine runs: Llama/Qwen3-style dense decoders (optional
per-head q/k RMSNorm) and gpt-oss-style hybrids (alternating sliding-window and full attention,
attention sinks, biased projections, a top-k MoE MLP with a clamped SwiGLU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FULL = "full_attention"
SLIDING = "sliding_attention"

_ARCHITECTURES = {
    # model_type: (q/k norm, attention sinks, MoE MLP)
    "llama": (False, False, False),
    "qwen2": (False, False, False),
    "qwen3": (True, False, False),
    "gpt_oss": (False, True, True),
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "yarn", "factor": ...} or empty
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # tokens a sliding layer sees: the current one and W-1 before it
    attention_bias: bool = False
    qk_norm: bool = False
    attention_sinks: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0  # 0: a dense SwiGLU MLP
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config: {self.num_heads} heads do not split into {self.num_kv_heads} KV groups")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"config: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        if bad := set(self.layer_types) - {FULL, SLIDING}:
            raise ValueError(f"config: unknown layer types {sorted(bad)}")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window >= 1):
            raise ValueError("config: sliding-window layers need sliding_window >= 1")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"config: experts_per_token must lie in 1..{self.num_experts}")
        if self.head_dim % 2:
            raise ValueError("config: RoPE needs an even head_dim")

    @property
    def full_layers(self) -> list[int]:
        """Layers whose KV the block store persists, in order."""
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    @property
    def sliding_layers(self) -> list[int]:
        """Layers whose KV lives in a per-request window ring (and the host-memory SWA tier)."""
        return [i for i, kind in enumerate(self.layer_types) if kind == SLIDING]

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type not in _ARCHITECTURES:
            raise ValueError(f"config: model_type {model_type!r} is not supported; "
                             f"choose one of {', '.join(sorted(_ARCHITECTURES))}")
        qk_norm, sinks, moe = _ARCHITECTURES[model_type]
        layers = int(raw["num_hidden_layers"])
        heads = int(raw["num_attention_heads"])
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10_000.0)))
        if rope.get("rope_type", rope.get("type", "default")) in ("default", None):
            rope = {}
        window = raw.get("sliding_window")
        layer_types = raw.get("layer_types")
        if layer_types is None:  # as transformers defaults them: gpt-oss alternates, starting sliding
            alternate = model_type == "gpt_oss" and window
            layer_types = [SLIDING if alternate and i % 2 == 0 else FULL for i in range(layers)]
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            layer_types=tuple(layer_types),
            sliding_window=int(window) if window and SLIDING in layer_types else None,
            attention_bias=bool(raw.get("attention_bias", model_type == "gpt_oss")),
            qk_norm=qk_norm,
            attention_sinks=sinks,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_experts=int(raw.get("num_local_experts", 0)) if moe else 0,
            experts_per_token=int(raw.get("num_experts_per_tok", 0)) if moe else 0,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        )

    @classmethod
    def from_file(cls, path: Path | str) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {path}: {exc}") from None
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise ValueError(f"{path}: missing {exc.args[0]!r}") from None
