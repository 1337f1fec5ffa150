"""Images in a request: checked, decoded to RGB pixels and named by a content hash, with no network access.

An image arrives inline, as bytes with a declared media type or as a `data:` URL (base64); remote URLs are
refused, never fetched. Every problem is an `ImageError`, one sentence the API answers 400 with.

What the server does with the pixels (`decode_image`):
- Pillow decodes the whole image (`load()`) before anything uses it: truncated or corrupt data is refused
  (`PIL.ImageFile.LOAD_TRUNCATED_IMAGES` is never set here).
- width * height is checked against `ImageLimits.max_pixels` from the header, before any pixel is decoded,
  so a small file that claims a huge canvas (a decompression bomb) costs nothing.
- The pixels become RGB: palette, grey and CMYK images are converted; an alpha channel (RGBA, LA, a palette's
  or a tRNS chunk's transparency) is composited onto white.
- EXIF orientation is NOT applied: the pixels are used as stored, as transformers' image processors do.
- An animated GIF (or WebP) gives its first frame only.
- Memory is bounded across requests, not only per image: an image's decode holds up to
  `DECODE_BYTES_PER_PIXEL` bytes a pixel while it runs, charged from its header's size to a `DecodeBudget`
  (over all requests and per tenant) before any pixel is decoded, and refused (`ImageBusy`) when it does not
  fit; what is kept afterwards is only what the vision tower takes (`fit`: the pixels resized to its input),
  so images waiting for the engines hold kilobytes, not their decoded size.

The content hash (`content_digest`) is over the pixels kept and their shape, so the same pixels hash the
same whatever the container (PNG or lossless WebP), and a lossy re-encode (JPEG) is different pixels. Where
the pixels kept are the tower's input (`fit`), two images that resize to the same input are one image to the
tower, and to the cache: its encoder outputs and the KV after it are the same.
A caller may name an image instead (like vLLM's `multi_modal_uuids`): the digest is then of that id alone,
whatever the pixels, and the caller answers for the id naming one image.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_bytes: int = 8 << 20  # encoded bytes of one image
    max_pixels: int = 16_777_216  # width * height, checked from the header before decoding pixels

    def __post_init__(self) -> None:
        for name in ("max_images", "max_bytes", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageLimits.{name} must be at least 1, not {getattr(self, name)}")


class ImageError(ValueError):
    """An image the server refuses; the API answers 400 with str(error)."""


class ImageBusy(ImageError):
    """Images being decoded hold the whole budget (`DecodeBudget`) now: the API answers 429, retry later."""


# The most one image's decode holds at once, per pixel: 26 bytes measured at a 4096 x 4096 RGBA and a 16-bit
# grey PNG (Pillow's decoded image, then the wider integers of the conversion to RGB, then the RGB array)
DECODE_BYTES_PER_PIXEL = 32


class DecodeBudget:
    """Bytes that images being decoded may hold at once, over all requests (`total_bytes`) and by one tenant
    (`per_tenant_bytes`). Thread-safe: decodes run on worker threads. A charge that does not fit is refused at
    once, never queued: a request waiting here would hold its body meanwhile."""

    def __init__(self, total_bytes: int, per_tenant_bytes: int) -> None:
        if not 0 < per_tenant_bytes <= total_bytes:
            raise ValueError(f"a decode budget needs 0 < per_tenant_bytes <= total_bytes, got {per_tenant_bytes} "
                             f"and {total_bytes}")
        self.total_bytes, self.per_tenant_bytes = total_bytes, per_tenant_bytes
        self.held = 0
        self.held_by: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, tenant: str, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` for the tenant while the block runs; ImageBusy if they do not fit now."""
        with self._lock:
            if self.held + nbytes > self.total_bytes or self.held_by[tenant] + nbytes > self.per_tenant_bytes:
                raise ImageBusy(f"images being decoded hold {self.held_by[tenant]} of this tenant's "
                                f"{self.per_tenant_bytes} bytes and {self.held} of the server's {self.total_bytes}, "
                                f"and this one needs {nbytes}: retry later")
            self.held += nbytes
            self.held_by[tenant] += nbytes
        try:
            yield
        finally:
            with self._lock:
                self.held -= nbytes
                self.held_by[tenant] -= nbytes
                if not self.held_by[tenant]:
                    del self.held_by[tenant]


Hold = Callable[[int], contextlib.AbstractContextManager[None]]  # bytes -> held while the decode runs


MEDIA_TYPES: tuple[str, ...] = ("image/png", "image/jpeg", "image/webp", "image/gif")

# Pillow's format names, and the media type each is
_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
# Pillow opens a multi-picture JPEG (some cameras' and phones') as "MPO": a JPEG, its first picture decoded
_OPENED_AS = {**_FORMATS, "MPO": "image/jpeg"}

MAX_CALLER_ID = 256

_REMOTE = "remote image URLs are not fetched by this server: send the image inline as a data: URL (base64)"


@dataclass(frozen=True, eq=False)  # eq=False: an array has no truth value; compare digests
class DecodedImage:
    digest: bytes  # (16,) the image's content hash (`content_digest`), or of the caller's id (`image_digest`)
    rgb: np.ndarray  # (height, width, 3) uint8, read-only
    # the caller's name of the image, where it gave one (the digest is then of it): the encoder process, which
    # computes the digest again from what it is sent, needs it
    caller_id: str | None = None


def image_digest(rgb: np.ndarray, caller_id: str | None = None) -> bytes:
    """An image's digest as `decode_image` gives it: of the caller's id where it names the image (`id_digest`),
    else of its pixels (`content_digest`). The encoder process keys its records by this, computed from what it
    encodes."""
    return id_digest(caller_id) if caller_id is not None else content_digest(rgb)


def content_digest(rgb: np.ndarray) -> bytes:
    """blake2b-128 of b"rgb8\\0", height and width (little-endian uint32) and the pixels, row-major."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected (height, width, 3) uint8 pixels, got {rgb.shape} {rgb.dtype}")
    height, width = rgb.shape[:2]
    h = hashlib.blake2b(b"rgb8\0" + struct.pack("<II", height, width), digest_size=16)
    h.update(np.ascontiguousarray(rgb).data)  # the pixels without a copy
    return h.digest()


def id_digest(caller_id: str) -> bytes:
    """The digest of an image the caller names: blake2b-128 of b"id\\0" and the id in UTF-8."""
    if not isinstance(caller_id, str) or not caller_id:
        raise ImageError("an image's id must be a non-empty string")
    if len(caller_id) > MAX_CALLER_ID:
        raise ImageError(f"an image's id is {len(caller_id)} characters, over the limit of {MAX_CALLER_ID}")
    return hashlib.blake2b(b"id\0" + caller_id.encode(), digest_size=16).digest()


def decode_image(data: bytes, media_type: str | None, limits: ImageLimits, caller_id: str | None = None,
                 hold: Hold | None = None, fit: Callable[[np.ndarray], np.ndarray] | None = None) -> DecodedImage:
    """Check and decode one image (see the module's docstring); `media_type` None: whatever the bytes are,
    among `MEDIA_TYPES`. The decode holds `hold(bytes)` while it runs (a `DecodeBudget`'s, for the tenant);
    `fit` makes the pixels kept, and hashed, of the decoded ones. Raises `ImageError`."""
    named = id_digest(caller_id) if caller_id is not None else None  # a bad id is refused before any decoding
    if len(data) == 0:
        raise ImageError("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of {limits.max_bytes} bytes")
    declared = None
    if media_type is not None:
        declared = media_type.split(";")[0].strip().lower()
        if declared not in MEDIA_TYPES:
            raise ImageError(f"the image's media type {media_type[:64]!r} is not supported: "
                             f"send one of {', '.join(MEDIA_TYPES)}")
    try:
        image = Image.open(io.BytesIO(data), formats=list(_FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own guard, above 2 * Image.MAX_IMAGE_PIXELS (the warning only where filters make it an error)
        raise ImageError(f"the image is larger than the limit of {limits.max_pixels} pixels "
                         "(width x height)") from None
    except UnidentifiedImageError:
        raise ImageError(f"the image data is not a {_names()} image, or its header is corrupt") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error):
        raise ImageError("the image data is truncated or corrupt") from None
    with image:
        actual = _OPENED_AS.get(image.format or "")
        if actual is None:
            raise ImageError(f"the image data is not a {_names()} image")
        if declared is not None and declared != actual:
            raise ImageError(f"the image is declared {declared} but its data is {actual}")
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ImageError(f"the image is {width}x{height} pixels, over the limit of {limits.max_pixels} "
                             "pixels (width x height)")
        if width < 1 or height < 1:
            raise ImageError(f"the image is {width}x{height} pixels: it has no pixels")
        with hold(width * height * DECODE_BYTES_PER_PIXEL) if hold is not None else contextlib.nullcontext():
            try:
                image.load()  # the first frame of an animation; the whole image, or an error if truncated
                rgb = _to_rgb(image)
            except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                raise ImageError(f"the image is larger than the limit of {limits.max_pixels} pixels "
                                 "(width x height)") from None
            except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError):
                raise ImageError("the image data is truncated or corrupt") from None
            image.close()  # Pillow's copy of the pixels goes now, before the pixels kept are made
            if fit is not None:
                rgb = np.ascontiguousarray(fit(rgb))
    rgb.flags.writeable = False
    return DecodedImage(digest=named if named is not None else content_digest(rgb), rgb=rgb, caller_id=caller_id)


def decode_data_url(url: str, limits: ImageLimits, caller_id: str | None = None, hold: Hold | None = None,
                    fit: Callable[[np.ndarray], np.ndarray] | None = None) -> DecodedImage:
    """Decode `data:<media type>;base64,<data>` (`decode_image`); any other URL is refused, never fetched.
    The base64's length is checked against `limits.max_bytes` before it is decoded."""
    if not url[:5].lower() == "data:":
        raise ImageError(_REMOTE)
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError("the image's data: URL has no ',' before its data")
    params = [p.strip() for p in header.split(";")]
    if params[-1].lower() != "base64":
        raise ImageError("the image's data: URL is not base64: send data:<media type>;base64,<data>")
    media_type = (params[0] or None) if len(params) > 1 else None  # data:;base64,... : whatever the bytes are
    payload = payload.strip()
    # base64 is 4 characters per 3 bytes: refuse a long one before decoding it
    if len(payload) > 4 * ((limits.max_bytes + 2) // 3):
        raise ImageError(f"the image is over the limit of {limits.max_bytes} bytes "
                         f"({len(payload)} characters of base64)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's data: URL has invalid base64 data") from None
    return decode_image(data, media_type, limits, caller_id, hold, fit)


def _names() -> str:
    names = [n if n != "WEBP" else "WebP" for n in _FORMATS]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _to_rgb(image: Image.Image) -> np.ndarray:
    """(height, width, 3) uint8: alpha composited onto white; 16-bit grey scaled to 8 bits."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I"):  # 16-bit grey PNG: Pillow's convert("RGB") would clip
        grey = np.asarray(image.convert("I"), dtype=np.int64)
        grey8 = np.clip((grey * 255 + 32767) // 65535, 0, 255).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(grey8[:, :, None], 3, axis=2))
    if image.has_transparency_data:
        rgba = np.asarray(image.convert("RGBA"), dtype=np.uint16)
        alpha = rgba[:, :, 3:]
        # round(c * a / 255 + 255 * (255 - a) / 255), in integers
        out = (rgba[:, :, :3] * alpha + 255 * (255 - alpha) + 127) // 255
        return np.ascontiguousarray(out.astype(np.uint8))
    return np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
