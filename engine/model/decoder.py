"""The slim decoder: GQA with RoPE, RMSNorm, gated MLPs or MoE, full or sliding-window attention per layer.

Llama/Qwen-style, gpt-oss-style and Gemma 3 decoders; what sets them apart is read from the config
(`engine.model.config`): Gemma 3 scales its embeddings, norms with (1 + w) before and after attention and MLP,
gates with tanh-GELU and gives sliding layers a RoPE base of their own.

The forward pass runs one *step*: chunks of several requests at once, layer by layer. Token-wise work
(projections, norms, MLPs) runs over all the step's tokens together; attention runs per chunk against
that request's explicit KV (pages for full layers, the window ring for sliding ones); a step of one token
(or a few) per chunk attends through `engine.model.decode_attention`, built for single queries. `before_layer(l)`
is called before layer l reads any KV: where a load is streaming the cached prefix in, layer by layer,
the engine waits there, so copying layer l+1 overlaps computing layer l.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.config import SLIDING, ModelConfig
from engine.model.decode_attention import DecodeBatch, VerifyBatch
from engine.model.dtype import AUTO, resolve
from engine.model.kv import RequestKV
from engine.model.linear import Linear, fused, linear
from engine.model.moe import expert_forward
from engine.model.rope import Rope, apply_rope
from engine.model.weights import load_weights


@dataclass
class Chunk:
    """Tokens [start, start + len(tokens)) of one request, computed against its KV."""

    kv: RequestKV
    tokens: torch.Tensor  # (x,) int64
    start: int
    # rows fed in place of some tokens' embeddings, an image's encoder outputs at its placeholders:
    # (offset in the chunk, (n, hidden) float) each
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()


@dataclass
class _Projections:
    """One layer's matrix products, prepared (`engine.model.linear`): q, k and v as one, gate and up as one."""

    qkv: Linear
    qkv_widths: list[int]  # q, k, v output widths
    o: Linear
    gate_up: Linear | None  # None for a mixture of experts (`Decoder._moe` reads its weights itself)
    down: Linear | None


class Decoder:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        """`weights` by HuggingFace name without `model.` (`load_weights`), in the dtype the model computes in."""
        self.config = config
        self.w = weights
        first = weights["embed_tokens.weight"]
        self.dtype, self.device = first.dtype, first.device
        self.rope = Rope(config)
        # Gemma 3: sliding layers rotate with their own base and no scaling; full layers with rope_theta's
        self.local_rope = Rope(replace(config, rope_theta=config.rope_local_theta, rope_scaling={})) \
            if config.rope_local_theta is not None else self.rope
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        # rounded to fp32, then to the model's dtype, before multiplying: as transformers' Gemma 3 does
        self.embedding_scale = torch.tensor(config.embedding_scale).to(self.device, self.dtype)
        # position of each layer among the full or the sliding layers: its page tensor or its ring
        self._kv_index = {layer: i for group in (config.full_layers, config.sliding_layers)
                          for i, layer in enumerate(group)}
        self._sinks = any(name.endswith("self_attn.sinks") for name in weights)  # decode steps attend per chunk
        self._prepare()

    def _prepare(self) -> None:
        """The projections packed for the device's kernels and the norms' scales in fp32, once."""
        c, w = self.config, self.w
        # RMSNorm scales by (offset + w) in fp32, as transformers' Gemma 3 does: computed here instead of per call
        self.norms = {name: c.norm_offset + t.float() for name, t in w.items() if name.endswith("norm.weight")}
        self.projections = []
        for layer in range(c.num_layers):
            p = f"layers.{layer}."
            qkv, widths = fused([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"],
                                [w.get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            gate_up = down = None
            if not c.num_experts:
                gate_up, _ = fused([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]],
                                   [w.get(p + "mlp.gate_proj.bias"), w.get(p + "mlp.up_proj.bias")])
                down = linear(w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"))
            o = linear(w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
            self.projections.append(_Projections(qkv, widths, o, gate_up, down))
        head = w["embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]  # (vocab, hidden)
        self.head = linear(head)

    @classmethod
    def from_pretrained(cls, path: Path | str, dtype: torch.dtype | str = AUTO,
                        device: torch.device | str = "cpu") -> Decoder:
        """The model in `path` computing in `dtype` (`engine.model.dtype.resolve`: by default bf16 where the
        device computes it natively, else fp32)."""
        config = ModelConfig.from_file(path)
        return cls(config, load_weights(path, config, resolve(dtype, device), device))

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk], before_layer: Callable[[int], None] | None = None,
                all_logits: bool = False, logits_for: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Per chunk, the logits of its last token (vocab,), or of all its tokens (x, vocab), or with
        `logits_for` of its last logits_for[i] tokens (logits_for[i], vocab): a speculative step scores every
        position of a verification chunk and only the last of a prompt chunk beside it (the output head is
        most of a token's cost on a CPU)."""
        c = self.config
        if logits_for is not None:
            assert not all_logits and len(logits_for) == len(chunks)
            assert all(1 <= k <= len(chunk.tokens) for k, chunk in zip(logits_for, chunks))
        sizes = [len(chunk.tokens) for chunk in chunks]
        tokens = torch.cat([chunk.tokens for chunk in chunks]).to(self.device)  # (T,)
        positions = torch.cat([torch.arange(ch.start, ch.start + n) for ch, n in zip(chunks, sizes)]).to(self.device)
        full_rope = self.rope.cos_sin(positions, self.dtype)  # cos and sin, each (T, head_dim/2)
        local_rope = self.local_rope.cos_sin(positions, self.dtype) if self.local_rope is not self.rope else full_rope
        kvs, starts = [chunk.kv for chunk in chunks], [chunk.start for chunk in chunks]
        batch: DecodeBatch | VerifyBatch | None = None
        if not self._sinks and DecodeBatch.applies(kvs, sizes, starts):
            batch = DecodeBatch(kvs, starts, self.device)
        elif not self._sinks and VerifyBatch.applies(kvs, sizes, starts):  # speculative verification chunks
            batch = VerifyBatch(kvs, starts, sizes, self.device)
        h = self.w["embed_tokens.weight"][tokens]  # (T, hidden)
        if c.embedding_scale != 1.0:
            h = h * self.embedding_scale
        base = 0
        for chunk, n in zip(chunks, sizes):
            for offset, rows in chunk.embeds:  # as Gemma 3 does: the projector's outputs, not scaled
                h[base + offset : base + offset + len(rows)] = rows.to(self.device, self.dtype)
            base += n
        for layer in range(c.num_layers):
            if before_layer is not None:
                before_layer(layer)
            p = f"layers.{layer}."
            cos, sin = local_rope if c.layer_types[layer] == SLIDING else full_rope
            attended = self._attention(layer, p, self._norm(h, p + "input_layernorm.weight"), cos, sin, chunks, sizes,
                                       batch)
            if c.sandwich_norms:  # Gemma: each branch's output normed before it joins the residual stream
                h = h + self._norm(attended, p + "post_attention_layernorm.weight")
                mlp = self._mlp(layer, self._norm(h, p + "pre_feedforward_layernorm.weight"))
                h = h + self._norm(mlp, p + "post_feedforward_layernorm.weight")
            else:
                h = h + attended
                h = h + self._mlp(layer, self._norm(h, p + "post_attention_layernorm.weight"))
        for chunk, n in zip(chunks, sizes):
            chunk.kv.length = max(chunk.kv.length, chunk.start + n)
        ends = torch.tensor(sizes).cumsum(0).tolist()
        if logits_for is not None:  # rows [end - k, end) of each chunk, in order
            picked = h[[row for end, k in zip(ends, logits_for) for row in range(end - k, end)]]  # (Σk, hidden)
        else:
            picked = h if all_logits else h[[end - 1 for end in ends]]  # (T or chunks, hidden)
        logits = self.head(self._norm(picked, "norm.weight"))  # (T, chunks or Σk, vocab)
        if logits_for is not None:
            return list(torch.split(logits, list(logits_for)))
        if not all_logits:
            return list(logits)
        return list(torch.split(logits, sizes))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm over the last dimension, computed in fp32; Gemma's weight w scales by (1 + w)."""
        scale = self.norms[name]
        return F.rms_norm(x.float(), scale.shape, scale, self.config.rms_norm_eps).to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _attention(self, layer: int, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   chunks: Sequence[Chunk], sizes: list[int],
                   batch: DecodeBatch | VerifyBatch | None = None) -> torch.Tensor:
        c, projections = self.config, self.projections[layer]
        q, k, v = projections.qkv(x).split(projections.qkv_widths, dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)  # (T, heads, head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)  # (T, kv_heads, head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self._norm(q, p + "self_attn.q_norm.weight"), self._norm(k, p + "self_attn.k_norm.weight")
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sliding = c.layer_types[layer] == SLIDING
        index = self._kv_index[layer]
        if batch is not None:  # one token (or a few, verifying drafts) per chunk: the single-query path
            attend_all = batch.sliding if sliding else batch.full
            return projections.o(attend_all(index, q, k, v, self.scale))
        sinks = self.w.get(p + "self_attn.sinks")
        out, begin = [], 0
        for chunk, n in zip(chunks, sizes):
            qs, ks, vs = q[begin : begin + n], k[begin : begin + n], v[begin : begin + n]
            q_pos = torch.arange(chunk.start, chunk.start + n, device=q.device)
            if sliding:
                keys, values, k_pos = chunk.kv.sliding_kv(index, ks, vs, chunk.start)
            else:
                keys, values = chunk.kv.full_kv(index, ks, vs, chunk.start)
                k_pos = torch.arange(keys.shape[0], device=q.device)
            out.append(attend(qs, keys, values, q_pos, k_pos, c.sliding_window if sliding else None, sinks, self.scale))
            begin += n
        return projections.o(torch.cat(out))

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._moe(f"layers.{layer}.", x) if self.config.num_experts else self._gated(layer, x)

    def _gated(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)): SwiGLU with silu, Gemma's GeGLU with tanh-approximated GELU."""
        projections = self.projections[layer]
        assert projections.gate_up is not None and projections.down is not None
        gate, up = projections.gate_up(x).chunk(2, dim=-1)  # each (T, intermediate)
        act = F.silu(gate) if self.config.mlp_activation == "silu" else F.gelu(gate, approximate="tanh")
        return projections.down(act * up)

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """Top-k routed experts, softmax over the chosen logits; gpt-oss's clamped SwiGLU with (up + 1)."""
        c = self.config
        logits = self._linear(x, p + "mlp.router")  # (T, experts)
        top, chosen = torch.topk(logits, c.experts_per_token, dim=-1)  # (T, k)
        weights = torch.softmax(top, dim=-1)
        gate_up, gate_up_bias = self.w[p + "mlp.experts.gate_up_proj"], self.w[p + "mlp.experts.gate_up_proj_bias"]
        down, down_bias = self.w[p + "mlp.experts.down_proj"], self.w[p + "mlp.experts.down_proj_bias"]
        out = torch.zeros_like(x)  # (T, hidden)
        for expert in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == expert)
            computed = expert_forward(x[token], gate_up[expert], gate_up_bias[expert], down[expert],
                                      down_bias[expert], c)  # (n, hidden)
            out.index_add_(0, token, computed * weights[token, slot, None])
        return out


# Queries attended at once. The fused kernel computes every (query, key) pair it is given and masks after: a
# cold 2,000-token chunk of a sliding layer (W = 512) given whole computes 2,000 x 2,000 pairs where blocks of
# 256 queries need at most 2,000 x 768; a full layer's causal half is skipped the same way
QUERY_BLOCK = 256


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           window: int | None, sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal GQA attention of q (x, heads, d) over k, v (n, kv_heads, d); returns (x, heads * d).

    A query sees keys at positions <= its own, and with a window W only the W newest of those. Sinks
    (heads,) add one learned logit per head to the softmax's denominator, so a head can attend to nothing.
    """
    x, heads, d = q.shape
    if x > QUERY_BLOCK:  # a long chunk: each block of queries over only the keys it can see (they ascend in q_pos)
        blocks = []
        for begin in range(0, x, QUERY_BLOCK):
            rows = slice(begin, begin + QUERY_BLOCK)
            seen = k_pos <= q_pos[rows][-1]
            if window is not None:
                seen &= k_pos > q_pos[rows][0] - window
            blocks.append(attend(q[rows], k[seen], v[seen], q_pos[rows], k_pos[seen], window, sinks, scale))
        return torch.cat(blocks)
    kv_heads = k.shape[1]
    group = heads // kv_heads  # query head h reads KV head h // group
    allowed = k_pos[None, :] <= q_pos[:, None]  # (x, n)
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    if sinks is None:  # torch's fused kernel: no (x, n) score matrix per head in memory
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=allowed, scale=scale, enable_gqa=True)  # (1, heads, x, d)
        return out[0].transpose(0, 1).reshape(x, heads * d)
    qg = q.view(x, kv_heads, group, d).permute(1, 2, 0, 3)  # (kv_heads, group, x, d)
    scores = qg @ k.permute(1, 2, 0)[:, None] * scale  # (kv_heads, group, x, n)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.view(kv_heads, group, 1, 1).expand(-1, -1, x, 1).to(scores.dtype)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    out = probs @ v.permute(1, 0, 2)[:, None]  # (kv_heads, group, x, d)
    return out.permute(2, 0, 1, 3).reshape(x, heads * d)


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (..., vocab) -> (...), the first of equal ones, as `argmax` picks
    it: through `max`, which on this CPU takes a quarter of `argmax`'s time over bf16 rows (3.5 ms against 15 at
    32 rows of Gemma 3's 262,144), a decode step's largest cost after the forward."""
    return logits.max(dim=-1).indices
