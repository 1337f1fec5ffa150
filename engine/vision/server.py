"""The vision encoder as a process of its own: proto/decode.proto's VisionEncoder service.

    python -m engine.vision.server --text-hidden 640 [--port 0] [--servers HOST:PORT,...] [--auth-tokens FILE]
                                   [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]] [--exit-on-stdin-eof]

It makes the tower (`engine.vision.tower`, seeded random weights: `--vision-seed`, `--vision-preset`), listens,
and once it serves prints exactly one line, `READY <port>`, on stdout. Each Encode runs the tower on the decoded
image a prefill engine sends, queues the outputs for the store as the image's encoder record (engine.vision.stage)
in the caller's tenant, and returns them. The record is keyed by the image's digest as this process computes it
from the pixels it encodes (engine.vision.images.image_digest, as the engine computes it), and a request whose
digest differs is refused: keyed by the caller's word, a caller could store any image's outputs under another
image's digest, for every engine of its tenant to read. Tokens and TLS are the decode instance's (engine/serving):
Encode needs the "write" verb and, from a token scoped to tenants, one of theirs. The request names the tenant
(tenant_of(salt)), never the salt: the tenant is all the record's namespace needs.
Shut down by SIGTERM, SIGINT or, with --exit-on-stdin-eof, the end of stdin; records queued are flushed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from google.protobuf.unknown_fields import UnknownFieldSet

from engine.serving.instance import add_port
from engine.serving.proto import pb
from engine.vision.images import DecodedImage, ImageError, image_digest
from engine.vision.presets import vision_config
from engine.vision.stage import ENCODER_CLASS, encoder_namespace, encoder_record
from engine.vision.tower import VisionTower
from kvstore.client.config import ClientConfig
from kvstore.server.auth import AuthConfigError, Authenticator
from kvstore.server.grpc_auth import TokenInterceptor, current_principal, method_verbs, server_credentials
from kvstore.settings import Command
from kvstore.stdin_watch import watch_stdin

log = logging.getLogger("engine.vision.server")

SERVICE = "kvstore.decode.v1.VisionEncoder"
MAX_MESSAGE_BYTES = 65 * 2**20  # an Encode request's largest: 3 x 16,777,216 pixels of RGB (48 MiB) and room
verb_of = method_verbs(SERVICE, {"Encode": "write"})
@dataclass(frozen=True)
class EncoderConfig:
    text_hidden: int  # the hidden size of the text model the encoder's outputs feed (640 for Gemma 3 270M)
    vision_preset: str = "small"  # the tower (engine/vision/presets.py): small (224 px, 49 tokens an image) or tiny
    vision_seed: int = 0  # the seed of its random weights: the prefill engines must use the same
    host: str = "127.0.0.1"  # the address to listen on
    port: int = 0  # the port to listen on; 0: a free one, printed on the READY line
    threads: int = 1  # torch threads
    # largest request received: an image's decoded RGB bytes and room (the API's max_image_pixels of 16,777,216
    # are 48 MiB); a larger image is encoded by the engine itself
    max_message_bytes: int = MAX_MESSAGE_BYTES
    exit_on_stdin_eof: bool = False  # shut down when stdin ends (a parent holding the pipe died)
    # The store's daemons (host:port,... or a target): outputs are saved as encoder records; none: not saved
    servers: tuple[str, ...] = ()
    auth_tokens: Path | None = None  # TOML token file, as the daemon's: Encode needs the write verb
    tls_cert: Path | None = None  # PEM certificate chain: the port speaks TLS only (with tls_key)
    tls_key: Path | None = None  # the PEM private key of tls_cert
    tls_client_ca: Path | None = None  # PEM CA bundle: clients must present a certificate it signed (mutual TLS)
    # the store client's bearer token, for secured daemons; $KVSTORE_TOKEN by default, which `ps` does not show
    store_token: str | None = field(default=None, repr=False)
    store_tls_ca: str | None = None  # PEM CA bundle that signed the daemons' certificates; $KVSTORE_TLS_CA by default

    def __post_init__(self) -> None:
        vision_config(self.vision_preset, self.text_hidden, self.vision_seed)  # a bad preset or size: ValueError
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("EncoderConfig: tls_cert and tls_key go together")


COMMAND = Command(EncoderConfig, "python -m engine.vision.server",
                  "The vision encoder stage: images' pixels in, encoder outputs out and into the store. Prints "
                  "`READY <port>` once serving.", "KVSTORE_ENCODER_")


class EncoderService:
    def __init__(self, tower: VisionTower, client) -> None:
        self.tower, self.client = tower, client
        self._lock = threading.Lock()  # one encode at a time: torch's own threads do the parallel work

    def encode(self, raw: bytes) -> bytes:
        """One Encode call, off the event loop; EncodeRefused for a request it refuses."""
        try:
            request = pb.EncodeRequest.FromString(raw)
        except Exception:
            raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT, "not an EncodeRequest") from None
        # a field this protocol lacks is refused, not ignored: a client that still sends the raw salt (field 2)
        # would otherwise encode for the tenant of no salt
        if unknown := sorted({f.field_number for f in UnknownFieldSet(request)}):
            raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"EncodeRequest: fields {unknown} are not in this encoder's protocol")
        shape = tuple(request.shape)
        if (len(shape) != 3 or shape[2] != 3 or min(shape) < 1 or len(request.rgb) != math.prod(shape)
                or len(request.digest) != 16 or len(request.tenant) != 16):
            raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                "expected a 16-byte digest, a 16-byte tenant and (height, width, 3) uint8 pixels, "
                                f"got shape {shape}, {len(request.rgb)} bytes, a {len(request.digest)}-byte digest, "
                                f"a {len(request.tenant)}-byte tenant")
        tenant = bytes(request.tenant)
        principal = current_principal()
        if principal is not None and principal.tenants is not None and tenant not in principal.tenants:
            raise EncodeRefused(grpc.StatusCode.PERMISSION_DENIED,
                                f"token {principal.name!r} may not reach this tenant")
        rgb = np.frombuffer(request.rgb, dtype=np.uint8).reshape(shape)  # read-only, over the request's bytes
        # The record is keyed by the digest of what is encoded here, computed as the engine computes it: a
        # digest taken on the caller's word would let a caller store any image's outputs under another's.
        try:
            digest = image_digest(rgb, request.image_id if request.HasField("image_id") else None)
        except ImageError as exc:
            raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT, f"EncodeRequest: {exc}") from None
        if digest != request.digest:
            raise EncodeRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"EncodeRequest: digest {bytes(request.digest).hex()} is not the image's: its "
                                f"{'id' if request.HasField('image_id') else 'pixels'} give {digest.hex()}")
        pixels = self.tower.pixel_values([DecodedImage(digest, rgb)])
        with self._lock:
            rows = self.tower.encode(pixels)[0].cpu()  # (tokens_per_image, text_hidden)
        data = rows.numpy().astype("<f4").tobytes()
        stored = False
        if self.client is not None:
            record = encoder_record(encoder_namespace(self.tower, tenant), digest)
            stored = self.client.save([(record, data)], 1, ENCODER_CLASS)
        return pb.EncodeReply(encoder=self.tower.identity, shape=list(rows.shape), embeds=data,
                              stored=stored).SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Encode": grpc.unary_unary_rpc_method_handler(self._encode_async, None, None)})

    async def _encode_async(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await asyncio.to_thread(self.encode, raw)  # the call's context (its principal) goes along
        except EncodeRefused as exc:
            await context.abort(exc.code, str(exc))
            raise  # abort raises; for the type checker


class EncodeRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def serve(config: EncoderConfig) -> int:
    try:
        authenticator = Authenticator.from_file(config.auth_tokens) if config.auth_tokens else None
        credentials = (server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
                       if config.tls_cert is not None and config.tls_key is not None else None)
    except (AuthConfigError, OSError) as exc:
        print(f"vision encoder: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(config.threads)
    tower = VisionTower.random(vision_config(config.vision_preset, config.text_hidden, config.vision_seed))
    client = None
    if config.servers:
        from kvstore.client import KVClient

        client = KVClient(ClientConfig(config.servers, token=config.store_token, tls_ca=config.store_tls_ca))
    interceptors = [TokenInterceptor(authenticator, verb_of)] if authenticator else []
    try:
        return asyncio.run(_serve(config, EncoderService(tower, client), interceptors, credentials))
    finally:
        if client is not None:
            client.write_behind.flush(5.0)
            client.close()


async def _serve(config: EncoderConfig, service: EncoderService, interceptors: list,
                 credentials: grpc.ServerCredentials | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_message_bytes),
                                      ("grpc.so_reuseport", 0)], interceptors=interceptors)
    server.add_generic_rpc_handlers([service.handler()])
    address = f"{config.host}:{config.port}"
    if (port := add_port(server, address, credentials)) == 0:
        print(f"vision encoder: cannot listen on {address}: is the port taken? Choose another with --port",
              file=sys.stderr, flush=True)
        return 2
    await server.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.exit_on_stdin_eof:
        watch_stdin(lambda: loop.call_soon_threadsafe(stop.set))
    print(f"READY {port}", flush=True)
    await stop.wait()
    await server.stop(2.0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    client = {name: os.environ[variable] for name in ("store_token", "store_tls_ca")
              if os.environ.get(variable := "KVSTORE_" + name.removeprefix("store_").upper())}
    config = COMMAND.parse(argv, os.environ, fallback=client)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
