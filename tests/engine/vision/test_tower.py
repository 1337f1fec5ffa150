"""The SigLIP tower and Gemma 3 projector against transformers' own, on seeded random weights."""

from __future__ import annotations

import dataclasses
import io
import re

import numpy as np
import pytest
import torch
from PIL import Image

from engine.vision.images import DecodedImage, ImageLimits, content_digest, decode_image
from engine.vision.tower import PROJECTOR_PREFIX, VISION_PREFIX, VisionConfig, VisionTower

SMALL = VisionConfig(image_size=32, patch_size=8, hidden=64, layers=2, heads=4, intermediate=128, tokens_per_image=4,
                     text_hidden=48)


def _image(height: int, width: int, seed: int) -> DecodedImage:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return DecodedImage(digest=content_digest(rgb), rgb=rgb)


def _scrambled(config: VisionConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every weight random, biases and norms included, so every term of the forward pass counts."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for key, shape in sorted(config.shapes().items()):
        noise = torch.randn(shape, generator=generator)
        if key.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
            weights[key] = 1 + 0.1 * noise
        elif key.endswith((".bias", "mm_soft_emb_norm.weight")):
            weights[key] = 0.1 * noise
        elif key.endswith("position_embedding.weight"):
            weights[key] = config.hidden ** -0.5 * noise
        else:
            weights[key] = 0.05 * noise
    return weights


def _reference(config: VisionConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' SiglipVisionModel and Gemma3MultiModalProjector, fp32, eval, holding `weights`."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    vision = transformers.SiglipVisionConfig(
        hidden_size=config.hidden, intermediate_size=config.intermediate, num_hidden_layers=config.layers,
        num_attention_heads=config.heads, num_channels=3, image_size=config.image_size, patch_size=config.patch_size,
        hidden_act="gelu_pytorch_tanh", layer_norm_eps=config.layer_norm_eps, vision_use_head=False)
    text = transformers.Gemma3TextConfig(hidden_size=config.text_hidden, num_hidden_layers=1, num_attention_heads=1,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=32, vocab_size=32)
    gemma3 = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=config.tokens_per_image)

    class Reference(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision_tower = transformers.SiglipVisionModel(vision)
            self.multi_modal_projector = Gemma3MultiModalProjector(gemma3)

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.multi_modal_projector(self.vision_tower(pixel_values=pixels).last_hidden_state)

    reference = Reference()
    # transformers >= 5 names SiglipVisionModel's weights without `vision_model.`
    reference.vision_tower.load_state_dict(
        {k.removeprefix(VISION_PREFIX): v for k, v in weights.items() if k.startswith(VISION_PREFIX)}, strict=True)
    reference.multi_modal_projector.load_state_dict(
        {k.removeprefix(PROJECTOR_PREFIX): v for k, v in weights.items() if k.startswith(PROJECTOR_PREFIX)},
        strict=True)
    return reference.float().eval()


@pytest.mark.parametrize("config", [SMALL, VisionConfig(layers=1)], ids=["small", "default-1-layer"])
def test_encode_matches_transformers(config: VisionConfig) -> None:
    weights = _scrambled(config, seed=3)
    tower = VisionTower(config, weights)
    pixels = tower.pixel_values([_image(40, 50, 0), _image(config.image_size, config.image_size, 1)])
    ours = tower.encode(pixels)
    assert ours.shape == (2, config.tokens_per_image, config.text_hidden) and ours.dtype == torch.float32
    with torch.inference_mode():
        theirs = _reference(config, weights)(pixels)
    assert ours.std() > 0.1  # not degenerate: differences would show
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_random_tower_matches_transformers_and_stays_finite() -> None:
    tower = VisionTower.random(SMALL)
    pixels = tower.pixel_values([_image(32, 32, 4), _image(17, 60, 5)])
    ours = tower.encode(pixels)
    assert torch.isfinite(ours).all() and ours.std() > 0.01
    assert not torch.allclose(ours[0], ours[1])  # different images, different tokens
    assert not torch.allclose(ours[0, 0], ours[0, 1])  # varied across an image's tokens
    with torch.inference_mode():
        theirs = _reference(SMALL, tower.w)(pixels)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_batch_encodes_as_its_images_alone() -> None:
    tower = VisionTower(SMALL, _scrambled(SMALL, seed=4))
    pixels = tower.pixel_values([_image(32 + i, 32 - i, i) for i in range(3)])
    batch = tower.encode(pixels)
    alone = torch.cat([tower.encode(pixels[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batch, alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
def test_pixel_values_match_transformers_image_processors(resample: str) -> None:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    config = VisionConfig(image_size=32, patch_size=8, hidden=64, layers=1, heads=4, intermediate=128,
                          tokens_per_image=4, text_hidden=48, resample=resample)
    tower = VisionTower.random(config)
    images = [_image(17, 23, 0), _image(32, 32, 1), _image(100, 61, 2), _image(1, 1, 3)]
    # SiglipImageProcessor resamples bicubic, Gemma3ImageProcessor bilinear; both rescale 1/255, mean = std = 0.5
    processor = (SiglipImageProcessorPil if resample == "bicubic" else Gemma3ImageProcessorPil)(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    theirs = processor(images=[Image.fromarray(image.rgb) for image in images], return_tensors="pt")["pixel_values"]
    ours = tower.pixel_values(images)
    assert ours.shape == (4, 3, 32, 32) and ours.dtype == torch.float32
    assert torch.equal(ours, theirs)  # the same PIL resize, the same float64 rescale and float32 normalize
    assert ours.min() >= -1 and ours.max() <= 1


def test_decoded_images_encode_end_to_end() -> None:
    rgb = np.random.default_rng(7).integers(0, 256, (45, 30, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "PNG")
    image = decode_image(buffer.getvalue(), "image/png", ImageLimits())
    tower = VisionTower.random(SMALL)
    pixels = tower.pixel_values([image])
    assert torch.equal(pixels, tower.pixel_values([DecodedImage(digest=content_digest(rgb), rgb=rgb)]))
    tokens = tower.encode(pixels)
    assert tokens.shape == (1, 4, 48) and torch.isfinite(tokens).all()


def test_identity_names_config_and_weights() -> None:
    a, b = VisionTower.random(SMALL), VisionTower.random(SMALL)
    assert re.fullmatch(r"siglip-style-random/[0-9a-f]{32}", a.identity)
    assert a.identity == b.identity
    for key in a.w:
        assert torch.equal(a.w[key], b.w[key])
    assert VisionTower.random(VisionConfig(**{**SMALL.__dict__, "seed": 1})).identity != a.identity
    # one weight, one element
    weights = dict(a.w)
    key = VISION_PREFIX + "encoder.layers.1.mlp.fc2.weight"
    weights[key] = weights[key].clone()
    weights[key][3, 5] += 1e-3
    assert VisionTower(SMALL, weights, name="siglip-style-random").identity != a.identity
    assert VisionTower(SMALL, dict(a.w), name="siglip-style-random").identity == a.identity
    # the same weights, other preprocessing
    bilinear = VisionConfig(**{**SMALL.__dict__, "resample": "bilinear"})
    assert VisionTower(bilinear, dict(a.w), name="siglip-style-random").identity != a.identity
    assert VisionTower(SMALL, dict(a.w)).identity.startswith("siglip-style/")


def test_random_init_scales() -> None:
    w = VisionTower.random(VisionConfig(layers=1)).w
    assert torch.equal(w[VISION_PREFIX + "post_layernorm.weight"], torch.ones(384))
    assert torch.equal(w[VISION_PREFIX + "encoder.layers.0.self_attn.q_proj.bias"], torch.zeros(384))
    assert torch.equal(w[PROJECTOR_PREFIX + "mm_soft_emb_norm.weight"], torch.zeros(384))
    assert abs(w[VISION_PREFIX + "encoder.layers.0.mlp.fc1.weight"].std().item() - 0.02) < 1e-3
    assert w[PROJECTOR_PREFIX + "mm_input_projection_weight"].shape == (384, 640)


@pytest.mark.parametrize("changes, match", [
    ({"image_size": 30}, "not a multiple of patch_size"),
    ({"hidden": 66}, "not a multiple of heads"),
    ({"tokens_per_image": 5}, "not a square"),
    ({"tokens_per_image": 9}, "not a multiple of the token grid's side 3"),
    ({"layers": 0}, "layers must be a positive integer"),
    ({"patch_size": -8}, "patch_size must be a positive integer"),
    ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
    ({"seed": -1}, "seed"),
    ({"resample": "nearest"}, "resample"),
])
def test_config_is_validated(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VisionConfig(**{**SMALL.__dict__, **changes})


def test_default_config_shape() -> None:
    config = VisionConfig()
    assert config.patches_per_side == 14 and config.head_dim == 64
    assert config.shapes()[VISION_PREFIX + "embeddings.position_embedding.weight"] == (196, 384)


def test_weights_and_pixels_are_checked() -> None:
    weights = _scrambled(SMALL, seed=0)
    with pytest.raises(ValueError, match="missing"):
        VisionTower(SMALL, {k: v for k, v in weights.items() if "fc1" not in k})
    with pytest.raises(ValueError, match="unexpected"):
        VisionTower(SMALL, {**weights, "vision_tower.vision_model.head.probe": torch.zeros(1)})
    key = PROJECTOR_PREFIX + "mm_input_projection_weight"
    with pytest.raises(ValueError, match="has shape"):
        VisionTower(SMALL, {**weights, key: weights[key].T})
    tower = VisionTower(SMALL, weights)
    with pytest.raises(ValueError, match="expected pixels of shape"):
        tower.encode(torch.zeros(1, 3, 24, 24))


@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
def test_pixels_resized_as_decoded_encode_exactly_as_the_decoded_ones(resample: str) -> None:
    # the API keeps only the tower's input size of an image while it waits (DecodeBudget): no output may change
    tower = VisionTower.random(dataclasses.replace(SMALL, resample=resample))
    full = _image(90, 70, seed=5)
    kept = DecodedImage(digest=full.digest, rgb=tower.resized(full.rgb))
    assert kept.rgb.shape == (SMALL.image_size, SMALL.image_size, 3)
    assert torch.equal(tower.pixel_values([kept]), tower.pixel_values([full]))
    assert tower.resized(kept.rgb) is kept.rgb  # already the tower's size: as it is
