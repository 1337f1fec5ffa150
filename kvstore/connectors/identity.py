"""Block identities for an engine's own cache keys (docs/design.md section 6, "Engine keys").

SGLang's, LMCache's and vLLM's tier interfaces pass the engine's key for a page or chunk (already a hash
chained over the prefix), never its tokens. The store still promises that a hit is what was stored for
that key, from that model and layout, for that tenant, or a miss. So an engine key becomes a one-block
chain of its own:

    namespace   model identity  "<engine>|<model>|<layout>|page=<tokens>|rank=<r>/<world>",
                layout (1 opaque layer of bytes), block_tokens = KEY_TOKENS, salt = the tenant
    tokens      the 128-bit xxh3 of the engine key, as KEY_TOKENS little-endian u32 words
    parent      the namespace digest (no predecessor: the engine's key already commits to the prefix)

Two engines, models, layouts, page sizes, tensor-parallel ranks or tenants name different namespaces, so
their keys never meet; the daemon checks each record's header against the key it was asked for, so a hit
is the bytes stored under exactly this identity. A leading run of keys is looked up as for any blocks.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvstore.block import Block, KVLayout, Namespace

KEY_TOKENS = 4  # the engine key's 128-bit digest as u32 words: the block's "tokens"
OPAQUE = KVLayout(num_layers=1, kv_heads=1, head_dim=1, dtype="int8")  # the engine's bytes, stored as they are


@dataclass(frozen=True)
class EngineIdentity:
    engine: str  # "lmcache", "sglang", "vllm"
    model: str
    layout: str  # the engine's description of one page's bytes: format, dtype, shape
    page_tokens: int
    rank: int = 0
    world: int = 1
    tenant: str = ""  # the namespace salt: tenants never share blocks
    namespace: Namespace = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.engine or not self.model or not self.layout:
            raise ValueError("EngineIdentity: engine, model and layout must be non-empty")
        if "|" in self.engine + self.model + self.layout:
            raise ValueError("EngineIdentity: '|' separates the identity's fields and cannot appear in them")
        if self.page_tokens < 1 or self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"EngineIdentity: page_tokens >= 1 and 0 <= rank < world, got page_tokens "
                             f"{self.page_tokens}, rank {self.rank} of {self.world}")
        namespace = Namespace(f"{self.engine}|{self.model}|{self.layout}|page={self.page_tokens}|"
                              f"rank={self.rank}/{self.world}", OPAQUE, KEY_TOKENS, self.tenant)
        object.__setattr__(self, "namespace", namespace)

    def block(self, key: str | bytes) -> Block:
        """The block that stands for the engine key `key`."""
        raw = key.encode() if isinstance(key, str) else bytes(key)
        digest = xxhash.xxh3_128_digest(raw)
        tokens = tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4))
        return self.namespace.blocks(tokens)[0]

    def blocks(self, keys) -> list[Block]:
        return [self.block(key) for key in keys]


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")  # the checkpoint formats engines load
# what a checkpoint digest starts from: it names the encoding (each file's name and length, then its bytes),
# apart from the one before it (the files' bytes run together)
CHECKPOINT_DIGEST = b"kvstore checkpoint v2\0"


def checkpoint_identity(folder: Path | str) -> str:
    """A model identity that names the checkpoint itself: the folder's name and a digest of its
    `config.json` and every byte of its weight files (WEIGHT_FILES). Two checkpoints served under one name
    or path (a fine-tune replacing a directory, another revision) get different identities, so never each
    other's KV.

    Each file enters the digest as its name and its length (length-prefixed) before its bytes, so the same
    bytes cut into other files, or under other names (another format, a config run on into a weight file), are
    another checkpoint. Reads every weight byte once (about 0.3 s a GB with xxh3); this project's engine and the
    connectors name a model this way, so a vLLM and an engine/prefill serving the same folder agree."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder} is not a model folder with a config.json; name the model's identity "
                         "explicitly (model_id) instead")
    weights = sorted({file for pattern in WEIGHT_FILES for file in folder.glob(pattern)})
    if not weights:
        raise ValueError(f"{folder} holds no weight file ({', '.join(WEIGHT_FILES)}): its config alone would name "
                         "two checkpoints alike; name the model's identity explicitly (model_id) instead")
    digest = xxhash.xxh3_128(CHECKPOINT_DIGEST)
    for file in [config, *weights]:
        name = file.name.encode()
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(struct.pack("<I", len(name)) + name + struct.pack("<Q", size))
            read = 0
            while chunk := f.read(16 * 2**20):
                digest.update(chunk)
                read += len(chunk)
        if read != size:  # the length hashed must be the bytes hashed, or two cuts could meet again
            raise ValueError(f"{file} changed while its digest was taken ({size} bytes, then {read}); "
                             "name the model once it is written")
    return f"{folder.resolve().name}@{digest.hexdigest()[:16]}"


def model_identity(model: str | None, model_id: object = None, where: str = "model_id") -> str:
    """A connector's model identity: `model_id` as the operator configured it (the promise that every engine
    using it serves the same weights), else `checkpoint_identity` of `model` where the engine names a local
    model folder; else ValueError naming the setting (`where`) to give. Never the engine's bare name: two
    checkpoints served under one name or path would share keys."""
    if model_id:
        if "\0" in str(model_id):  # it would end where the namespace's qualifiers begin (vllm_groups)
            raise ValueError(f"{where} may not hold a NUL character")
        return str(model_id)
    if model and Path(model).is_dir():
        return checkpoint_identity(model)
    raise ValueError(f"the model {model!r} is not a local folder whose weights name it; set {where}, the promise "
                     "that every engine using it serves the same weights")
