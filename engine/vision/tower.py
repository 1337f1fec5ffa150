"""A SigLIP vision tower and a Gemma 3 projector, in plain tensors: images to soft tokens for the text model.

Gemma 3's larger models (4B and up) encode an image with a SigLIP vision transformer (transformers'
`SiglipVisionModel` with `vision_use_head=False`) and project its patches into the text model's space
with `Gemma3MultiModalProjector`. `VisionTower.encode` computes both, matching transformers in fp32:

- embeddings: a conv of kernel = stride = patch_size (with bias), flattened row-major, plus learned
  position embeddings (one per patch; no class token, no interpolation);
- `layers` pre-LN encoder layers: x + out_proj(attention(layer_norm1(x))), then x + fc2(gelu_tanh(fc1(
  layer_norm2(x)))); attention is bidirectional, all heads of head_dim = hidden / heads, with biases;
- post_layernorm;
- the projector: the (side x side) patch grid average-pooled to tokens_per_image tokens (kernel = stride),
  Gemma's RMSNorm scaling by (1 + w) in fp32 with eps = layer_norm_eps, then @ mm_input_projection_weight.

Weights are named as in a Gemma 3 checkpoint (`Gemma3Model`'s submodules, without `model.`):

    vision_tower.vision_model.embeddings.patch_embedding.{weight,bias}      (hidden, 3, p, p), (hidden,)
    vision_tower.vision_model.embeddings.position_embedding.weight          (patches, hidden)
    vision_tower.vision_model.encoder.layers.{i}.layer_norm{1,2}.{weight,bias}
    vision_tower.vision_model.encoder.layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias}
    vision_tower.vision_model.encoder.layers.{i}.mlp.fc{1,2}.{weight,bias}
    vision_tower.vision_model.post_layernorm.{weight,bias}
    multi_modal_projector.mm_input_projection_weight                        (hidden, text_hidden): x @ W
    multi_modal_projector.mm_soft_emb_norm.weight                           (hidden,)

transformers >= 5 names `SiglipVisionModel`'s own state dict without `vision_model.` (its conversion mapping
strips the prefix when loading a checkpoint): strip `VISION_PREFIX` to load these weights there.

No trained weights are used here: `VisionTower.random` draws seeded weights, the same in every process, and
`identity` names the encoder (config, preprocessing and every weight's bytes) wherever its outputs are stored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import xxhash
from PIL import Image

from engine.vision.images import DecodedImage

VISION_PREFIX = "vision_tower.vision_model."
PROJECTOR_PREFIX = "multi_modal_projector."

# PIL's filters, as transformers' image processors name them by `resample`
_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 224
    patch_size: int = 16
    hidden: int = 384
    layers: int = 6
    heads: int = 6
    intermediate: int = 1536
    tokens_per_image: int = 49  # a square; (image_size / patch_size) must be a multiple of its side (avg pool)
    text_hidden: int = 640  # the text model's hidden size (Gemma 3 270M)
    layer_norm_eps: float = 1e-6
    seed: int = 0  # random weights: every process makes the same tower from the same seed
    # the resize filter before the tower: SiglipImageProcessor's default is bicubic; Gemma3ImageProcessor's
    # (Gemma 3's checkpoints) is bilinear
    resample: str = "bicubic"

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "hidden", "layers", "heads", "intermediate", "tokens_per_image",
                     "text_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"VisionConfig.{name} must be a positive integer, not {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        side = math.isqrt(self.tokens_per_image)
        if side * side != self.tokens_per_image:
            raise ValueError(f"tokens_per_image {self.tokens_per_image} is not a square")
        if self.patches_per_side % side:
            raise ValueError(f"the patch grid's side {self.patches_per_side} (image_size / patch_size) is not a "
                             f"multiple of the token grid's side {side} (sqrt(tokens_per_image))")
        if not (isinstance(self.layer_norm_eps, float | int) and 0 < self.layer_norm_eps < 1):
            raise ValueError(f"layer_norm_eps must be in (0, 1), not {self.layer_norm_eps!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), not {self.seed!r}")
        if self.resample not in _RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(_RESAMPLE)}, not {self.resample!r}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's name and shape."""
        h, v = self.hidden, VISION_PREFIX
        shapes: dict[str, tuple[int, ...]] = {
            v + "embeddings.patch_embedding.weight": (h, 3, self.patch_size, self.patch_size),
            v + "embeddings.patch_embedding.bias": (h,),
            v + "embeddings.position_embedding.weight": (self.patches_per_side ** 2, h),
            v + "post_layernorm.weight": (h,),
            v + "post_layernorm.bias": (h,),
            PROJECTOR_PREFIX + "mm_input_projection_weight": (h, self.text_hidden),
            PROJECTOR_PREFIX + "mm_soft_emb_norm.weight": (h,),
        }
        for i in range(self.layers):
            layer = f"{v}encoder.layers.{i}."
            for norm in ("layer_norm1", "layer_norm2"):
                shapes[f"{layer}{norm}.weight"] = shapes[f"{layer}{norm}.bias"] = (h,)
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes[f"{layer}self_attn.{proj}.weight"] = (h, h)
                shapes[f"{layer}self_attn.{proj}.bias"] = (h,)
            shapes[f"{layer}mlp.fc1.weight"] = (self.intermediate, h)
            shapes[f"{layer}mlp.fc1.bias"] = (self.intermediate,)
            shapes[f"{layer}mlp.fc2.weight"] = (h, self.intermediate)
            shapes[f"{layer}mlp.fc2.bias"] = (h,)
        return shapes


class VisionTower:
    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], name: str = "siglip-style") -> None:
        """`weights` named as in the module's docstring, exactly those, each of its shape; kept in fp32 on
        their device. `name` starts `identity`."""
        expected = config.shapes()
        missing, extra = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
        if missing or extra:
            raise ValueError(f"vision weights: missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                             f"unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}")
        for key, shape in expected.items():
            if tuple(weights[key].shape) != shape:
                raise ValueError(f"vision weight {key} has shape {tuple(weights[key].shape)}, expected {shape}")
        self.config = config
        self.name = name
        self.w = {key: weights[key].detach().float().contiguous() for key in sorted(expected)}
        self.device = self.w[VISION_PREFIX + "post_layernorm.weight"].device
        # Gemma's RMSNorm scales by (1 + w), in fp32
        self._soft_norm = 1.0 + self.w[PROJECTOR_PREFIX + "mm_soft_emb_norm.weight"]
        self._identity: str | None = None

    @classmethod
    def random(cls, config: VisionConfig) -> VisionTower:
        """Seeded weights, the same in every process: linear, conv and projection weights normal with std 0.02,
        position embeddings with std 1 / sqrt(hidden) (as transformers initialises SigLIP's), LayerNorms 1 and
        0, biases 0, the projector's RMSNorm weight 0 (Gemma scales by 1 + w). Drawn on the CPU in sorted name
        order."""
        generator = torch.Generator().manual_seed(config.seed)
        weights = {}
        for key, shape in sorted(config.shapes().items()):
            if key.endswith("position_embedding.weight"):
                weights[key] = torch.normal(0.0, config.hidden ** -0.5, shape, generator=generator)
            elif key.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
                weights[key] = torch.ones(shape)
            elif key.endswith((".bias", "mm_soft_emb_norm.weight")):
                weights[key] = torch.zeros(shape)
            else:
                weights[key] = torch.normal(0.0, 0.02, shape, generator=generator)
        return cls(config, weights, name="siglip-style-random")

    @property
    def identity(self) -> str:
        """`<name>/<xxh3_128 hex>` of the config's JSON (preprocessing included) and every weight's name, dtype,
        shape and bytes, in sorted name order: names the encoder in the store, differs when any of them does."""
        if self._identity is None:
            h = xxhash.xxh3_128()
            h.update(json.dumps(dataclasses.asdict(self.config), sort_keys=True).encode())
            for key in sorted(self.w):
                t = self.w[key].detach().cpu().contiguous()
                h.update(f"\0{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
                h.update(t.view(torch.uint8).numpy().data)
            self._identity = f"{self.name}/{h.hexdigest()}"
        return self._identity

    def pixel_values(self, images: Sequence[DecodedImage]) -> torch.Tensor:
        """(n, 3, S, S) float32, on the CPU: as transformers' SigLIP (and Gemma 3) image processors do, each
        image resized to S x S by PIL (`config.resample`) in uint8, rescaled by 1/255 (in float64, then to
        float32) and normalized with mean = std = 0.5. An image of no pixels raises ValueError."""
        s = self.config.image_size
        out = np.empty((len(images), 3, s, s), dtype=np.float32)
        for i, image in enumerate(images):
            try:
                resized = self.resized(image.rgb)
            except ValueError as exc:
                raise ValueError(f"image {i}: {exc}") from None
            scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
            out[i] = ((scaled - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)
        return torch.from_numpy(out)

    def resized(self, rgb: np.ndarray) -> np.ndarray:
        """(S, S, 3) uint8: the pixels as the tower takes them, resized by PIL (`config.resample`). Pixels of that
        size already are returned as they are (PIL's resize to the same size is a copy), so an image resized as
        it is decoded, to hold less while it waits, encodes to exactly the same outputs."""
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.shape[0] < 1 or rgb.shape[1] < 1:
            raise ValueError(f"expected (height, width, 3) uint8 pixels, got {rgb.shape} {rgb.dtype}")
        s = self.config.image_size
        if rgb.shape[:2] == (s, s):
            return rgb
        return np.asarray(Image.fromarray(rgb, "RGB").resize((s, s), resample=_RESAMPLE[self.config.resample]))

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(n, tokens_per_image, text_hidden) float32 on the weights' device, from (n, 3, S, S) `pixel_values`.
        Each image's tokens depend on that image alone (up to float rounding across batch sizes)."""
        c, w, v = self.config, self.w, VISION_PREFIX
        s = c.image_size
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, s, s):
            raise ValueError(f"expected pixels of shape (n, 3, {s}, {s}), got {tuple(pixels.shape)}")
        x = pixels.to(self.device, torch.float32)
        n = x.shape[0]
        x = F.conv2d(x, w[v + "embeddings.patch_embedding.weight"], w[v + "embeddings.patch_embedding.bias"],
                     stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2) + w[v + "embeddings.position_embedding.weight"]  # (n, patches, hidden)
        patches = x.shape[1]
        for i in range(c.layers):
            p = f"{v}encoder.layers.{i}."
            h = F.layer_norm(x, (c.hidden,), w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"], c.layer_norm_eps)
            q, k, val = (F.linear(h, w[f"{p}self_attn.{name}.weight"], w[f"{p}self_attn.{name}.bias"])
                         .view(n, patches, c.heads, c.head_dim).transpose(1, 2)
                         for name in ("q_proj", "k_proj", "v_proj"))
            a = F.scaled_dot_product_attention(q, k, val, scale=c.head_dim ** -0.5)
            a = a.transpose(1, 2).reshape(n, patches, c.hidden)
            x = x + F.linear(a, w[p + "self_attn.out_proj.weight"], w[p + "self_attn.out_proj.bias"])
            h = F.layer_norm(x, (c.hidden,), w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"], c.layer_norm_eps)
            h = F.gelu(F.linear(h, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]), approximate="tanh")
            x = x + F.linear(h, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])
        x = F.layer_norm(x, (c.hidden,), w[v + "post_layernorm.weight"], w[v + "post_layernorm.bias"],
                         c.layer_norm_eps)
        # the projector: pool the patch grid to the token grid, RMSNorm (1 + w), project
        side = c.patches_per_side
        grid = x.transpose(1, 2).reshape(n, c.hidden, side, side)
        kernel = side // math.isqrt(c.tokens_per_image)
        pooled = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + c.layer_norm_eps) * self._soft_norm
        return torch.matmul(normed, w[PROJECTOR_PREFIX + "mm_input_projection_weight"])
