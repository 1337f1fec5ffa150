"""What vLLM's KV connector stores of a model's KV cache groups, and under which namespaces.

vLLM hands a connector its KV cache groups: one group of full-attention layers for a plain model; for a
sliding-window hybrid such as Gemma 3 under vLLM's hybrid KV-cache manager, one full-attention group and
one or more sliding-window groups whose blocks are freed once they leave the window (each group has
block ids of its own). With the hybrid manager off, every layer is one group, each layer's KV whole.

A prompt's KV goes to the store as two chains of blocks keyed by the same token ids:

* **full blocks**: every block of the prompt, the full-attention layers' pages (every layer's, with the
  hybrid manager off);
* **window blocks**: the sliding-window layers' pages, only for the last `window_blocks + 1` blocks of
  each prompt, what a later request resuming at the end of that prompt (or one block short of it, a
  repeated prompt, whose last token vLLM must compute) needs: the tokens its next token attends to.

A resumed prompt loads the full layers of every block it reuses and the window layers of the blocks its
window covers, which are exactly the blocks vLLM's sliding-window groups hold for a prefix of that length
(`SlidingWindowManager`: `cdiv(sliding_window - 1, block_size)` blocks before the boundary). So vLLM
computes only the suffix, from the same KV it would have computed itself.

The page's byte layout is part of the namespace: vLLM's CPU attention keeps a layer's block as
`[kv_heads, block_size, 2 * head_size]` (K rows then V rows per head), other backends as
`[2, block_size, kv_heads, head_size]`, which is also this project's prefill engine's page. Blocks of the
two never meet.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xxhash

from kvstore.block import KVLayout, Namespace
from kvstore.codec import RAW, check_codec, codec_named

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.float8_e4m3fn: "float8_e4m3fn", torch.int8: "int8"}
PAGE_NHD = "nhd"  # [2, block_size, kv_heads, head_size]: flash-attn style backends, this project's engine
PAGE_CPU = "cpu_attn"  # [kv_heads, block_size, 2 * head_size]: vLLM's CPU attention


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StoredGroups:
    """The layers the connector stores, in model order, with the KV cache group of each."""

    full_layers: tuple[str, ...]
    window_layers: tuple[str, ...]
    group_of: dict[str, int]  # layer name -> its KV cache group
    kv_heads: int
    head_size: int
    dtype: str
    block_tokens: int
    window_tokens: int  # the sliding window of the window layers; 0 without any
    page: str  # PAGE_NHD or PAGE_CPU

    @property
    def window_blocks(self) -> int:
        """Blocks before a boundary that hold the tokens the next token attends to in a window layer."""
        return cdiv(self.window_tokens - 1, self.block_tokens) if self.window_layers else 0

    @property
    def hybrid(self) -> bool:
        return bool(self.window_layers)

    def page_shape(self) -> tuple[int, ...]:
        """One layer's block, as the attention backend keeps it."""
        if self.page == PAGE_CPU:
            return (self.kv_heads, self.block_tokens, 2 * self.head_size)
        return (2, self.block_tokens, self.kv_heads, self.head_size)

    def layout(self, layers: int, codec: str = RAW) -> KVLayout:
        return KVLayout(layers, self.kv_heads, self.head_size, self.dtype, codec=codec)

    def check_codec(self, codec: str) -> str:
        """`codec`, if it can store these pages: a quantising codec groups keys by channel and values by token,
        which vLLM's CPU pages, K and V interleaved per head, do not lay out as it reads them."""
        check_codec(codec, self.dtype)
        if self.page == PAGE_CPU and not codec_named(codec).lossless:
            raise ValueError(f"the {codec} codec quantises pages of K then V, [2, block, heads, head_size]; vLLM's "
                             "CPU pages interleave them per head: use raw or zstd")
        return codec

    def window_range(self, end: int) -> range:
        """The blocks whose window layers are saved for a prompt of `end` full blocks: those a resume at
        `end` or `end - 1` blocks reads."""
        return range(max(0, end - self.window_blocks - 1), end) if self.hybrid else range(0)

    def best_resume(self, full_hit: int, local: int, window_present: Callable[[int, int], bool]) -> int:
        """The longest resume, in blocks, of at most `full_hit` and more than `local` (vLLM's own hit) whose
        window blocks past `local` are all stored (`window_present(begin, end)`); `local` if none."""
        if not self.hybrid:
            return max(full_hit, local)
        for end in range(full_hit, local, -1):
            if window_present(max(local, end - self.window_blocks), end):
                return end
        return local


def stored_groups(kv_cache_config: KVCacheConfig, page: str, layer_index: Callable[[str], int]) -> StoredGroups:
    """The stored layers of vLLM's KV cache groups, or ValueError naming what this connector cannot store
    exactly: attention that is not full or sliding-window (Mamba, chunked local, MLA, cross-attention), K
    and V of different head sizes, quantised KV, groups of different geometry, or no full-attention group."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    full: list[str] = []
    window: list[str] = []
    group_of: dict[str, int] = {}
    windows: set[int] = set()
    geometry: set[tuple] = set()
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if isinstance(spec, SlidingWindowSpec) and len(groups) > 1:
            window.extend(group.layer_names)
            windows.add(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec) and not spec.attention_chunk_size and (
                not spec.sliding_window or len(groups) == 1):
            full.extend(group.layer_names)  # one group with a window: the hybrid manager is off, KV kept whole
        else:
            raise ValueError(f"KVStoreConnector stores full-attention and sliding-window layers; group {index} "
                             f"is {kind} ({spec}), whose KV is not a function of the prompt's blocks in this "
                             f"layout")
        if getattr(spec, "head_size_v", spec.head_size) != spec.head_size or spec.dtype not in DTYPES \
                or str(getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")) != "NONE":
            raise ValueError(f"KVStoreConnector stores K and V of one head size and an unquantised dtype "
                             f"({sorted(DTYPES.values())}); group {index} is {spec}")
        geometry.add((spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype))
        group_of.update(dict.fromkeys(group.layer_names, index))
    if not full:
        raise ValueError("KVStoreConnector needs a full-attention layer to key the prompt's blocks; this model "
                         f"has none ({[type(g.kv_cache_spec).__name__ for g in groups]})")
    if len(geometry) != 1 or len(windows) > 1:
        raise ValueError(f"KVStoreConnector stores groups of one block size, head count, head size, dtype and "
                         f"window; got {sorted(geometry, key=str)} and windows {sorted(windows)}")
    ((block_tokens, kv_heads, head_size, dtype),) = geometry
    return StoredGroups(tuple(sorted(full, key=layer_index)), tuple(sorted(window, key=layer_index)), group_of,
                        kv_heads, head_size, DTYPES[dtype], block_tokens, next(iter(windows), 0), page)


@dataclass(frozen=True)
class Namespaces:
    """The two chains of one request: full blocks and window blocks (None without window layers)."""

    full: Namespace
    window: Namespace | None


def namespaces(groups: StoredGroups, model_id: str, tenant: str, cache_salt: str | None, rank: int,
               world: int, codec: str = RAW) -> Namespaces:
    """A request's namespaces. The operator's tenant is the namespace's salt (the block's owner, what a
    store token is scoped to); a request's `cache_salt` keys its blocks apart within that tenant, through
    the model identity, so a caller's salt can never name another deployment's tenant.

    The model identity (`qualified_identity`) is `model_id` alone where nothing qualifies it (the engine's own
    page layout, one rank, no caller salt: the chain this project's prefill engine keys too), else `model_id`
    and its qualifiers as structured data, never spliced into text: an operator's model_id is free text, and
    one that spelled a qualifier would otherwise name another deployment's namespace."""
    qualifiers: dict[str, object] = {}
    if groups.page != PAGE_NHD:
        qualifiers["page"] = groups.page
    if world > 1:  # a rank of TP=n holds 1/n of the heads: its own blocks
        qualifiers["tp"] = [rank, world]
    if cache_salt:
        qualifiers["cache_salt"] = xxhash.xxh3_128_hexdigest(cache_salt.encode())
    full = Namespace(qualified_identity(model_id, qualifiers), groups.layout(len(groups.full_layers), codec),
                     groups.block_tokens, tenant)
    window = None
    if groups.hybrid:
        window = Namespace(qualified_identity(model_id, {**qualifiers, "window": groups.window_tokens}),
                           groups.layout(len(groups.window_layers), codec), groups.block_tokens, tenant)
    return Namespaces(full, window)


def qualified_identity(model_id: str, qualifiers: dict[str, object]) -> str:
    """`model_id` where `qualifiers` is empty; else `model_id`, a NUL and the compact JSON (sorted keys) of the
    qualifiers. A model_id holds no NUL (ValueError), so the first NUL ends it and JSON keeps the qualifiers
    apart: two different (model_id, qualifiers) never give one identity."""
    if "\0" in model_id:
        raise ValueError("a model identity may not hold a NUL character: it separates the model_id from what "
                         "qualifies it")
    if not qualifiers:
        return model_id
    return model_id + "\0" + json.dumps(qualifiers, sort_keys=True, separators=(",", ":"))


def pages_of(block_ids: Sequence[Sequence[int]], groups: StoredGroups, layers: Sequence[str],
             begin: int, end: int) -> list[list[int]]:
    """Per layer of `layers`, its group's block ids of prompt blocks [begin, end); `block_ids[g][i]` is
    group g's block of prompt block i, relative to the transfer's first block."""
    return [list(block_ids[groups.group_of[name]][begin:end]) for name in layers]
