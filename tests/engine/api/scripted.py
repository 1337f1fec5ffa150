"""The HTTP app over a scripted model: what `create_app` needs of a `Service`, each reply the text a test gives,
split and streamed as the real service does (text up to a tool call's fence as it comes, then the reply's
tool calls). No model, no tokenizer: for what the API layer does with bodies and replies."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import AsyncIterator

from engine.api.config import ApiConfig
from engine.api.conversation import CALL_FENCE, STOP, TOOL_CALLS, Prompt, Reply, chat_messages, split_tool_calls
from engine.api.metrics import ApiMetrics

MODEL = "gemma-3-270m"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
HEADERS = {"Authorization": "Bearer key-alice"}


class ScriptedService:
    def __init__(self, reply: str = "Hello there.", fault: Exception | None = None,
                 refusal: Exception | None = None) -> None:
        self.reply = reply  # what the model says next
        self.fault = fault  # raised after the reply's first text, as a bug in the service would be
        self.refusal = refusal  # raised after the prompt's ids, as the engine's refusal of a request is
        self.metrics = ApiMetrics(dict, dict)
        self.stop_token_ids = (1, 106)
        self.advisor = None
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight, self.max_in_flight_per_tenant = 128, 64
        self.prompts: list[Prompt] = []  # every prompt that reached the engines
        self.generated = 0  # prompts generated for (the rest were refused before)

    async def generate(self, prompt: Prompt, tenant: str, traffic_class: str, overloaded: int = 429
                       ) -> AsyncIterator[list[int] | str | Reply]:
        self.prompts.append(prompt)
        chat_messages(prompt)  # what the real service gives its encoder: tools described, turns merged
        ids = [2] * 8
        yield ids
        if self.refusal is not None:
            raise self.refusal
        self.generated += 1
        text = self.reply
        fence = text.find(CALL_FENCE) if prompt.tools else -1
        shown = text if fence < 0 else text[:fence]
        if shown:
            yield shown
        if self.fault is not None:
            raise self.fault
        content, calls = split_tool_calls(text, prompt.tools) if prompt.tools else (text, [])
        if not calls and shown != text:
            yield text[len(shown):]
        reply = Reply(content, calls, TOOL_CALLS if calls else STOP, len(ids), len(text.split()), 0, None, [3] * 4)
        self.metrics.prompt_tokens.inc(reply.prompt_tokens)  # as the real service counts a finished reply
        self.metrics.completion_tokens.inc(reply.completion_tokens)
        self.metrics.finished.labels(reply.finish_reason).inc()
        yield reply

    def close_conversation(self, tenant: str, tokens) -> None:
        pass


def client(service: ScriptedService | None = None, **config):
    """A TestClient on the app over `service` (a new one if None), keyed with KEYS; `config`: ApiConfig fields."""
    from fastapi.testclient import TestClient

    from engine.api.server import create_app

    service = service or ScriptedService()
    app = create_app(service, dataclasses.replace(ApiConfig(api_keys=KEYS), **config))
    out = TestClient(app, headers=HEADERS, raise_server_exceptions=False)
    out.service = service
    return out
