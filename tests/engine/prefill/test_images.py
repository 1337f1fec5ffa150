"""Images in prefill: the encoder's rows replace the placeholders' embeddings exactly as transformers' Gemma 3
does, and the store keys the prompt's blocks by the image, so that a prompt that differs only in an image
shares exactly the blocks before it, and a repeated prompt resumes from the store to the same logits."""

from __future__ import annotations

import os

import pytest
import torch

from engine.prefill.config import PrefillConfig
from engine.prefill.cost import ChunkCost
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import CACHED, COLD, PrefillError, PrefillRequest, PromptImage
from kvstore.block import ImageSpan
from kvstore.client import ClientConfig, KVClient
from tests.engine.conftest import VOCAB

pytestmark = pytest.mark.integration
BLOCK = 16
TOLERANCE = 1e-4
IMAGE_TOKENS = 20
PLACEHOLDER = 0  # what the prompt holds at an image's placeholders: its embedding is never read


def _engine(model, client) -> PrefillEngine:
    config = PrefillConfig(block_tokens=BLOCK, kv_pages=64, cost=ChunkCost(a=1e-7, b=1e-3, c=1e-3),
                           step_budget_s=0.5)
    return PrefillEngine.from_pretrained(model.path, client, config, torch.float32)


def _image(start: int, seed: int) -> PromptImage:
    rows = torch.randn(IMAGE_TOKENS, 64, generator=torch.Generator().manual_seed(seed))  # (n, hidden)
    return PromptImage(ImageSpan(start, IMAGE_TOKENS, seed.to_bytes(16, "little")), rows)


def _prompt(length: int, images: list[PromptImage], seed: int = 0) -> list[int]:
    tokens = torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    for image in images:
        tokens[image.span.start : image.span.start + IMAGE_TOKENS] = [PLACEHOLDER] * IMAGE_TOKENS
    return tokens


def _reference(model, tokens: list[int], images: list[PromptImage]) -> torch.Tensor:
    """transformers' logits of the last position, the images' rows fed in place of the scaled token embeddings
    (what Gemma3Model does with its projector's outputs)."""
    with torch.inference_mode():
        embeds = model.reference.model.embed_tokens(torch.tensor(tokens)[None]).clone()  # (1, n, hidden), scaled
        for image in images:
            embeds[0, image.span.start : image.span.start + IMAGE_TOKENS] = image.embeds
        return model.reference(inputs_embeds=embeds).logits[0, -1].float()


def _prefill(engine, tokens, images, session) -> object:
    return engine.prefill(PrefillRequest(tokens, session_id=session, images=tuple(images)))


def test_an_image_prompt_is_exact_cold_and_resumed_and_keyed_by_its_image(tiny_gemma3, daemons):
    (daemon,) = daemons(1)
    with KVClient(ClientConfig(servers=(daemon.address,))) as client:
        engine = _engine(tiny_gemma3, client)
        photo = [_image(40, seed=1)]
        tokens = _prompt(100, photo)
        first = _prefill(engine, tokens, photo, "alice")
        assert first.path == COLD
        assert (first.logits - _reference(tiny_gemma3, tokens, photo)).abs().max() <= TOLERANCE
        first.kv.release()
        assert client.write_behind.flush()

        # The same prompt again: resumed from the store, the same logits
        again = _prefill(engine, tokens + [5, 6, 7], photo, "alice")
        assert again.path == CACHED and again.loaded_tokens == 96
        assert (again.logits - _reference(tiny_gemma3, tokens + [5, 6, 7], photo)).abs().max() <= TOLERANCE
        again.kv.release()

        # Another image in the same place: only the blocks before the image's first block are the store's
        other = [_image(40, seed=2)]
        swapped = _prefill(engine, tokens, other, "bob")
        assert swapped.stored_tokens == 40 // BLOCK * BLOCK
        assert (swapped.logits - _reference(tiny_gemma3, tokens, other)).abs().max() <= TOLERANCE
        swapped.kv.release()

        # The same image one token later, after the same text: nothing of the image's blocks hits
        moved = [_image(41, seed=1)]
        shifted = tokens[:40] + [9] + tokens[40:]
        later = _prefill(engine, shifted, moved, "carol")
        assert later.stored_tokens == 40 // BLOCK * BLOCK
        assert (later.logits - _reference(tiny_gemma3, shifted, moved)).abs().max() <= TOLERANCE
        later.kv.release()
        assert engine.pool.free_pages == 64


def test_with_two_images_a_hit_never_ends_in_a_block_with_too_little_of_the_second(tiny_gemma3, daemons):
    photos = [_image(0, seed=3), _image(46, seed=4)]  # the second: 2 placeholders in block 2, its 5th in block 3
    tokens = _prompt(100, photos)
    elsewhere, here = daemons(2)
    with KVClient(ClientConfig(servers=(elsewhere.address,))) as client:
        first = _prefill(_engine(tiny_gemma3, client), tokens, photos, "alice")
        first.kv.release()
        assert client.write_behind.flush()
        leading = client.get(first.blocks[:3])
    with KVClient(ClientConfig(servers=(here.address,))) as client:
        # this store holds the chain's first 3 blocks: block 2 carries only 62 bits of the second image
        assert client.put([(d.block, d.kv()) for d in leading], leading[0].header.n_layers).stored == 3
        again = _prefill(_engine(tiny_gemma3, client), tokens, photos, "bob")
        assert again.stored_tokens == 2 * BLOCK, "cut back to before the block with too little of the second image"
        assert (again.logits - _reference(tiny_gemma3, tokens, photos)).abs().max() <= TOLERANCE
        again.kv.release()


def test_images_that_do_not_fit_the_prompt_are_refused(tiny_gemma3):
    engine = _engine(tiny_gemma3, None)
    tokens = _prompt(50, [])
    with pytest.raises(PrefillError, match="run past"):
        engine.submit(PrefillRequest(tokens, images=(_image(40, 1),)))
    wrong = PromptImage(ImageSpan(0, IMAGE_TOKENS, os.urandom(16)), torch.zeros(IMAGE_TOKENS, 32))
    with pytest.raises(PrefillError, match="embeds must be"):
        engine.submit(PrefillRequest(tokens, images=(wrong,)))
    with pytest.raises(PrefillError, match="overlaps"):
        engine.submit(PrefillRequest(tokens, images=(_image(0, 1), _image(10, 2))))
    assert engine.pending == 0
