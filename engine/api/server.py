"""The HTTP server: OpenAI Chat Completions and Responses, Anthropic Messages, over the engines.

    kvstore-serve [--model DIR] [--servers host:port,...] [--api-key KEY=TENANT ...] [--port 8000]

Routes: POST /v1/chat/completions, POST /v1/responses (+ GET and DELETE /v1/responses/{id}),
POST /v1/messages, each streamed as server-sent events or not; GET /v1/models, /health, /metrics.

What the store learns from a request comes from the request, never from its body's say-so:
* the tenant from the API key (`Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`; `--api-key
  KEY=TENANT`), its name the namespace salt: two tenants never share cached blocks;
* the traffic class from the `X-Traffic-Class` header (chat or agent); without it, a request with tools
  is agent traffic and any other chat;
* whether the conversation goes on (`engine.api.advice`): a reply ending in a tool call, a deleted
  response, a conversation idle past its class's limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.api import anthropic_messages, openai_chat, openai_responses
from engine.api.config import TRAFFIC_CLASSES, ApiConfig
from engine.api.conversation import Message, Prompt, Reply
from engine.api.errors import ApiError
from engine.api.service import Service

DISCONNECT_POLL_S = 1.0  # how often a non-streamed request checks that its client is still there


def create_app(service: Service, config: ApiConfig) -> FastAPI:
    stored = openai_responses.ResponseStore(config.max_stored_responses)
    stop_ids = service.stop_token_ids

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        sweeper = asyncio.create_task(_sweep(service, config.sweep_interval_s))
        yield
        sweeper.cancel()

    app = FastAPI(title="kvstore-serve", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        render = anthropic_messages.error_body if _api(request) == "messages" else openai_chat.error_body
        return JSONResponse(render(exc), status_code=exc.status)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        service.metrics.requests.labels(_api(request), str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **service.runner.load}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _tenant(request, config)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvstore", "type": "model", "display_name": config.model_name,
                                            "created_at": "1970-01-01T00:00:00Z"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant, body = await _read(request, config)
        prompt = _served(openai_chat.parse(body, stop_ids), config)
        rid = openai_chat.completion_id()
        return await _answer(service, request, prompt, tenant, lambda reply, _: openai_chat.completion(reply, rid, prompt.model),
                             openai_chat.ChatStream(rid, prompt.model, prompt))

    @app.post("/v1/messages")
    async def messages(request: Request):
        tenant, body = await _read(request, config)
        prompt = _served(anthropic_messages.parse(body, stop_ids), config)
        rid = anthropic_messages.message_id()
        return await _answer(service, request, prompt, tenant,
                             lambda reply, _: anthropic_messages.message(reply, rid, prompt.model, reply.stop_sequence),
                             anthropic_messages.MessageStream(rid, prompt.model))

    @app.post("/v1/responses")
    async def responses(request: Request):
        tenant, body = await _read(request, config)
        asked = openai_responses.parse(body, stop_ids)
        conversation = stored.conversation(tenant, asked.previous_response_id, _served(asked.prompt, config))
        prompt = dataclasses.replace(asked.prompt, messages=conversation)
        rid = openai_responses.response_id()
        traffic = _traffic(request, prompt)

        def finished(reply: Reply, ids: list[int]) -> dict:
            out = openai_responses.response(reply, rid, prompt.model, asked.prompt, asked.previous_response_id)
            if asked.store:
                said = Message("assistant", reply.text, tuple(reply.tool_calls))
                stored.put(tenant, rid, openai_responses.StoredResponse([*prompt.messages, said], out,
                                                                        ids + reply.tokens, traffic))
            return out

        return await _answer(service, request, prompt, tenant, finished,
                             openai_responses.ResponseStream(rid, prompt.model, asked.prompt, asked.previous_response_id))

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request) -> dict:
        return stored.get(_tenant(request, config), rid).body

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request) -> dict:
        tenant = _tenant(request, config)
        service.close_conversation(tenant, stored.delete(tenant, rid).tokens)  # the store: it does not go on
        return openai_responses.deleted(rid)

    return app


async def _answer(service: Service, request: Request, prompt: Prompt, tenant: str,
                  render: Callable[[Reply, list[int]], dict], stream) -> Response:
    """Generate the prompt's reply: the API's object, or its event stream. An engine's refusal before the
    first token is an error status; a client that goes away cancels the generation."""
    traffic = _traffic(request, prompt)
    ids = await service.encode(prompt)
    events = service.generate(prompt, ids, tenant, traffic)
    if not prompt.stream:
        reply = await _until_reply(events, request)
        return JSONResponse(render(reply, ids))
    first = await anext(events)  # ApiError here is still an error status, not a broken stream
    return StreamingResponse(_events(first, events, stream, render, ids), media_type="text/event-stream")


async def _until_reply(events: AsyncIterator[str | Reply], request: Request) -> Reply:
    while True:
        step = asyncio.ensure_future(anext(events))
        while not step.done():
            await asyncio.wait([step], timeout=DISCONNECT_POLL_S)
            if not step.done() and await request.is_disconnected():
                step.cancel()  # the generator's cleanup cancels the generation
                with contextlib.suppress(asyncio.CancelledError):
                    await step
                raise ApiError(499, "the client went away")
        item = step.result()
        if isinstance(item, Reply):
            return item


async def _events(first: str | Reply, events: AsyncIterator[str | Reply], stream, render, ids: list[int]
                  ) -> AsyncIterator[bytes]:
    yield stream.start(len(ids), 0)  # cached tokens are known once the prefill is done: the end says them
    item = first
    try:
        while True:
            if isinstance(item, Reply):
                render(item, ids)  # what a non-streamed request would have got (and, for Responses, stored)
                yield stream.finish(item)
                return
            yield stream.text(item)
            item = await anext(events)
    except ApiError as exc:  # after the stream began: the API's error event
        yield stream.error(ApiError(500, exc.message, kind="server_error"))


async def _sweep(service: Service, interval_s: float) -> None:
    """Conversations idle past their class's limit: the store is told they end."""
    while True:
        await asyncio.sleep(interval_s)
        if service.advisor is not None:
            service.advisor.sweep(time.monotonic())


def _api(request: Request) -> str:
    return request.url.path.removeprefix("/v1/").split("/")[0] or "other"


async def _read(request: Request, config: ApiConfig) -> tuple[str, Any]:
    tenant = _tenant(request, config)
    try:
        return tenant, json.loads(await request.body())
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None


def _served(prompt: Prompt, config: ApiConfig) -> Prompt:
    if prompt.model != config.model_name:
        raise ApiError(404, f"the model {prompt.model!r} does not exist; this server serves {config.model_name!r}",
                       "model", "not_found_error")
    return prompt


def _traffic(request: Request, prompt: Prompt) -> str:
    traffic = request.headers.get("x-traffic-class") or ("agent" if prompt.tools else "chat")
    if traffic not in TRAFFIC_CLASSES:
        raise ApiError(400, f"X-Traffic-Class must be one of {TRAFFIC_CLASSES}, got {traffic!r}")
    return traffic


def _tenant(request: Request, config: ApiConfig) -> str:
    """The tenant of the request's API key (its namespace salt); the one open tenant when none are set."""
    if not config.api_keys:
        return ""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    tenant = config.api_keys.get(key)
    if tenant is None:
        raise ApiError(401, "invalid API key", kind="authentication_error")
    return tenant


def build(config: ApiConfig) -> Service:
    """The engines (on the store when config.servers), the prompt encoder's processes and the advisor."""
    from engine.api.advice import Advisor
    from engine.api.runner import EngineRunner
    from engine.api.tokenize import PromptEncoder
    from engine.decode import DecodeConfig
    from engine.prefill import PrefillConfig, PrefillEngine
    from engine.real_model import load_real_model, load_tokenizer
    from engine.real_text import stop_token_ids

    folder, tokenizer = load_real_model() if config.model is None else (config.model, load_tokenizer(config.model))
    client = advisor = None
    if config.servers:
        from kvstore.client import KVClient

        client = KVClient(list(config.servers))
        advising = ThreadPoolExecutor(1, thread_name_prefix="advise")  # the client blocks; the loop must not
        advisor = Advisor(lambda blocks, goes_on: advising.submit(client.advise, blocks, goes_on), config.idle_s)
    prefill = PrefillEngine.from_pretrained(folder, client, PrefillConfig(block_tokens=config.block_tokens,
                                                                          kv_pages=config.kv_pages))
    runner = EngineRunner(prefill, DecodeConfig(max_running=config.max_running, detokenize=tokenizer.decode))
    encoder = PromptEncoder(folder, config.tokenize_workers)
    return Service(runner, tokenizer, encoder, sorted(stop_token_ids(tokenizer)), advisor)


def parse_args(argv: Sequence[str] | None = None) -> ApiConfig:
    parser = argparse.ArgumentParser(prog="kvstore-serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory; default: the packaged Gemma 3 270M")
    parser.add_argument("--model-name", default="gemma-3-270m")
    parser.add_argument("--servers", default="", help="the store's daemons, host:port,...")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY=TENANT")
    parser.add_argument("--kv-pages", type=int, default=256)
    args = parser.parse_args(argv)
    keys = {}
    for item in args.api_key:
        key, _, tenant = item.partition("=")
        if not key or not tenant:
            parser.error(f"--api-key takes KEY=TENANT, got {item!r}")
        keys[key] = tenant
    try:
        return ApiConfig(args.model, args.model_name, tuple(s for s in args.servers.split(",") if s), args.host,
                         args.port, keys, args.kv_pages)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    config = parse_args(argv)
    service = build(config)
    uvicorn.run(create_app(service, config), host=config.host, port=config.port, log_level="warning")
