"""The HTTP server: OpenAI Chat Completions over the prefill and decode engines.

    kvstore-serve [--model DIR] [--servers host:port,...] [--api-key KEY=TENANT ...] [--port 8000]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    client.chat.completions.create(model="gemma-3-270m", messages=[...], stream=True)

Routes: POST /v1/chat/completions (streamed as server-sent events, or not; `stream_options.include_usage`),
GET /v1/models, GET /health. The tenant comes from the API key (`--api-key KEY=TENANT`; its name is the
namespace salt), never from the body: two tenants never share cached blocks. The traffic class comes from
the `X-Traffic-Class` header (chat or agent; chat by default). Prompts are built by
`engine.chat_prompt` (no special token but the template's), off the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.api import openai_chat
from engine.api.config import TRAFFIC_CLASSES, ApiConfig
from engine.api.openai_chat import ApiError
from engine.api.runner import EngineRunner, Generation
from engine.chat_prompt import ChatPromptError, encode_chat
from engine.real_text import stop_token_ids


def create_app(runner: EngineRunner, tokenizer: Any, config: ApiConfig) -> FastAPI:
    app = FastAPI(title="kvstore-serve")
    stop_ids = sorted(stop_token_ids(tokenizer))  # the end of the model's turn, the end of sequence
    tokenize = ThreadPoolExecutor(2, thread_name_prefix="tokenize")  # templates and tokenizers off the loop

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _tenant(request, config)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvstore"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = _tenant(request, config)
        traffic = request.headers.get("x-traffic-class", "chat")
        if traffic not in TRAFFIC_CLASSES:
            raise ApiError(400, f"X-Traffic-Class must be one of {TRAFFIC_CLASSES}, got {traffic!r}")
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        chat = openai_chat.parse(body, stop_ids)
        if chat.model != config.model_name:
            raise ApiError(404, f"the model {chat.model!r} does not exist; this server serves {config.model_name!r}",
                           "model", "not_found_error")
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(tokenize, encode_chat, tokenizer, chat.messages)
        except ChatPromptError as exc:
            raise ApiError(400, str(exc), "messages") from None
        events: asyncio.Queue = asyncio.Queue()
        runner.generate(Generation(
            ids, chat.sampling, tenant, traffic,
            on_token=lambda token: loop.call_soon_threadsafe(events.put_nowait, ("token", token)),
            on_done=lambda result, error: loop.call_soon_threadsafe(events.put_nowait, ("done", (result, error)))))
        text = openai_chat.ReplyText(tokenizer.decode, stop_ids, chat.sampling.stop)
        rid = openai_chat.completion_id()
        if not chat.stream:
            result = await _finished(events, text)
            usage = openai_chat.usage(len(ids), len(result.tokens), result.cached_tokens)
            return openai_chat.completion(rid, chat.model, text.finish(), result.finish_reason, usage)
        first = await events.get()  # a request the engine refuses is an error status, not a broken stream
        if first[0] == "done" and first[1][1] is not None:
            raise ApiError(400, first[1][1])
        return StreamingResponse(_stream(first, events, text, rid, chat, len(ids)), media_type="text/event-stream")

    return app


def _tenant(request: Request, config: ApiConfig) -> str:
    """The tenant of the request's API key (its namespace salt); the one open tenant when none are set."""
    if not config.api_keys:
        return ""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    tenant = config.api_keys.get(key) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise ApiError(401, "invalid API key", kind="authentication_error")
    return tenant


async def _finished(events: asyncio.Queue, text: openai_chat.ReplyText):
    while True:
        kind, value = await events.get()
        if kind == "token":
            text.push(value)
            continue
        result, error = value
        if error is not None:
            raise ApiError(400, error)
        return result


async def _stream(first: tuple, events: asyncio.Queue, text: openai_chat.ReplyText, rid: str,
                  chat: openai_chat.ChatRequest, prompt_tokens: int) -> AsyncIterator[bytes]:
    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    yield event(openai_chat.chunk(rid, chat.model, {"role": "assistant", "content": ""}))
    item = first
    while True:
        kind, value = item
        if kind == "token":
            if new := text.add(value):
                yield event(openai_chat.chunk(rid, chat.model, {"content": new}))
        else:
            result, error = value
            if error is not None:  # after the stream began: the API's error object as an event
                yield event(ApiError(500, error, kind="server_error").body())
                break
            if rest := text.finish():
                yield event(openai_chat.chunk(rid, chat.model, {"content": rest}))
            yield event(openai_chat.chunk(rid, chat.model, {}, result.finish_reason))
            if chat.include_usage:
                usage = openai_chat.usage(prompt_tokens, len(result.tokens), result.cached_tokens)
                yield event(openai_chat.chunk(rid, chat.model, {}, usage_=usage))
            break
        item = await events.get()
    yield b"data: [DONE]\n\n"


def build(config: ApiConfig) -> tuple[EngineRunner, Any]:
    """The engines (on the store when config.servers) and the tokenizer."""
    from engine.decode import DecodeConfig
    from engine.prefill import PrefillConfig, PrefillEngine

    if config.model is None:
        from engine.real_model import load_real_model

        folder, tokenizer = load_real_model()
    else:
        import transformers

        folder, tokenizer = config.model, transformers.AutoTokenizer.from_pretrained(config.model)
    client = None
    if config.servers:
        from kvstore.client import KVClient

        client = KVClient(list(config.servers))
    prefill = PrefillEngine.from_pretrained(folder, client, PrefillConfig(block_tokens=config.block_tokens,
                                                                          kv_pages=config.kv_pages))
    runner = EngineRunner(prefill, DecodeConfig(max_running=config.max_running, detokenize=tokenizer.decode))
    return runner, tokenizer


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
    runner, tokenizer = build(config)
    uvicorn.run(create_app(runner, tokenizer, config), host=config.host, port=config.port, log_level="warning")
