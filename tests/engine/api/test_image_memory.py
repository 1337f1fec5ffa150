"""Images' memory is bounded across requests: a decode is charged to the server's and the tenant's decode budget
before any pixel is decoded, and a request whose image does not fit is refused with 429 (Anthropic: 529) and a
message that says why, while other tenants' images are served (engine/vision/images.py, DecodeBudget)."""

from __future__ import annotations

import base64

import pytest

from tests.engine.api.conftest import needs_server
from tests.engine.api.test_images import _png, _url, _user

pytestmark = needs_server


def test_an_image_that_does_not_fit_the_tenants_decode_budget_is_a_429_and_others_are_served(served):
    import anthropic
    import openai

    budget = served.service.decode_budget
    messages = [_user(_url(_png(31)), after="What is in it?")]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(_png(31)).decode()}}
    anthropic_messages = [{"role": "user", "content": [block, {"type": "text", "text": "What is in it?"}]}]
    with budget.hold("alice", budget.per_tenant_bytes):  # alice's images being decoded hold her whole share
        with pytest.raises(openai.RateLimitError, match="images being decoded hold"):
            served.openai("key-alice").chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=2)
        with pytest.raises(anthropic.InternalServerError, match="images being decoded hold") as overloaded:
            served.anthropic("key-alice").messages.create(model="gemma-3-270m", messages=anthropic_messages,
                                                          max_tokens=2)
        assert overloaded.value.status_code == 529
        bob = served.openai("key-bob").chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=2)
        assert bob.choices[0].finish_reason == "length"
    assert budget.held == 0  # every decode gave its bytes back, refused or served
    again = served.openai("key-alice").chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=2)
    assert again.choices[0].finish_reason == "length"
