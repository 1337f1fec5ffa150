"""Named vision towers, so that every process (the API's prefill, the encoder process) makes the same one.

Imports nothing heavy: a config checks a preset's name before anything loads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.vision.tower import VisionConfig

# "small" is VisionConfig's default (224 px, 196 patches 384 wide, 6 layers, 49 tokens an image); "tiny" is for
# tests. Weights are random (VisionTower.random): what matters is that every process draws the same.
VISION_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "small": {},
    "tiny": {"image_size": 48, "patch_size": 8, "hidden": 32, "layers": 1, "heads": 2, "intermediate": 64,
             "tokens_per_image": 9},
}


def vision_config(preset: str, text_hidden: int, seed: int = 0) -> VisionConfig:
    """The tower of a named preset, projecting into a text model `text_hidden` wide."""
    from engine.vision.tower import VisionConfig

    if preset not in VISION_PRESETS:
        raise ValueError(f"unknown vision preset {preset!r}; choose one of {sorted(VISION_PRESETS)}")
    return VisionConfig(**VISION_PRESETS[preset], text_hidden=text_hidden, seed=seed)
