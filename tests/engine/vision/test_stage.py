"""The vision stage: an image's encoder outputs come from the store, else the encoder process, else are
computed here; the record one engine or the encoder saves is read by every other engine of the tenant, and a
dead or refusing encoder is an encode here, never an error."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
import torch

from engine.vision.client import EncoderClient, encode_request
from engine.vision.images import DecodedImage, content_digest, id_digest
from engine.vision.presets import vision_config
from engine.vision.server import SERVICE
from engine.vision.stage import VisionStage
from engine.vision.tower import VisionTower
from kvstore.block import tenant_of
from kvstore.client import ClientConfig, KVClient
from kvstore.server.auth import new_token, token_entry
from tests.pki import make_pki

pytestmark = pytest.mark.integration
TEXT_HIDDEN = 32
TOWER = VisionTower.random(vision_config("tiny", TEXT_HIDDEN))


def _image(seed: int) -> DecodedImage:
    rgb = np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    return DecodedImage(content_digest(rgb), rgb)


def _expected(image: DecodedImage) -> torch.Tensor:
    return TOWER.encode(TOWER.pixel_values([image]))[0]


@contextmanager
def encoder_process(*args: str, stderr_path):
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "engine.vision.server", "--text-hidden", str(TEXT_HIDDEN),
                                    "--vision-preset", "tiny", "--exit-on-stdin-eof", *args],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("READY "), open(stderr_path).read()
        yield process, int(line.split()[1])
    finally:
        process.stdin.close()  # --exit-on-stdin-eof: it ends with us
        assert process.wait(30) == 0, open(stderr_path).read()
        assert "Traceback" not in open(stderr_path).read()


def test_an_image_encoded_once_is_read_from_the_store_by_any_engine_of_its_tenant(daemons):
    (daemon,) = daemons(1)
    photo = _image(1)
    with KVClient(ClientConfig(servers=(daemon.address,))) as client:
        first = VisionStage(TOWER, client)
        (rows,) = first.embeds([photo], salt="a")
        torch.testing.assert_close(rows, _expected(photo), rtol=0, atol=0)
        assert first.counts == {"inline": 1} and first.encode_seconds > 0
        assert client.write_behind.flush()
        other_engine = VisionStage(TOWER, client)
        (again,) = other_engine.embeds([photo], salt="a")
        assert other_engine.counts == {"store": 1}
        torch.testing.assert_close(again, rows, rtol=0, atol=0)
        other_tenant = VisionStage(TOWER, client)
        other_tenant.embeds([photo], salt="b")  # the record is tenant a's
        assert other_tenant.counts == {"inline": 1}
        other_weights = VisionStage(VisionTower.random(vision_config("tiny", TEXT_HIDDEN, seed=1)), client)
        other_weights.embeds([photo], salt="a")  # another encoder never reads this one's outputs
        assert other_weights.counts == {"inline": 1}


def test_the_encoder_process_encodes_saves_and_a_dead_one_is_an_encode_here(daemons, tmp_path):
    (daemon,) = daemons(1)
    photos = [_image(2), _image(3)]
    with KVClient(ClientConfig(servers=(daemon.address,))) as client:
        with encoder_process("--servers", daemon.address, stderr_path=tmp_path / "encoder.err") as (_, port):
            remote = EncoderClient(f"127.0.0.1:{port}")
            stage = VisionStage(TOWER, client, remote)
            rows = stage.embeds(photos, salt="a")
            assert stage.counts == {"encoder": 2}
            for got, photo in zip(rows, photos):
                torch.testing.assert_close(got, _expected(photo), rtol=1e-6, atol=1e-6)
        # the encoder has flushed its records and exited: another engine reads them, and a new image is
        # encoded here, the dead encoder costing one failed call
        reader = VisionStage(TOWER, client, remote)
        reader.embeds(photos, salt="a")
        assert reader.counts == {"store": 2}
        fresh = [_image(4), _image(5)]
        new_rows = reader.embeds(fresh, salt="a")
        assert reader.counts == {"store": 2, "encoder_failed": 1, "inline": 2}
        torch.testing.assert_close(new_rows[1], _expected(fresh[1]), rtol=0, atol=0)
        remote.close()


def test_the_encoder_keys_a_record_by_the_image_it_encoded_never_by_the_callers_digest(daemons, tmp_path):
    """A caller with an Encode token for a tenant must not store one image's outputs under another image's digest:
    every engine of the tenant would read them for that image, for as long as the record lives (a day)."""
    (daemon,) = daemons(1)
    victim, forged = _image(7), _image(8)
    named = DecodedImage(id_digest("screen-1"), forged.rgb, "screen-1")  # the caller's own name for an image
    with KVClient(ClientConfig(servers=(daemon.address,))) as client:
        with encoder_process("--servers", daemon.address, stderr_path=tmp_path / "encoder.err") as (_, port):
            with EncoderClient(f"127.0.0.1:{port}") as remote:
                for lie, what in [(DecodedImage(victim.digest, forged.rgb), "pixels"),  # the victim's digest
                                  (DecodedImage(named.digest, forged.rgb, "screen-2"), "id"),
                                  (DecodedImage(victim.digest, forged.rgb, "screen-1"), "id")]:
                    with pytest.raises(grpc.RpcError) as refused:
                        remote.encode(lie, tenant_of("a"))
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert f"is not the image's: its {what} give" in refused.value.details()
                stage = VisionStage(TOWER, client, remote)
                (rows,) = stage.embeds([named], salt="a")  # a named image is keyed by its name, as in the API
                assert stage.counts == {"encoder": 1}
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # field 2 carried the raw salt, once
                raw = encode_request(victim, tenant_of("a")).SerializeToString() + b"\x12\x01a"
                with pytest.raises(grpc.RpcError) as refused:
                    channel.unary_unary(f"/{SERVICE}/Encode")(raw, timeout=30)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "fields [2] are not in" in refused.value.details()
        # the encoder has flushed its records and exited: nothing of the forgery is under the victim's digest
        reader = VisionStage(TOWER, client)
        (victim_rows,) = reader.embeds([victim], salt="a")
        assert reader.counts == {"inline": 1}
        torch.testing.assert_close(victim_rows, _expected(victim), rtol=0, atol=0)
        (again,) = reader.embeds([named], salt="a")
        assert reader.counts == {"inline": 1, "store": 1}
        torch.testing.assert_close(again, rows, rtol=0, atol=0)


def test_the_encoder_takes_the_daemons_tokens_and_tls(daemons, tmp_path):
    pki = make_pki(tmp_path / "pki")
    writer, reader = new_token(), new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(token_entry("engine", writer, [tenant_of("a")], ["read", "write"])
                      + token_entry("router", reader, None, ["read"]))
    photo = _image(6)
    with encoder_process("--auth-tokens", str(tokens), "--tls-cert", str(pki.server_cert), "--tls-key",
                         str(pki.server_key), stderr_path=tmp_path / "encoder.err") as (_, port):
        address = f"127.0.0.1:{port}"
        with EncoderClient(address, token=writer, tls_ca=str(pki.ca)) as remote:
            torch.testing.assert_close(remote.encode(photo, tenant_of("a")), _expected(photo), rtol=1e-6, atol=1e-6)
            with pytest.raises(Exception, match="PERMISSION_DENIED"):
                remote.encode(photo, tenant_of("b"))  # outside the token's tenants
        for settings in ({"token": reader, "tls_ca": str(pki.ca)}, {"tls_ca": str(pki.ca)}, {"token": writer}):
            with EncoderClient(address, **settings) as refused:
                with pytest.raises(Exception, match="PERMISSION_DENIED|UNAUTHENTICATED|UNAVAILABLE"):
                    refused.encode(photo, tenant_of("a"))
                stage = VisionStage(TOWER, None, refused)  # a refusal is an encode here, never an error
                (rows,) = stage.embeds([photo], salt="a")
                assert stage.counts == {"encoder_failed": 1, "inline": 1}
                torch.testing.assert_close(rows, _expected(photo), rtol=0, atol=0)
