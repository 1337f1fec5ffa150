"""A prefill engine's client of the vision encoder process (engine.vision.server): `encode` with a deadline,
over the same tokens and TLS settings as the store's client (kvstore.client.ClientConfig checks them)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import torch

from engine.serving.proto import pb
from engine.vision.images import DecodedImage
from engine.vision.server import MAX_MESSAGE_BYTES, SERVICE
from kvstore.client.config import ClientConfig
from kvstore.client.shard import open_channel


def encode_request(image: DecodedImage, tenant: bytes) -> pb.EncodeRequest:
    """What `EncoderClient.encode` sends: the decoded image and, where the caller named it, its id, from which the
    encoder computes the image's digest itself; the digest the engine has, which it checks; and the tenant
    (never its salt)."""
    rgb = np.ascontiguousarray(image.rgb, dtype=np.uint8)
    request = pb.EncodeRequest(digest=image.digest, tenant=tenant, shape=list(rgb.shape), rgb=rgb.tobytes())
    if image.caller_id is not None:
        request.image_id = image.caller_id
    return request


class EncoderClient:
    def __init__(self, address: str, *, token: str | None = None, tls_ca: str | None = None,
                 timeout_s: float = 10.0, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        """`max_message_bytes`: the largest request sent, an image's RGB bytes and room; the encoder's own
        --max-message-bytes must be as large."""
        self.address, self.timeout_s = address, timeout_s
        security = ClientConfig((address,), token=token, tls_ca=tls_ca, max_message_bytes=max_message_bytes)
        self._metadata = security.metadata
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"encoder-client-{address}", daemon=True)
        self._thread.start()

        async def open_call() -> Any:  # a channel belongs to the loop it is made on
            self._channel = open_channel(address, security)
            return self._channel.unary_unary(f"/{SERVICE}/Encode", pb.EncodeRequest.SerializeToString,
                                             pb.EncodeReply.FromString)

        self._encode = asyncio.run_coroutine_threadsafe(open_call(), self._loop).result()

    def encode(self, image: DecodedImage, tenant: bytes) -> torch.Tensor:
        """(tokens_per_image, text_hidden) float32 of one decoded image, its record the tenant's (`tenant`:
        kvstore.block.tenant_of of the salt, which is never sent); grpc.RpcError or TimeoutError on failure (the
        caller encodes it itself), INVALID_ARGUMENT among them where `image.digest` is not the one of its pixels
        (or of its caller_id)."""
        request = encode_request(image, tenant)

        async def call() -> Any:  # a call belongs to its channel's loop: made there
            return await self._encode(request, timeout=self.timeout_s, metadata=self._metadata)

        reply = asyncio.run_coroutine_threadsafe(call(), self._loop).result(self.timeout_s + 5)
        rows = np.frombuffer(reply.embeds, dtype="<f4")
        if len(reply.shape) != 2 or rows.size != reply.shape[0] * reply.shape[1]:
            raise ValueError(f"the encoder's reply has shape {tuple(reply.shape)} and {rows.size} values")
        return torch.from_numpy(rows.copy()).view(*reply.shape)

    def close(self) -> None:
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._channel.close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
