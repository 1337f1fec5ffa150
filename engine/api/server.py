"""The HTTP server: OpenAI Chat Completions and Responses, Anthropic Messages, over the engines.

    kvstore-api [--model DIR] [--servers host:port,...] [--api-key KEY=TENANT ...] [--port 8000]

(`kvstore-serve`, its name before, still works for one release and says so; `kvstore-server` is the daemon.)

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

import asyncio
import contextlib
import dataclasses
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api import anthropic_messages, openai_chat, openai_responses
from engine.api.config import TRAFFIC_CLASSES, ApiConfig, parse_args
from engine.api.conversation import Message, Prompt, Reply
from engine.api.errors import ApiError
from engine.api.fair import FairGate
from engine.api.metrics import TENANT
from engine.api.service import Service
from engine.api.store_state import REACHABLE, StoreState
from engine.vision.images import DecodeBudget, ImageLimits
from engine.vision.stage import VisionStage
from kvstore.startup import exit_at_startup, port_in_use

if TYPE_CHECKING:
    from kvstore.block import Block
    from kvstore.client import StoreClient

DISCONNECT_POLL_S = 1.0  # how often a request not yet streaming checks that its client is still there
T = TypeVar("T")
APIS = ("chat", "responses", "messages", "models")
Event = list[int] | str | Reply  # what Service.generate yields: the prompt's ids, then text, then the Reply


def create_app(service: Service, config: ApiConfig) -> FastAPI:
    stored = openai_responses.ResponseStore(config.max_stored_responses, config.max_stored_bytes)
    stop_ids = service.stop_token_ids

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        sweeper = asyncio.create_task(_sweep(service, config.sweep_interval_s))
        watcher = asyncio.create_task(service.store.watch()) if service.store.client is not None else None
        yield
        sweeper.cancel()
        if watcher is not None:
            watcher.cancel()

    app = FastAPI(title="kvstore-api", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Counted, metrics=service.metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        render = anthropic_messages.error_body if _api(request.url.path) == "messages" else openai_chat.error_body
        return JSONResponse(render(exc), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown routes, methods
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await api_error(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                                 kind=kind))

    @app.exception_handler(Exception)
    async def fault(request: Request, exc: Exception) -> JSONResponse:  # a bug: still the API's error shape
        return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

    @app.get("/health")
    async def health() -> dict:
        # 200 whatever the store's state: serving without a cache is correct, only slower; the body says it
        store = service.store
        body: dict[str, Any] = {"status": "ok", "store": store.state}
        if store.client is not None:
            body["daemons"] = {name: why or "answered" for name, why in store.daemons.items()}
        return body

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # every tenant's counts for the operator's keys; a tenant's own (and the server's gauges) for its key
        operator = not config.api_keys or _key(request) in config.metrics_keys
        tenant = None if operator else _tenant(request, config)
        return Response(service.metrics.exposition(tenant), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _tenant(request, config)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvstore", "type": "model", "display_name": config.model_name,
                                            "created_at": "1970-01-01T00:00:00Z"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant, body = await _read(request, config, service)
        prompt = _served(_parsed(openai_chat.parse, body, stop_ids), config)
        rid = openai_chat.completion_id()
        return await _answer(service, request, prompt, tenant,
                             lambda reply, _: openai_chat.completion(reply, rid, prompt.model),
                             openai_chat.ChatStream(rid, prompt.model, prompt))

    @app.post("/v1/messages")
    async def messages(request: Request):
        tenant, body = await _read(request, config, service)
        prompt = _served(_parsed(anthropic_messages.parse, body, stop_ids), config)
        rid = anthropic_messages.message_id()
        return await _answer(service, request, prompt, tenant,
                             lambda reply, _: anthropic_messages.message(reply, rid, prompt.model),
                             anthropic_messages.MessageStream(rid, prompt.model))

    @app.post("/v1/responses")
    async def responses(request: Request):
        tenant, body = await _read(request, config, service)
        asked = _parsed(openai_responses.parse, body, stop_ids)
        conversation = stored.conversation(tenant, asked.previous_response_id, _served(asked.prompt, config))
        prompt = dataclasses.replace(asked.prompt, messages=conversation)
        rid = openai_responses.response_id()
        traffic = _traffic(request, prompt)

        stream = openai_responses.ResponseStream(rid, prompt.model, asked.prompt, asked.previous_response_id)

        def finished(reply: Reply, ids: list[int]) -> dict:
            # one object for the stream's end, the answer and GET: the same created_at and completed_at
            out = openai_responses.response(reply, rid, prompt.model, asked.prompt, asked.previous_response_id,
                                            stream.created_at, True if stream.opened else None)
            stream.final = out
            if asked.store:
                said = Message("assistant", reply.text, tuple(reply.tool_calls))
                stored.put(tenant, rid, openai_responses.StoredResponse([*prompt.messages, said], out,
                                                                        ids + reply.tokens, traffic))
            return out

        try:
            return await _answer(service, request, prompt, tenant, finished, stream)
        except ApiError as exc:  # the engine's words for a field: this API's
            raise openai_responses.engine_error(exc) from None

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request) -> dict:
        return stored.get(_tenant(request, config), rid).body

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request) -> dict:
        tenant = _tenant(request, config)
        tokens = stored.get(tenant, rid).tokens  # 404 for a response the tenant does not have
        stored.delete(tenant, rid)
        service.close_conversation(tenant, tokens)  # the store: it does not go on
        return openai_responses.deleted(rid)

    return app


async def _answer(service: Service, request: Request, prompt: Prompt, tenant: str,
                  render: Callable[[Reply, list[int]], dict], stream) -> Response:
    """Generate the prompt's reply: the API's object, or its event stream. An engine's refusal before the
    first token is an error status; a client that goes away cancels the generation."""
    events = service.generate(prompt, tenant, _traffic(request, prompt),
                              overloaded=529 if _api(request.url.path) == "messages" else 429)
    # ApiError here (a refused prompt, too many in flight) is an error status
    ids = await _while_connected(anext(events), request)
    if not isinstance(ids, list):
        raise AssertionError("a generation begins with the prompt's ids")
    if not prompt.stream:
        reply = await _while_connected(_until_reply(events), request)
        return JSONResponse(render(reply, ids))
    # queued, waiting for a fair share, prefilling: a client gone meanwhile cancels it now, not at the
    # first token; ApiError here is still an error status, not a broken stream
    first = await _while_connected(anext(events), request)
    return StreamingResponse(_events(first, events, stream, render, ids), media_type="text/event-stream")


async def _until_reply(events: AsyncIterator[Event]) -> Reply:
    async for item in events:
        if isinstance(item, Reply):
            return item
    raise AssertionError("a generation ends with its Reply")


async def _while_connected(step: Awaitable[T], request: Request) -> T:
    """`step`'s result, checking every DISCONNECT_POLL_S that the client is still there; if it is not, `step`
    is cancelled (and with it the generation, by the generator's clean-up) and the answer is 499."""
    task = asyncio.ensure_future(step)
    while not (await asyncio.wait([task], timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ApiError(499, "the client went away")
    return task.result()


async def _events(first: Event, events: AsyncIterator[Event], stream, render, ids: list[int]
                  ) -> AsyncIterator[bytes]:
    yield stream.start(len(ids), 0)  # cached tokens are known once the prefill is done: the end says them
    item = first
    try:
        while True:
            if isinstance(item, Reply):
                render(item, ids)  # what a non-streamed request would have got (and, for Responses, stored)
                yield stream.finish(item)
                return
            if isinstance(item, str):  # the ids came first, before the stream
                yield stream.text(item)
            item = await anext(events)
    except ApiError as exc:  # after the stream began: the API's error event
        yield stream.error(ApiError(500, exc.message, kind="server_error"))
    except Exception as exc:  # a bug after the stream began: still the API's error event, not a cut stream
        yield stream.error(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))


async def _sweep(service: Service, interval_s: float) -> None:
    """Conversations idle past their class's limit: the store is told they end."""
    while True:
        await asyncio.sleep(interval_s)
        if service.advisor is not None:
            service.advisor.sweep(time.monotonic())


def _api(path: str) -> str:
    """The API a path belongs to: a fixed set, so metrics labels stay bounded whatever paths come."""
    api = path.removeprefix("/v1/").split("/")[0]
    return api if api in APIS else "other"


async def _read(request: Request, config: ApiConfig, service: Service) -> tuple[str, Any]:
    """The tenant, and the body as JSON: at most config.max_body_bytes, finite numbers, no lone surrogate,
    nested at most config.max_json_depth deep, no array or object of more than config.max_array_items.
    What costs nothing is checked first, so a request bound to fail costs little: the key, the size, the
    tenant's and the server's requests in flight (before the body is read), then the model (before the
    body's shape is checked and long before it is parsed)."""
    from engine.api.body import check_shape, decode

    tenant = _tenant(request, config)
    too_big = ApiError(413, f"the request body passes {config.max_body_bytes} bytes")
    if int(request.headers.get("content-length") or 0) > config.max_body_bytes:
        raise too_big
    messages = _api(request.url.path) == "messages"
    full = sum(service.in_flight.values()) >= service.max_in_flight
    if full or service.in_flight[tenant] >= service.max_in_flight_per_tenant:  # generate checks again, to hold it
        raise ApiError(529 if messages else 429, "too many requests in flight; retry later",
                       kind="overloaded_error" if messages else "rate_limit_error")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > config.max_body_bytes:
            raise too_big
    # in a thread: a 4 MiB body takes a while to decode and walk, and the loop goes on serving meanwhile
    value = await asyncio.to_thread(decode, bytes(body))
    if isinstance(value, dict) and isinstance(value.get("model"), str) and value["model"] != config.model_name:
        raise ApiError(404, f"the model {value['model'][:200]!r} does not exist; this server serves "
                            f"{config.model_name!r}", "model", "not_found_error")
    await asyncio.to_thread(check_shape, value, config.max_json_depth, config.max_array_items, messages)
    return tenant, value


def _parsed(parse: Callable[[Any, Sequence[int]], Any], body: Any, stop_ids: Sequence[int]) -> Any:
    """An API module's parse; a body of the wrong shape where it did not look is still a 400, not a 500."""
    try:
        return parse(body, stop_ids)
    except (TypeError, AttributeError, KeyError, IndexError) as exc:
        raise ApiError(400, f"malformed request ({type(exc).__name__}: {exc})"[:500]) from None


class _Counted:
    """Counts responses by API and status (a plain ASGI middleware: Starlette's BaseHTTPMiddleware would
    hide a client's disconnect from the handlers, and a request would run on without its client)."""

    def __init__(self, app, metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(_api(scope["path"]), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


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
    """The tenant of the request's API key (its namespace salt); the one open tenant when none are set. The
    request's metrics are counted for it from here on (metrics.TENANT)."""
    if not config.api_keys:
        return ""
    tenant = config.api_keys.get(_key(request))
    if tenant is None:
        raise ApiError(401, "invalid API key", kind="authentication_error")
    TENANT.set(tenant)
    return tenant


def _key(request: Request) -> str:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")


def build(config: ApiConfig) -> Service:
    """The engines (on the store when config.servers), the prompt encoder's processes and the advisor."""
    from engine.api.advice import Advisor
    from engine.api.tokenize import PromptEncoder
    from engine.checkpoints.real_model import load_real_model, load_tokenizer
    from engine.decode import DecodeConfig
    from engine.model.decoder import Decoder
    from engine.model.weights import model_identity
    from engine.prefill import PrefillConfig, PrefillEngine
    from engine.prefill.cost import ChunkCost
    from engine.prefill.engine import stored_block_bytes
    from engine.serving.loop import ServingLoop
    from engine.speculative.profile import GRID, ObservedSps, SpsProfile
    from engine.text.real_text import stop_token_ids

    folder, tokenizer = load_real_model() if config.model is None else (config.model, load_tokenizer(config.model))
    model = Decoder.from_pretrained(folder, config.dtype)
    client = advisor = None
    if config.servers:
        from kvstore.client import ClientConfig, KVClient
        from kvstore.client.config import security_from_environment

        slot = stored_block_bytes(model, config.block_tokens, config.kv_codec)
        host: dict[str, Any] = {"host_tier_bytes": config.host_tier_bytes,
                                "host_block_bytes": slot} if config.host_tier_bytes else {}
        # a secured cluster's token and CA come from KVSTORE_TOKEN, KVSTORE_TLS_CA, ... (docs/operations.md)
        client = store = KVClient(ClientConfig(tuple(config.servers), **host, **security_from_environment()))
    cost = ChunkCost(*config.chunk_cost) if config.chunk_cost else None
    prefill = PrefillEngine(model, client, PrefillConfig(block_tokens=config.block_tokens, kv_pages=config.kv_pages,
                                                         cost=cost, kv_codec=config.kv_codec), model_identity(folder))
    if client is not None:
        advising = ThreadPoolExecutor(1, thread_name_prefix="advise")  # the client blocks; the loop must not

        def advise(blocks: Sequence[Block], goes_on: bool) -> None:
            advising.submit(store.advise, blocks, goes_on)  # the daemons promote what goes on into DRAM
            if goes_on:  # and this process reads its blocks and window record ahead of the next turn
                advising.submit(prefill.prefetch, blocks)

        advisor = Advisor(advise, config.idle_s)
    # a given SPS profile is corrected by the engine's timed forwards as a measured one is; none: the decode
    # engine loads or measures its own
    sps = ObservedSps(SpsProfile(GRID, config.sps_profile)) if config.sps_profile else None
    runner = ServingLoop(prefill.model, prefill, DecodeConfig(max_running=config.max_running,
                                                              detokenize=tokenizer.decode,
                                                              speculative=config.speculative,
                                                              sps=sps))
    encoder = PromptEncoder(folder, config.tokenize_workers)
    return Service(runner, tokenizer, encoder, sorted(stop_token_ids(tokenizer)), advisor, config.max_in_flight,
                   config.max_in_flight_per_tenant, FairGate(config.max_running, config.reserve),
                   StoreState(client, config.store_probe_s), _vision_stage(config, model.config.hidden_size, client),
                   ImageLimits(config.max_images, config.max_image_bytes, config.max_image_pixels),
                   DecodeBudget(config.image_decode_bytes, config.image_decode_bytes_per_tenant))


def _vision_stage(config: ApiConfig, text_hidden: int, client: StoreClient | None) -> VisionStage | None:
    """The stage image parts go through (engine/vision), where config.vision names a tower."""
    if config.vision is None:
        return None
    from engine.vision.client import EncoderClient
    from engine.vision.presets import vision_config
    from engine.vision.tower import VisionTower
    from kvstore.client.config import security_from_environment

    tower = VisionTower.random(vision_config(config.vision, text_hidden, config.vision_seed))
    remote = None
    if config.vision_encoder is not None:
        security = security_from_environment()
        remote = EncoderClient(config.vision_encoder, token=security.get("token"), tls_ca=security.get("tls_ca"))
    return VisionStage(tower, client, remote)


def report_store(prog: str, service: Service) -> None:
    """At start-up, say which of the store's daemons answered and which did not (why), or that there is none:
    caching that is off must not look like caching that is on."""
    store = service.store
    if store.client is None:
        print(f"{prog}: no store (--servers): every prompt is computed", file=sys.stderr, flush=True)
        return
    found = store.probe(log_change=False)
    advice = "" if found.state == REACHABLE else "; prompts are computed without the cache until it answers"
    print(f"{prog}: {found.line()}{advice}", file=sys.stderr, flush=True)


class _Stopped(Exception):
    """SIGTERM or SIGINT: stop, closing what was started."""


def _stop(signum: int, _frame) -> None:
    raise _Stopped(signal.Signals(signum).name)


def http_settings(config: ApiConfig) -> dict[str, Any]:
    """uvicorn's settings for `config`: the address, the connection guard, the shutdown's grace. `main` runs the
    app with them, and the tests serve through them too, so that they test the server `main` builds."""
    from engine.api.connections import guarded

    return dict(host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5,
                http=guarded(config))


def main(argv: Sequence[str] | None = None, prog: str = "kvstore-api") -> None:
    """Serve until SIGTERM or SIGINT, then exit 0 with every process and thread it started ended. During
    start-up the signal interrupts it at once; while serving, uvicorn takes it first (requests in flight get
    5 s), then hands it back to `_stop` once it has shut down."""
    import uvicorn

    config = parse_args(argv, prog)
    try:  # before the model loads: a port in use is said at once, and "serving" is said only once it is ours
        listening = listen(config.host, config.port)
    except OSError as exc:
        exit_at_startup(prog, str(port_in_use("the HTTP API", "--port", config.host, config.port, exc)))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    service = None
    try:
        service = build(config)
        report_store(prog, service)
        prefill = service.runner.prefill  # kvstore-api always has one
        fitted = "" if prefill is None else (f" (chunk cost {prefill.cost.a:.3g},{prefill.cost.b:.3g},"
                                             f"{prefill.cost.c:.3g}: --chunk-cost skips the start-up fit)")
        port = listening.getsockname()[1]
        print(f"{prog}: serving {config.model_name} on http://{config.host}:{port}{fitted}", flush=True)
        # uvicorn.run's Config and Server, serving on the socket bound above (uvicorn.run cannot take one)
        server = uvicorn.Server(uvicorn.Config(create_app(service, config), **http_settings(config)))
        server.run(sockets=[listening])
        if not server.started:  # as uvicorn.run ends then: its log said why
            sys.exit(3)
    except _Stopped as stopped:
        print(f"{prog}: {stopped}: stopped", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if service is not None:
            service.close()
        listening.close()


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (connections wait in its backlog until uvicorn serves)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart's TIME_WAIT is no bar
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def deprecated_main(argv: Sequence[str] | None = None) -> None:
    """`kvstore-serve`, the old name, kept for one release: one letter from the daemon's `kvstore-server`."""
    print("kvstore-serve is now kvstore-api; the old name goes in the next release", file=sys.stderr, flush=True)
    main(argv, "kvstore-serve")


if __name__ == "__main__":
    main()
