"""Window records: a session's sliding-window state in the store, so that any engine resumes it exactly.

The host tier (`tier`) keeps a session's window only in the process that served its last turn. A window
record carries the same state through the store: the sliding layers' KV as of the end of a block of the
conversation's chain, saved write-behind beside the chain's blocks whenever the engine keeps a session's
latest state. An engine that restarted, or another instance, loads the prefix's blocks and this record and
resumes exactly, where it would otherwise replay (approximately) or recompute.

Identity: the record of block b of a chain (namespace N) lives in N's window namespace, N under the model
identity + WINDOW_SUFFIX; its parent is H(digest of that namespace ‖ b's key) and its tokens b's tokens.
So it commits to the whole prefix and the tenant (b's key does), it is never taken for a block of any
chain, nor for a continuation record (`engine.prefill.handoff`, a namespace of its own), and a replayed
chain's blocks (a namespace of their own) have records of their own. It is stored in the traffic class
WINDOW_CLASS, whose TTL is short (an hour by default, daemon config `classes`): it is worth keeping only
while the session is active.

Payload, one layer (read whole), in the KV's dtype:

    prelude (40 bytes, little-endian): magic b"KVW1", version u16 = 3, dtype code u16, position p u32,
                                       window_from u32, window positions w u32, session tag u64,
                                       n_sliding u32, kv_heads u32, head_dim u32
    sliding layers: (n_sliding, 2, w, kv_heads, head_dim)   positions p-w .. p-1, in order

where p is the block's end and w = min(W, p - window_from) (a window rebuilt by bounded replay holds
nothing before `window_from`; such a window is never saved for an exact chain, and never read as one).
The session tag (`session_tag`: a hash of the tenant and the session's name; 0 for none) tells an engine
that resumes from a record whether it is its own session's older state, which it deletes once it keeps a
newer one, or another session's state at a boundary they share (a system prompt's), which it leaves.
The dtype and the shape are written out, not inferred from the byte count: a window of another geometry
with as many bytes (two heads of 64 for one of 128) is a miss of cause "shape", never read as this one.
Versions 1 (no tag) and 2 (no shape) are read as misses of cause "format": records live an hour, so none
outlives an upgrade by long.

Version 4 is version 3 with the sliding layers encoded by the namespace's codec (kvstore/codec.py), as the
blocks are: after the prelude, the codec's code (u32), then per sliding layer its encoded (2, w, kv_heads ×
head_dim) values, each behind its length (u32). A namespace that stores raw KV writes version 3; a record
of the other version, or of another codec, is a miss of cause "codec".
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import xxhash

from engine.model.kv import WindowState
from kvstore.block import Block, Namespace, chain_hash
from kvstore.codec import RAW, CorruptLayer, LayerGeometry, codec_named

WINDOW_CLASS = "window"  # the traffic class of window records: a short TTL, useful while sessions are active
WINDOW_SUFFIX = "#window"  # the model identity suffix of the namespace window records are keyed in
# magic, version, dtype code, position, window_from, window positions, session, n_sliding, kv_heads, head_dim
_PRELUDE = struct.Struct("<4sHHIIIQIII")
_MAGIC, _VERSION, _ENCODED_VERSION = b"KVW1", 3, 4
_U32 = struct.Struct("<I")
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPE_CODES.items()}


class CorruptWindow(ValueError):
    """A window record that does not hold the window it was read for; `cause` names why, for counting."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def window_record(chain: Namespace, block: Block) -> Block:
    """The window record of the state as of the end of `block`, a block of `chain`."""
    space = chain.with_model_id(chain.model_id + WINDOW_SUFFIX)
    parent = xxhash.xxh3_128_digest(space.digest + block.key)
    return Block(space.digest, chain_hash(parent, block.tokens, chain.tenant), parent, block.tokens, chain.tenant)


def session_tag(session: str | None) -> int:
    """The tag of a session (its tenant-qualified name) in its records; 0 for requests of no session."""
    return (xxhash.xxh3_64_intdigest(session.encode()) or 1) if session is not None else 0  # never 0 for one


def window_positions(position: int, window_from: int, window: int) -> int:
    """How many positions a window as of `position` holds: the last W, none before `window_from`."""
    return min(window, position - window_from)


def ring_slots(position: int, positions: int, window: int, device: torch.device) -> torch.Tensor:
    """The ring slots of positions [position - positions, position), in position order."""
    return torch.arange(position - positions, position, device=device) % window


def encode(state: WindowState, session: int = 0, codec: str = RAW) -> bytes:
    """The payload of `state` (rings (n_sliding, 2, W, kv_heads, head_dim)), of the session tagged `session`,
    its layers encoded with `codec`. Tensor work: on the engine's thread; `recoded` does the encoding on any."""
    window = state.rings.shape[2]
    w = window_positions(state.position, state.window_from, window)
    ordered = state.rings[:, :, ring_slots(state.position, w, window, state.rings.device)]
    sliding, _, _, kv_heads, head_dim = state.rings.shape
    payload = _PRELUDE.pack(_MAGIC, _VERSION, _DTYPE_CODES[state.rings.dtype], state.position, state.window_from,
                            w, session, sliding, kv_heads, head_dim) + tensor_bytes(ordered)
    return recoded(payload, codec)


def recoded(payload: bytes, codec: str) -> bytes:
    """A version-3 payload (`encode`'s with the raw codec) with its sliding layers encoded by `codec`: version
    4 (the payload itself for raw). No tensor work: any thread."""
    if codec == RAW:
        return payload
    magic, _, dtype, position, window_from, w, session, sliding, kv_heads, head_dim = _PRELUDE.unpack_from(payload)
    encoder = codec_named(codec)
    geometry = LayerGeometry(2, w, kv_heads * head_dim, _DTYPE_NAMES[dtype])
    view = memoryview(payload)[_PRELUDE.size :]
    layers = [encoder.encode(view[i * geometry.raw_bytes : (i + 1) * geometry.raw_bytes], geometry) if w else b""
              for i in range(sliding)]
    prelude = _PRELUDE.pack(magic, _ENCODED_VERSION, dtype, position, window_from, w, session, sliding, kv_heads,
                            head_dim)
    return prelude + _U32.pack(encoder.code) + b"".join(_U32.pack(len(layer)) + layer for layer in layers)


def _decoded(view: memoryview, codec: str, sliding: int, w: int, like: torch.Tensor) -> bytearray:
    """A version-4 payload as version 3 would hold it: the prelude, then the raw sliding layers. CorruptWindow
    of cause "codec" where it is not `codec`'s encoding of such layers."""
    if len(view) < _PRELUDE.size + _U32.size or _U32.unpack_from(view, _PRELUDE.size)[0] != codec_named(codec).code:
        raise CorruptWindow("codec", f"a window record of another codec than this namespace's {codec}")
    geometry = LayerGeometry(2, w, math.prod(like.shape[3:]), str(like.dtype).removeprefix("torch."))
    out = bytearray(view[: _PRELUDE.size]) + bytearray(sliding * geometry.raw_bytes)
    at = _PRELUDE.size + _U32.size
    for layer in range(sliding):
        if at + _U32.size > len(view):
            raise CorruptWindow("codec", f"sliding layer {layer} is cut short")
        (length,) = _U32.unpack_from(view, at)
        at += _U32.size
        if w:
            start = _PRELUDE.size + layer * geometry.raw_bytes
            try:
                codec_named(codec).decode(view[at : at + length], geometry,
                                          memoryview(out)[start : start + geometry.raw_bytes])
            except CorruptLayer as exc:
                raise CorruptWindow("codec", f"sliding layer {layer}: {exc}") from None
        at += length
    if at != len(view):
        raise CorruptWindow("codec", f"{len(view) - at} bytes after the last sliding layer")
    return out


@dataclass(frozen=True)
class Checked:
    """A window record's payload found to hold the window it was read for (`check`), not yet turned into rings."""

    payload: bytes | bytearray | memoryview
    position: int
    window_from: int
    positions: int  # w
    session: int  # the session tag it was saved with

    def state(self, like: torch.Tensor) -> WindowState:
        """The window as rings shaped and typed `like` (the rings `check` was given). Tensor work: on the engine's
        own thread (torch ops on another thread bring an OpenMP team of their own, which spins against the
        engine's)."""
        view = memoryview(self.payload).cast("B")
        rings = torch.zeros_like(like, device="cpu")
        if self.positions:
            shape = (like.shape[0], 2, self.positions, *like.shape[3:])
            slots = ring_slots(self.position, self.positions, like.shape[2], rings.device)
            rings[:, :, slots] = view_tensor(view[_PRELUDE.size:], like.dtype, shape)
        return WindowState(self.position, rings, self.window_from)


def check(payload: bytes | bytearray | memoryview, position: int, like: torch.Tensor, exact: bool,
          codec: str = RAW) -> Checked:
    """Whether a payload holds the window as of `position`, for rings shaped and typed `like` (a request's
    rings; only their shape and dtype are read, so any thread may check), encoded with `codec` (decoded
    here). CorruptWindow where it is not that: another format, codec, position or shape, or a replayed window
    for an `exact` chain."""
    view = memoryview(payload).cast("B")
    if len(view) < _PRELUDE.size:
        raise CorruptWindow("format", f"{len(view)} bytes: shorter than the prelude")
    magic, version, dtype, at, window_from, w, session, *geometry = _PRELUDE.unpack_from(view)
    if magic != _MAGIC or version not in (_VERSION, _ENCODED_VERSION):
        raise CorruptWindow("format", f"magic {magic!r} version {version}: not a window record this engine reads")
    if (version == _ENCODED_VERSION) != (codec != RAW):
        raise CorruptWindow("codec", f"a window record of version {version} in a namespace of codec {codec}")
    if exact and window_from:
        raise CorruptWindow("replayed", f"a replayed window (from {window_from}) read for an exact chain")
    window = like.shape[2]
    if at != position or window_from > position or w != window_positions(position, window_from, window):
        raise CorruptWindow("position", f"record as of position {at} (window from {window_from}, {w} positions) "
                                        f"is not the window as of {position}")
    shape = (like.shape[0], 2, w, *like.shape[3:])
    if (dtype, tuple(geometry)) != (_DTYPE_CODES.get(like.dtype), (like.shape[0], *like.shape[3:])):
        raise CorruptWindow("shape", f"a window of {geometry} (sliding layers, KV heads, head size) in dtype code "
                                     f"{dtype} is not this model's {(like.shape[0], *like.shape[3:])} {like.dtype}")
    if version == _ENCODED_VERSION:
        payload = _decoded(view, codec, like.shape[0], w, like)
        view = memoryview(payload)
    if len(view) != _PRELUDE.size + math.prod(shape) * like.element_size():
        raise CorruptWindow("shape", f"{len(view)} bytes do not hold a {w}-position window of this model")
    return Checked(payload, position, window_from, w, session)


def decode(payload: bytes | bytearray | memoryview, position: int, like: torch.Tensor,
           exact: bool, codec: str = RAW) -> tuple[WindowState, int]:
    """The window as of `position` a payload holds, as rings shaped and typed `like` (a request's rings), and
    the session tag it was saved with; CorruptWindow as `check` raises it."""
    checked = check(payload, position, like, exact, codec)
    return checked.state(like), checked.session


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes() if tensor.numel() else b""


def view_tensor(view: memoryview, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device | str = "cpu",
                ) -> torch.Tensor:
    """A copy of `view`'s bytes as a tensor of `dtype` and `shape` on `device`."""
    return torch.frombuffer(bytearray(view), dtype=torch.uint8).view(dtype).reshape(shape).to(device)
