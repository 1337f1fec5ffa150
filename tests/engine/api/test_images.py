"""Image parts through the HTTP API on the real Gemma 3 270M with the tiny random vision tower: OpenAI
image_url data URLs and Anthropic base64 image blocks are served; a conversation's next turn loads the blocks
after its image from the store; the image's encoder record is read instead of encoding it again; and every bad
image is a 400 that leaves the server serving. (The tower's weights are random: replies mean nothing.)"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.engine.api.conftest import needs_server

pytestmark = needs_server
LONG = " ".join(f"Item {i} of the inventory is a box of {i * 7 % 13 + 1} screws." for i in range(24))


def _png(seed: int, size: tuple[int, int] = (40, 56)) -> bytes:
    """Noise on a plain field: small pictures differ, a large one still compresses under the body's limit."""
    from PIL import Image

    rgb = np.full((*size, 3), seed % 256, dtype=np.uint8)
    rgb[:40, :56] = np.random.default_rng(seed).integers(0, 256, (min(size[0], 40), min(size[1], 56), 3))
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _user(url: str, after: str = LONG) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "Look at this screenshot."},
                                        {"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": after}]}


def test_an_image_conversations_next_turn_loads_the_blocks_after_its_image(served):
    client, vision = served.openai(), served.service.vision
    first = [_user(_url(_png(1)))]
    reply = client.chat.completions.create(model="gemma-3-270m", messages=first, max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.prompt_tokens > 3 * 64
    encoded = vision.counts["inline"]
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And the next one?"}]
    again = client.chat.completions.create(model="gemma-3-270m", messages=second, max_tokens=4, temperature=0)
    # the image is in the first block, so every block loaded lies after it
    assert again.usage.prompt_tokens_details.cached_tokens >= 3 * 64
    assert vision.counts["inline"] == encoded  # its encoder outputs came from the store
    # The same text with another image: nothing after the image's block is the store's
    other = client.chat.completions.create(model="gemma-3-270m", messages=[_user(_url(_png(2)))] + second[1:],
                                           max_tokens=4, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_an_anthropic_base64_image_is_served_and_its_record_reused(served):
    client, vision = served.anthropic(), served.service.vision
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(_png(3)).decode()}}
    stored = vision.counts["store"]
    for _ in range(2):
        reply = client.messages.create(model="gemma-3-270m", max_tokens=3, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is in it?"}]}])
        assert reply.stop_reason in ("max_tokens", "end_turn") and reply.usage.input_tokens > 9
    assert vision.counts["store"] == stored + 1  # the second request read the first's encoder record


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "not fetched"),
    (_url(_png(4)[:-30]), "truncated|corrupt"),
    (_url(_png(4), "image/jpeg"), "image/png"),  # PNG bytes declared as JPEG
    (_url(b"GIF89a" + bytes(10), "image/gif"), "not|corrupt|truncated"),
    ("data:image/png;base64,%%%%", "base64"),
    (_url(_png(5, (2048, 1024))), "limit"),  # 2 Mpx: over the fixture's 1 Mpx
])
def test_a_bad_image_is_a_400_and_the_server_goes_on(served, url, message):
    import openai

    client = served.openai()
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="gemma-3-270m", messages=[_user(url, "Hi.")], max_tokens=2)
    ok = client.chat.completions.create(model="gemma-3-270m", messages=[{"role": "user", "content": "Hi."}],
                                        max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_too_many_images_and_remote_anthropic_sources_are_refused(served):
    import anthropic
    import openai

    parts = [{"type": "image_url", "image_url": {"url": _url(_png(6))}}] * 4  # the fixture allows 3
    with pytest.raises(openai.BadRequestError, match="more than the limit of 3"):
        served.openai().chat.completions.create(model="gemma-3-270m", max_tokens=2,
                                                messages=[{"role": "user", "content": parts}])
    with pytest.raises(anthropic.BadRequestError, match="not fetched"):
        served.anthropic().messages.create(model="gemma-3-270m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])


def test_a_clients_text_never_places_an_image(served):
    """The private-use character that marks an image's place, typed by a client, is text: no image is read."""
    client, vision = served.openai(), served.service.vision
    before = sum(vision.counts.values())
    reply = client.chat.completions.create(model="gemma-3-270m", max_tokens=2,
                                           messages=[{"role": "user", "content": "a \ue002 b"}])
    assert reply.usage.completion_tokens == 2 and sum(vision.counts.values()) == before
