"""The vision stage a prefill engine calls: an image's encoder outputs from the store, else from the encoder
process, else encoded here. Never an error: a missing record is an encode, and a dead encoder one done here.

An encoder output is a record of the store of its own kind (`encoder_record`): a one-layer block of
`tokens_per_image` rows of the text model's width in float32, in a namespace named by the encoder's identity
(`VisionTower.identity` + ENCODER_SUFFIX) and the tenant, keyed by the image's placeholder identity ids
(kvstore.block.image_identity_ids) and kept in the `encoder` traffic class (its own TTL, a day by default).
So one image encoded once, by any prefill engine or by the encoder process, is read by every other engine of
the tenant, and a new encoder (other weights) never reads an old one's outputs.

    stage = VisionStage(tower, client, remote=EncoderClient("127.0.0.1:7100"))
    rows = stage.embeds([decoded], salt="tenant-a")      # [(tokens_per_image, text_hidden) float32]
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from engine.vision.images import DecodedImage
from engine.vision.tower import VisionTower
from kvstore.block import Block, KVLayout, Namespace, image_identity_ids, tenant_of
from kvstore.client import StoreClient

log = logging.getLogger("engine.vision.stage")

ENCODER_SUFFIX = "#encoder"
ENCODER_CLASS = "encoder"  # the store's traffic class of encoder records (kvstore/server/config.py)


def encoder_namespace(tower: VisionTower, tenant: bytes) -> Namespace:
    """The namespace of `tower`'s outputs in `tenant` (kvstore.block.tenant_of of its salt: the encoder process
    is sent the tenant, never the salt): one layer of (tokens_per_image, text_hidden) float32 a block."""
    c = tower.config
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=c.text_hidden, dtype="float32", kv_per_layer=1)
    return Namespace.of_tenant(tower.identity + ENCODER_SUFFIX, layout, c.tokens_per_image, tenant)


def encoder_record(space: Namespace, digest: bytes) -> Block:
    """The record of one image's encoder outputs: keyed by the image's digest in the encoder's namespace."""
    (block,) = space.blocks(image_identity_ids(digest, space.block_tokens))
    return block


class RemoteEncoder(Protocol):
    """An encoder process (engine.vision.client.EncoderClient): encodes and queues the record for the store, keyed
    by the digest it computes from the image it is sent (a different `image.digest` is refused)."""

    def encode(self, image: DecodedImage, tenant: bytes) -> torch.Tensor:
        """(tokens_per_image, text_hidden) float32 of `image`, its record queued in `tenant` (tenant_of(salt));
        raises on any failure."""
        ...


class VisionStage:
    def __init__(self, tower: VisionTower, client: StoreClient | None, remote: RemoteEncoder | None = None,
                 remote_retry_s: float = 5.0) -> None:
        """`client`: the store the records are read from and written to (None: encode every time); `remote`:
        the encoder process (None: encode here). After a failed call the remote is skipped for
        `remote_retry_s`, so that a dead encoder costs one failed call, not one per image."""
        self.tower, self.client, self.remote = tower, client, remote
        self.remote_retry_s = remote_retry_s
        # images by how their outputs came: "store", "encoder" (the process), "inline" (here); and
        # "encoder_failed": calls to the process that failed (each then encoded here)
        self.counts: Counter[str] = Counter()
        self.encode_seconds = 0.0  # spent encoding here
        self.remote_seconds = 0.0  # spent in calls to the encoder process
        self._remote_down_until = 0.0
        self._lock = threading.Lock()  # the counters: the API encodes on several threads
        self._tower_lock = threading.Lock()  # one encode at a time here: torch runs its own threads

    def resized(self, rgb: np.ndarray) -> np.ndarray:
        """The pixels as the tower takes them (`VisionTower.resized`): all that an image waiting for the engines
        needs to hold."""
        return self.tower.resized(rgb)

    @property
    def tokens_per_image(self) -> int:
        return self.tower.config.tokens_per_image

    def embeds(self, images: Sequence[DecodedImage], salt: str) -> list[torch.Tensor]:
        """Each image's encoder outputs, (tokens_per_image, text_hidden) float32: the store's record, else the
        encoder process's, else encoded here (and saved for the next time). After a failed call to the process,
        the rest of the images, and the calls of the next `remote_retry_s`, are encoded here."""
        tenant = tenant_of(salt)  # all that leaves this process of the salt (docs/design.md section 3)
        space = encoder_namespace(self.tower, tenant)
        out: list[torch.Tensor | None] = [self._stored(space, image.digest) for image in images]
        missing = [i for i, rows in enumerate(out) if rows is None]
        self._count("store", len(images) - len(missing))
        remote = self.remote if time.monotonic() >= self._remote_down_until else None
        for i in missing:  # the process is sent the decoded image: it resizes it and computes its digest itself
            rows = self._remote(remote, images[i], tenant) if remote is not None else None
            if rows is None:
                remote = None
                rows = self._inline(space, images[i])
            out[i] = rows
        return [rows for rows in out if rows is not None]

    def _stored(self, space: Namespace, digest: bytes) -> torch.Tensor | None:
        if self.client is None:
            return None
        try:
            found = self.client.get([encoder_record(space, digest)])
        except Exception as exc:  # a store that fails is a miss: the image is encoded
            log.debug("encoder record read failed: %s", exc)
            return None
        if not found:
            return None
        c = self.tower.config
        rows = np.frombuffer(found[0].payload, dtype="<f4")
        if rows.size != c.tokens_per_image * c.text_hidden:
            return None
        return torch.from_numpy(rows.copy()).view(c.tokens_per_image, c.text_hidden)

    def _remote(self, remote: RemoteEncoder, image: DecodedImage, tenant: bytes) -> torch.Tensor | None:
        started = time.perf_counter()
        try:
            rows = remote.encode(image, tenant)
        except Exception as exc:
            self._remote_down_until = time.monotonic() + self.remote_retry_s
            self._count("encoder_failed")
            log.warning("the vision encoder failed (%s): encoding here", exc)
            return None
        with self._lock:
            self.remote_seconds += time.perf_counter() - started
        self._count("encoder")
        return rows

    def _inline(self, space: Namespace, image: DecodedImage) -> torch.Tensor:
        started = time.perf_counter()
        pixels = self.tower.pixel_values([image])  # (1, 3, S, S)
        with self._tower_lock:
            rows = self.tower.encode(pixels)[0].cpu()  # (tokens_per_image, text_hidden)
        with self._lock:
            self.encode_seconds += time.perf_counter() - started
        self._count("inline")
        if self.client is not None:
            self.client.save([(encoder_record(space, image.digest), rows.numpy().astype("<f4").tobytes())], 1,
                             ENCODER_CLASS)
        return rows

    def _count(self, what: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.counts[what] += n
