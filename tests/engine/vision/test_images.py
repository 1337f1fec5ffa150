"""Decoding, hashing and refusing images: every image is made here with Pillow and numpy."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image

from engine.vision.images import (
    DECODE_BYTES_PER_PIXEL,
    MEDIA_TYPES,
    DecodeBudget,
    ImageBusy,
    ImageError,
    ImageLimits,
    content_digest,
    decode_data_url,
    decode_image,
    image_digest,
)

LIMITS = ImageLimits()


def _pixels(height: int = 24, width: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _encode(image: Image.Image | np.ndarray, fmt: str, **options: object) -> bytes:
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int) -> bytes:
    """A PNG of a header only (and an empty IDAT): it claims width x height RGB pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _refused(match: str, call: Callable[..., object], *args: object, **kwargs: object) -> str:
    with pytest.raises(ImageError, match=match) as error:
        call(*args, **kwargs)
    message = str(error.value)
    assert "Traceback" not in message and "\n" not in message
    return message


def test_the_digest_is_of_pixels_and_shape() -> None:
    rgb = _pixels()
    expected = hashlib.blake2b(b"rgb8\0" + struct.pack("<II", 24, 40) + rgb.tobytes(), digest_size=16).digest()
    assert content_digest(rgb) == expected
    image = decode_image(_encode(rgb, "PNG"), "image/png", LIMITS)
    assert image.digest == expected and len(image.digest) == 16
    assert image.rgb.dtype == np.uint8 and image.rgb.shape == (24, 40, 3) and np.array_equal(image.rgb, rgb)
    assert not image.rgb.flags.writeable
    # the same bytes, another shape: another digest
    assert content_digest(rgb.reshape(40, 24, 3)) != expected


def test_png_and_lossless_webp_of_the_same_pixels_hash_the_same() -> None:
    rgb = _pixels()
    png = decode_image(_encode(rgb, "PNG"), "image/png", LIMITS)
    webp = decode_image(_encode(rgb, "WEBP", lossless=True, quality=100), "image/webp", LIMITS)
    assert np.array_equal(webp.rgb, rgb)
    assert webp.digest == png.digest
    # the media type may be left out: whatever the bytes are
    assert decode_image(_encode(rgb, "WEBP", lossless=True), None, LIMITS).digest == png.digest


def test_jpeg_is_other_pixels_but_a_png_of_them_hashes_the_same() -> None:
    rgb = _pixels()
    jpeg = decode_image(_encode(rgb, "JPEG", quality=90), "image/jpeg", LIMITS)
    assert jpeg.digest != content_digest(rgb)  # lossy
    again = decode_image(_encode(np.array(jpeg.rgb), "PNG"), "image/png", LIMITS)
    assert again.digest == jpeg.digest


def test_a_caller_id_names_the_image_whatever_its_pixels() -> None:
    expected = hashlib.blake2b(b"id\0" + b"photo-1", digest_size=16).digest()
    a = decode_image(_encode(_pixels(seed=1), "PNG"), "image/png", LIMITS, caller_id="photo-1")
    b = decode_data_url(_data_url(_encode(_pixels(seed=2), "PNG")), LIMITS, caller_id="photo-1")
    assert a.digest == b.digest == expected
    assert not np.array_equal(a.rgb, b.rgb)
    # the image keeps its id, from which the encoder process computes the same digest (it keys records by it)
    assert a.caller_id == "photo-1" and image_digest(a.rgb, a.caller_id) == expected
    plain = decode_image(_encode(_pixels(seed=1), "PNG"), "image/png", LIMITS)
    assert plain.caller_id is None and image_digest(plain.rgb) == plain.digest == content_digest(plain.rgb)
    png = _encode(_pixels(), "PNG")
    _refused("id must be a non-empty string", decode_image, png, "image/png", LIMITS, caller_id="")
    _refused("over the limit of 256", decode_image, png, "image/png", LIMITS, caller_id="x" * 257)


def test_a_data_url_decodes_like_its_bytes() -> None:
    rgb = _pixels()
    for fmt, media_type in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif")):
        data = _encode(rgb, fmt)
        assert decode_data_url(_data_url(data, media_type), LIMITS).digest == \
            decode_image(data, media_type, LIMITS).digest
    assert decode_data_url("DATA:image/png;base64," + base64.b64encode(_encode(rgb, "PNG")).decode(),
                           LIMITS).digest == content_digest(rgb)


def test_alpha_is_composited_on_white() -> None:
    rgba = np.array([[[255, 0, 0, 255], [255, 0, 0, 0], [0, 0, 255, 128]]], dtype=np.uint8)
    image = decode_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG"), "image/png", LIMITS)
    assert image.rgb.tolist() == [[[255, 0, 0], [255, 255, 255], [127, 127, 255]]]
    la = np.array([[[0, 255], [0, 0]]], dtype=np.uint8)
    image = decode_image(_encode(Image.fromarray(la, "LA"), "PNG"), "image/png", LIMITS)
    assert image.rgb.tolist() == [[[0, 0, 0], [255, 255, 255]]]
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 255, 0, 9, 9, 9])
    palette.putdata([0, 1])
    image = decode_image(_encode(palette, "PNG", transparency=1), "image/png", LIMITS)
    assert image.rgb.tolist() == [[[0, 255, 0], [255, 255, 255]]]


def test_grey_images_become_rgb() -> None:
    grey = np.array([[0, 128, 255]], dtype=np.uint8)
    image = decode_image(_encode(Image.fromarray(grey, "L"), "PNG"), "image/png", LIMITS)
    assert image.rgb.tolist() == [[[0, 0, 0], [128, 128, 128], [255, 255, 255]]]
    wide = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)  # a 16-bit grey PNG
    image = decode_image(_encode(Image.fromarray(wide), "PNG"), "image/png", LIMITS)
    assert image.rgb.tolist() == [[[0, 0, 0], [100, 100, 100], [255, 255, 255]]]


def test_an_animated_gif_gives_its_first_frame() -> None:
    first, second = Image.new("RGB", (4, 3), (255, 0, 0)), Image.new("RGB", (4, 3), (0, 0, 255))
    data = _encode(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames") == 2
    image = decode_image(data, "image/gif", LIMITS)
    assert image.rgb.shape == (3, 4, 3) and (image.rgb == [255, 0, 0]).all()


def test_a_multi_picture_jpeg_gives_its_first_picture() -> None:
    first, second = _pixels(seed=1), _pixels(seed=2)
    data = _encode(first, "MPO", save_all=True, append_images=[Image.fromarray(second)], quality=95)
    assert Image.open(io.BytesIO(data)).format == "MPO"
    image = decode_image(data, "image/jpeg", LIMITS)
    assert image.digest == decode_image(_encode(first, "JPEG", quality=95), "image/jpeg", LIMITS).digest


def test_exif_orientation_is_not_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to display
    data = _encode(_pixels(8, 16), "JPEG", exif=exif)
    assert Image.open(io.BytesIO(data)).getexif()[0x0112] == 6
    assert decode_image(data, "image/jpeg", LIMITS).rgb.shape == (8, 16, 3)


def test_refused_bytes() -> None:
    png = _encode(_pixels(64, 64), "PNG")
    assert "image/png" in MEDIA_TYPES
    _refused("empty", decode_image, b"", "image/png", LIMITS)
    message = _refused("over the limit of 1000 bytes", decode_image, png, "image/png", ImageLimits(max_bytes=1000))
    assert str(len(png)) in message
    _refused("media type 'image/bmp' is not supported", decode_image, _encode(_pixels(), "BMP"), "image/bmp", LIMITS)
    _refused("not a PNG, JPEG, WebP or GIF image", decode_image, _encode(_pixels(), "BMP"), None, LIMITS)
    _refused("not a PNG, JPEG, WebP or GIF image", decode_image, b"hello, world", None, LIMITS)
    _refused("declared image/jpeg but its data is image/png", decode_image, png, "image/jpeg", LIMITS)
    _refused("declared image/png but its data is image/jpeg", decode_data_url,
             _data_url(_encode(_pixels(), "JPEG"), "image/png"), LIMITS)
    assert decode_image(png, "IMAGE/PNG; charset=binary", LIMITS).rgb.shape == (64, 64, 3)


def test_truncated_or_corrupt_images_are_refused() -> None:
    png = _encode(_pixels(64, 64), "PNG")
    _refused("truncated or corrupt", decode_image, png[: len(png) // 2], "image/png", LIMITS)
    jpeg = _encode(_pixels(64, 64), "JPEG")
    _refused("truncated or corrupt", decode_image, jpeg[: len(jpeg) // 2], "image/jpeg", LIMITS)
    corrupt = bytearray(png)
    corrupt[len(png) // 2] ^= 0xFF  # a flipped byte in the compressed pixels: the chunk's CRC fails
    _refused("truncated or corrupt", decode_image, bytes(corrupt), "image/png", LIMITS)


def test_a_huge_canvas_is_refused_from_its_header() -> None:
    # beyond Pillow's own decompression-bomb guard (2 * Image.MAX_IMAGE_PIXELS): refused as it opens
    _refused("over the limit of 16777216 pixels|larger than the limit of 16777216 pixels", decode_image,
             _png_header(100_000, 100_000), "image/png", LIMITS)
    # under Pillow's guard, over ours: refused from the header, before any pixel is decoded
    message = _refused("over the limit of 16777216 pixels", decode_image, _png_header(5000, 5000), "image/png",
                       LIMITS)
    assert "5000x5000" in message
    _refused("over the limit of 100 pixels", decode_image, _encode(_pixels(10, 11), "PNG"), "image/png",
             ImageLimits(max_pixels=100))
    assert decode_image(_encode(_pixels(10, 10), "PNG"), "image/png", ImageLimits(max_pixels=100)).rgb.size == 300


def test_refused_urls() -> None:
    remote = "remote image URLs are not fetched by this server: send the image inline as a data: URL (base64)"
    for url in ("http://example.com/cat.png", "https://example.com/cat.png", "file:///etc/passwd",
                "ftp://example.com/cat.png", "cat.png"):
        assert _refused("remote image URLs", decode_data_url, url, LIMITS) == remote
    _refused("invalid base64", decode_data_url, "data:image/png;base64,@@@@", LIMITS)
    _refused("invalid base64", decode_data_url, "data:image/png;base64,iVBORw0KGgo", LIMITS)  # bad padding
    _refused("not base64", decode_data_url, "data:image/png,%89PNG", LIMITS)
    _refused("no ','", decode_data_url, "data:image/png;base64", LIMITS)
    _refused("media type 'text/plain' is not supported", decode_data_url,
             _data_url(_encode(_pixels(), "PNG"), "text/plain"), LIMITS)


def test_long_base64_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    png = _encode(_pixels(64, 64), "PNG")
    assert decode_data_url(_data_url(png), ImageLimits(max_bytes=len(png))).rgb.shape == (64, 64, 3)

    def no_decoding(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("decoded base64 over the limit")

    monkeypatch.setattr(base64, "b64decode", no_decoding)
    message = _refused(f"over the limit of {len(png) // 2} bytes", decode_data_url, _data_url(png),
                       ImageLimits(max_bytes=len(png) // 2))
    assert "characters of base64" in message


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        ImageLimits(max_bytes=0)


def test_a_decode_holds_its_budget_while_it_runs_and_keeps_only_what_fit_makes() -> None:
    budget = DecodeBudget(total_bytes=10 * 2**20, per_tenant_bytes=6 * 2**20)
    pixels = _pixels(height=200, width=300)
    charged: list[int] = []

    def hold(nbytes: int):
        charged.append(nbytes)
        assert budget.held == 0  # charged before any pixel is decoded: nothing held yet
        return budget.hold("alice", nbytes)

    def fit(rgb: np.ndarray) -> np.ndarray:
        assert budget.held == 200 * 300 * DECODE_BYTES_PER_PIXEL  # the decode's pixels are still charged
        return rgb[::10, ::10]

    image = decode_image(_encode(pixels, "PNG"), "image/png", LIMITS, hold=hold, fit=fit)
    assert charged == [200 * 300 * DECODE_BYTES_PER_PIXEL] and budget.held == 0 and not budget.held_by
    assert image.rgb.shape == (20, 30, 3) and np.array_equal(image.rgb, pixels[::10, ::10])
    # of the pixels kept: two images the tower takes as the same input are one image to it and to the cache
    assert image.digest == content_digest(pixels[::10, ::10]) != content_digest(pixels)


def test_a_decode_that_does_not_fit_the_budget_is_refused_and_charges_nothing() -> None:
    budget = DecodeBudget(total_bytes=4 * 2**20, per_tenant_bytes=3 * 2**20)
    data = _encode(_pixels(height=200, width=300), "PNG")  # 1.8 MiB charged
    with budget.hold("alice", 2 * 2**20):
        with pytest.raises(ImageBusy, match="retry later"):  # alice's share is full
            decode_image(data, "image/png", LIMITS, hold=lambda n: budget.hold("alice", n))
        decode_image(data, "image/png", LIMITS, hold=lambda n: budget.hold("bob", n))  # bob's is not
        with budget.hold("carol", 2 * 2**20 - 1):
            with pytest.raises(ImageBusy):  # the server's is full: 2 + 2 - 1/1M + 1.8 MiB > 4 MiB
                decode_image(data, "image/png", LIMITS, hold=lambda n: budget.hold("bob", n))
    assert budget.held == 0 and not budget.held_by
    with pytest.raises(ImageError, match="truncated or corrupt"):  # a failed decode gives its charge back too
        decode_image(data[: len(data) // 2], "image/png", LIMITS, hold=lambda n: budget.hold("alice", n))
    assert budget.held == 0 and not budget.held_by


def test_a_decode_budget_is_per_tenant_within_the_whole() -> None:
    with pytest.raises(ValueError, match="per_tenant_bytes <= total_bytes"):
        DecodeBudget(total_bytes=1, per_tenant_bytes=2)
