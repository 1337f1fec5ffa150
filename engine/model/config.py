"""The model's configuration, read from a HuggingFace-style `config.json` and validated.

One dataclass covers the architectures the engine runs: Llama/Qwen3-style dense decoders (optional
per-head q/k RMSNorm) and gpt-oss-style hybrids (alternating sliding-window and full attention,
attention sinks, biased projections, a top-k MoE MLP with a clamped SwiGLU) and Gemma 3 (sliding and full
layers with their own RoPE bases, norms of the form x·(1 + w) around attention and MLP, a tanh-GELU MLP).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class _Family:
    """What transformers builds for one model_type beyond the common decoder, and the config fields it reads."""

    fields: frozenset[str]  # read beyond _COMMON_FIELDS: any other field must be metadata or a switched-off feature
    qk_norm: bool = False
    attention_sinks: bool = False
    moe: bool = False
    sliding: bool = True  # has sliding-window layers at all (transformers' Llama has none)
    fixed_biases: tuple[bool, bool] | None = None  # (q/k/v, o_proj) whatever the config says; None: attention_bias
    attention_bias_default: bool = False
    theta_default: float = 10_000.0
    window_switch: bool = False  # Qwen: sliding_window counts only with use_sliding_window, from max_window_layers on
    rope_per_layer_type: bool = False  # RoPE parameters keyed by layer type, read by the family's own function


_QWEN_WINDOW = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "hidden_act"})
_FAMILIES = {
    "llama": _Family(frozenset({"attention_bias", "mlp_bias", "layer_types", "hidden_act"}), sliding=False),
    "qwen2": _Family(_QWEN_WINDOW, fixed_biases=(True, False), window_switch=True),
    "qwen3": _Family(_QWEN_WINDOW | {"attention_bias"}, qk_norm=True, window_switch=True),
    "gpt_oss": _Family(frozenset({"attention_bias", "sliding_window", "layer_types", "hidden_act", "num_local_experts",
                                  "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"}),
                       attention_sinks=True, moe=True, attention_bias_default=True, theta_default=150_000.0),
    "gemma3_text": _Family(frozenset({"attention_bias", "sliding_window", "layer_types", "sliding_window_pattern",
                                      "_sliding_window_pattern", "query_pre_attn_scalar", "hidden_activation",
                                      "rope_local_base_freq", "final_logit_softcapping", "attn_logit_softcapping",
                                      "use_bidirectional_attention"}),
                           qk_norm=True, rope_per_layer_type=True),
}
_COMMON_FIELDS = frozenset({"model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
                            "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings"})
# Fields that change nothing the engine computes: provenance, storage dtype, tokens the tokenizer names,
# training-only and generation-only switches.
_METADATA = frozenset({"architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
                       "bos_token_id", "eos_token_id", "pad_token_id", "tokenizer_class", "use_cache",
                       "attention_dropout", "initializer_range", "pretraining_tp", "router_aux_loss_coef",
                       "output_router_logits", "output_attentions", "output_hidden_states", "return_dict"})
# Fields of features a family lacks, accepted only with the values that switch the feature off.
_SWITCHED_OFF = {"sliding_window": (None,), "use_sliding_window": (False, None), "attention_bias": (None,),
                 "mlp_bias": (False, None), "partial_rotary_factor": (1.0, None), "attn_logit_softcapping": (None,),
                 "final_logit_softcapping": (None,), "use_bidirectional_attention": (False, None)}
# rope_type -> (required, optional) parameters besides rope_type and rope_theta, as transformers reads them
_ROPE_PARAMETERS = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor"}, {"original_max_position_embeddings"}),
    "yarn": ({"factor"}, {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                          "mscale", "mscale_all_dim", "truncate"}),
}

# Gemma 3 fields whose other values the engine does not implement: field -> the value it implements
_GEMMA3_ONLY = {"final_logit_softcapping": None, "attn_logit_softcapping": None,
                "use_bidirectional_attention": False, "hidden_activation": "gelu_pytorch_tanh"}


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
    qkv_bias: bool = False  # q/k/v projections biased
    o_bias: bool = False  # o_proj biased (Qwen2 biases q/k/v only)
    mlp_bias: bool = False  # gate/up/down projections biased (Llama's mlp_bias)
    qk_norm: bool = False
    attention_sinks: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0  # 0: a dense SwiGLU MLP
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Gemma 3's departures from Llama; the defaults are Llama's
    rope_local_theta: float | None = None  # RoPE base of sliding layers; None: rope_theta, as full layers use
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power; None: head_dim's
    embedding_scale: float = 1.0  # token embeddings multiplied by it
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight)
    sandwich_norms: bool = False  # attention and MLP outputs normed too, and the MLP input by its own norm
    mlp_activation: str = "silu"  # of the gated MLP's gate: silu or gelu_pytorch_tanh

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
        if self.rope_scaling:
            checked_rope_scaling(self.rope_scaling)
        if self.mlp_activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"config: MLP activation {self.mlp_activation!r} is not supported "
                             "(silu and gelu_pytorch_tanh are)")

    @property
    def full_layers(self) -> list[int]:
        """Layers whose KV the block store persists, in order."""
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    @property
    def sliding_layers(self) -> list[int]:
        """Layers whose KV lives in a per-request window ring (and the host-memory SWA tier)."""
        return [i for i, kind in enumerate(self.layer_types) if kind == SLIDING]

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type not in _FAMILIES:
            raise ValueError(f"config: model_type {model_type!r} is not supported; "
                             f"choose one of {', '.join(sorted(_FAMILIES))}")
        family = _FAMILIES[model_type]
        _refuse_unimplemented(raw, model_type, family)
        layers = int(raw["num_hidden_layers"])
        heads = int(raw["num_attention_heads"])
        theta, rope = (family.theta_default, {}) if family.rope_per_layer_type else _rope(raw, family.theta_default)
        window = raw.get("sliding_window")
        if family.window_switch and not raw.get("use_sliding_window"):
            window = None  # as transformers' Qwen configs read it
        layer_types = raw.get("layer_types")
        if layer_types is None:  # as transformers defaults them
            if model_type == "gpt_oss" and window:  # alternating, starting sliding
                layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
            else:  # Qwen: sliding from layer max_window_layers on, where use_sliding_window holds
                first_sliding = int(raw.get("max_window_layers", 28)) if family.window_switch and window else layers
                layer_types = [SLIDING if i >= first_sliding else FULL for i in range(layers)]
        if SLIDING in layer_types and not family.sliding:
            raise ValueError(f"config: layer_types names sliding-window layers, which {model_type} does not have; "
                             "set the model_type of the architecture the checkpoint was saved from")
        if family.fixed_biases:
            qkv_bias, o_bias = family.fixed_biases
        else:
            attention_bias = raw.get("attention_bias")
            qkv_bias = o_bias = family.attention_bias_default if attention_bias is None else bool(attention_bias)
        fields = dict(
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
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias")),  # read by Llama alone; refused above where another family sets it
            qk_norm=family.qk_norm,
            attention_sinks=family.attention_sinks,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_experts=int(raw.get("num_local_experts", 0)) if family.moe else 0,
            experts_per_token=int(raw.get("num_experts_per_tok", 0)) if family.moe else 0,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        )
        if model_type == "gemma3_text":
            fields |= _gemma3_fields(raw, layers)
        return cls(**fields)

    @classmethod
    def from_file(cls, path: Path | str) -> ModelConfig:
        path = Path(path)
        refuse_gguf(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a model config is a JSON object, found {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise ValueError(f"{path}: missing {exc.args[0]!r}") from None


def checked_rope_scaling(params: dict, where: str = "rope_parameters") -> dict:
    """The scaling part of one flat RoPE parameter dict: {} for the plain RoPE, else `rope_type` and its parameters.

    A rope_type or parameter the engine does not implement is refused by name, never ignored."""
    params = {name: value for name, value in params.items() if name != "rope_theta"}
    if params.pop("partial_rotary_factor", None) not in (None, 1.0):
        raise ValueError(f"config: {where}.partial_rotary_factor is not supported (the engine rotates whole heads)")
    kind = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    if kind not in _ROPE_PARAMETERS:
        raise ValueError(f"config: {where} rope_type {kind!r} is not supported "
                         f"({', '.join(_ROPE_PARAMETERS)} are)")
    required, optional = _ROPE_PARAMETERS[kind]
    if missing := sorted(required - set(params)):
        raise ValueError(f"config: {where} of rope_type {kind!r} misses {', '.join(missing)}")
    if unknown := sorted(set(params) - required - optional):
        raise ValueError(f"config: {where} of rope_type {kind!r} has {', '.join(unknown)}, "
                         "which the engine does not implement")
    return {"rope_type": kind, **params} if kind != "default" else {}


def _rope(raw: dict, theta_default: float) -> tuple[float, dict]:
    """RoPE base and scaling from `rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta` (before)."""
    parameters, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    if parameters and scaling and {**parameters, **scaling} != parameters:
        raise ValueError("config: rope_parameters and rope_scaling disagree; keep one of them")
    params = {**parameters, **scaling}
    if "rope_theta" in params and raw.get("rope_theta") not in (None, params["rope_theta"]):
        raise ValueError(f"config: rope_theta {raw['rope_theta']} disagrees with rope_parameters' "
                         f"{params['rope_theta']}; keep one of them")
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or theta_default)
    return theta, checked_rope_scaling(params, "rope_parameters" if parameters else "rope_scaling")


def _refuse_unimplemented(raw: dict, model_type: str, family: _Family) -> None:
    """Every config field is read, harmless metadata, or a feature switched off; any other is refused by name."""
    unread = {name: value for name, value in raw.items()
              if name not in _COMMON_FIELDS | family.fields | _METADATA
              and not (name in _SWITCHED_OFF and any(value is off or value == off for off in _SWITCHED_OFF[name]))}
    if unread:
        shown = ", ".join(f"{name}={_short(value)}" for name, value in sorted(unread.items()))
        raise ValueError(f"config: {model_type} does not read {shown}, and the engine refuses what it would "
                         "ignore. If the checkpoint is of another architecture, set its model_type; "
                         "if the field is wrong, remove it")
    if "hidden_act" in family.fields and raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config: hidden_act {raw['hidden_act']!r} is not supported for {model_type} (silu is)")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def refuse_gguf(path: Path | str) -> None:
    """A clear error where a GGUF file (or a folder holding one and no safetensors) is given for a model folder."""
    path = Path(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not any(path.glob("*.safetensors")) else [path]
    for file in ggufs:
        try:
            with open(file, "rb") as f:
                magic = f.read(4)
        except OSError:
            continue
        if magic == b"GGUF" or file.suffix.lower() == ".gguf":
            raise ValueError(f"{file} is a GGUF file; the engine loads a folder of safetensors weights and "
                             "config.json. Convert it once with `python -m engine.checkpoints FILE.gguf` "
                             "and pass the converted folder")


def _gemma3_fields(raw: dict, layers: int) -> dict:
    """What Gemma 3 reads differently from Llama, with transformers' Gemma3TextConfig defaults; a value the
    engine does not implement is refused by its field's name."""
    for name, implemented in _GEMMA3_ONLY.items():
        value = raw.get(name, implemented)
        if value != implemented and not (name == "use_bidirectional_attention" and value is None):
            raise ValueError(f"config: {name} = {value!r} is not supported for gemma3_text "
                             f"(the engine implements {implemented!r})")
    params = raw.get("rope_parameters") or {}
    if params and not {"full_attention", "sliding_attention"} >= set(params):
        raise ValueError("config: gemma3_text's rope_parameters must be keyed by layer type "
                         "(full_attention, sliding_attention)")
    # transformers >= 5 writes one RoPE per layer type; the Hub's configs rope_scaling and rope_theta for full
    # layers and rope_local_base_freq for sliding ones, as transformers reads them
    full = {**(params.get("full_attention") or {}), **(raw.get("rope_scaling") or {})}
    local = dict(params.get("sliding_attention") or {})
    theta = float(full.get("rope_theta") or raw.get("rope_theta") or 1_000_000.0)
    local_theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10_000.0)
    if checked_rope_scaling(local, "rope_parameters.sliding_attention"):
        raise ValueError("config: rope_parameters.sliding_attention scales RoPE, which the engine does not "
                         "implement for sliding layers (Gemma 3's use the plain RoPE)")
    layer_types = raw.get("layer_types")
    if layer_types is None:  # as transformers defaults them: pattern-1 sliding layers, then a full one
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    window = raw.get("sliding_window", 4096)
    hidden = int(raw["hidden_size"])
    return dict(
        head_dim=int(raw.get("head_dim") or 256),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131_072)),
        rope_theta=theta,
        rope_scaling=checked_rope_scaling(full, "rope_scaling" if raw.get("rope_scaling") else
                                          "rope_parameters.full_attention"),
        rope_local_theta=local_theta,
        layer_types=tuple(layer_types),
        sliding_window=int(window) if window and SLIDING in layer_types else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        embedding_scale=hidden ** 0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation="gelu_pytorch_tanh",
    )
