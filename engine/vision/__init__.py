"""The vision-encoder stage: images checked and decoded to RGB with a content hash (`images`), then encoded to
soft tokens for the text model by a SigLIP tower and a Gemma 3 projector (`tower`)."""

from engine.vision.images import (
    MEDIA_TYPES,
    DecodedImage,
    ImageError,
    ImageLimits,
    content_digest,
    decode_data_url,
    decode_image,
)
from engine.vision.tower import VisionConfig, VisionTower

__all__ = ["MEDIA_TYPES", "DecodedImage", "ImageError", "ImageLimits", "VisionConfig", "VisionTower",
           "content_digest", "decode_data_url", "decode_image"]
