"""The routes of `flowedge http` (see flowedge/api/__init__.py for the parts).

    GET  /health                503 until the cluster is ready, then 200 (no API key needed)
    GET  /metrics               Prometheus text format
    GET  /v1/models             the one model the cluster serves
    POST /v1/chat/completions   OpenAI chat completions (messages through the chat template), stream or not
    POST /v1/completions        OpenAI text completions (the prompt as is, no template), stream or not
    GET  /v1/status             the head's status (`flowedge status --json`)
    GET  /v1/status/stream      the same every half second, as server-sent events (the dashboard's feed)
    GET  /v1/timeline           the head's last ten minutes, a sample a second (what a page opened late draws)
    GET  /                      the live dashboard (flowedge/api/dashboard.py, static files in api/static/)

Each generation request opens its own AsyncClient on one shared link to the head, so nothing
blocks the event loop and the head sees one client per HTTP request. A stream whose HTTP client
disconnects is cancelled at the head (AsyncClient sends `Cancel`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from flowedge.api import dashboard
from flowedge.api.body_errors import readable
from flowedge.api.clients import RETRY_AFTER_S as BUSY_RETRY_AFTER_S, busy, client_name
from flowedge.api.guard import RequestGuard, error_body
from flowedge.api.headers import SecurityHeaders
from flowedge.api.metrics import ApiMetrics
from flowedge.api.schema import ChatRequest, CompletionRequest, Reply
from flowedge.api.settings import ApiSettings
from flowedge.client.async_client import AsyncClient, AsyncLink, client_link
from flowedge.client.client_core import prompt_request
from flowedge.errors import (ApiError, Busy, ClusterNotReady, ContextOverflow, FlowedgeError, HeadUnreachable,
                             ProtocolError, RequestFailed)

log = logging.getLogger(__name__)

UNAVAILABLE = ("cluster not ready", "request aborted")
RETRY_AFTER_S = 10   # a cluster missing a stage: about when a restarted stage is back (its supervisor's first tries)
OVERFLOW_START = "This model's maximum context length is"   # OpenAI's wording, which client libraries match on


def classify(err: Exception) -> ApiError:
    """A flowedge error as the HTTP answer it deserves: the client's mistake 400, its full queue 429, the
    cluster's 503."""
    text = str(err)
    if isinstance(err, Busy):
        return busy(err)
    if isinstance(err, ContextOverflow):
        text = text.removeprefix(ContextOverflow.PREFIX)
        code = "context_length_exceeded" if text.startswith(OVERFLOW_START) else None
        return ApiError(400, text, "invalid_request_error", "client_error", code=code,
                        param="messages" if code else None)
    if isinstance(err, ClusterNotReady):
        return ApiError(503, text, "service_unavailable", "unavailable", code="cluster_not_ready",
                        headers={"retry-after": str(RETRY_AFTER_S)})
    if isinstance(err, ProtocolError):
        return ApiError(400, text, "invalid_request_error", "client_error")
    if isinstance(err, HeadUnreachable):   # for longer than a client's retry back-off: fail at once
        return ApiError(503, text, "service_unavailable", "unavailable", headers={"x-should-retry": "false"})
    if isinstance(err, RequestFailed):
        if text.startswith(UNAVAILABLE):
            return ApiError(503, text, "service_unavailable", "unavailable")
        if text.startswith("internal error"):
            return ApiError(500, text, "server_error", "failed")
        return ApiError(400, text, "invalid_request_error", "client_error")
    return ApiError(503, text, "service_unavailable", "unavailable")


class EventStream(StreamingResponse):
    """Server-sent events that stop (and cancel the request at the head) when the client disconnects,
    whatever ASGI version the server speaks."""

    media_type = "text/event-stream"
    body_iterator: AsyncGenerator[bytes, None]   # Routes.events: closed here, so the request is cancelled

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                finally:
                    group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        await self.body_iterator.aclose()


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def served_names(model_id: str) -> list[str]:
    """The names the served model answers to: its name (the last part of the head's model id, which is
    often a path) first, then the id itself."""
    short = model_id.rstrip("/").rsplit("/", 1)[-1]
    return [model_id] if short == model_id else [short, model_id]


def model_name(model_id: str) -> str:
    """The name a client sees (/v1/models, each answer's `model`): never a path on the head's disk."""
    return served_names(model_id)[0]


def answers_to(model_id: str, asked: str) -> bool:
    return asked in served_names(model_id)


def unavailable(head: str) -> ApiError:
    return ApiError(503, f"the head at {head} does not answer", "service_unavailable", "unavailable")


class Routes:
    """The endpoints' handlers, sharing the settings, the metrics and one link to the head."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self.metrics = ApiMetrics()
        self._link: AsyncLink | None = None   # made at the first call (missing keys fail that call, as before)
        self._model: str | None = None

    def client(self, timeout_s: float | None = None, client: str = "") -> AsyncClient:
        """A connection to the head; `client` names whom its requests are for (api/clients.py)."""
        s = self.settings
        if self._link is None:
            self._link = client_link(s.keys_dir, s.insecure)
        return AsyncClient(s.head, timeout_s=timeout_s or s.request_timeout_s, client=client, link=self._link)

    def close_link(self) -> None:
        if self._link is not None:
            self._link.close()

    async def head_status(self, timeline: bool = False) -> list[dict] | None:
        c = self.client(self.settings.status_timeout_s)
        try:
            return await c.status(timeline)
        except (FlowedgeError, ProtocolError):
            return None
        finally:
            c.close()

    def refused(self, status: int) -> None:
        outcome = {401: "unauthorized", 429: "rate_limited"}.get(status, "client_error")
        self.metrics.requests.labels("-", outcome).inc()

    # ---- error handlers -----------------------------------------------------------------------
    async def bad_body(self, request: Request, err: RequestValidationError) -> JSONResponse:
        """The first problem with a body, OpenAI's way: the message, and the field it is about."""
        first = err.errors()[0] if err.errors() else {}
        self.metrics.requests.labels(request.url.path, "client_error").inc()
        if first.get("type") == "json_invalid":   # its loc is a byte offset, not a field
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'invalid')}"
            return JSONResponse(error_body(message, code="invalid_json"), status_code=400)
        said = readable(first)
        return JSONResponse(error_body(said.message, param=said.param, code=said.code), status_code=400)

    async def http_error(self, request: Request, err: HTTPException) -> JSONResponse:
        """Unknown routes (404) and methods (405) in OpenAI's error shape, not FastAPI's {"detail": ...}."""
        self.metrics.requests.labels("-", "client_error").inc()
        if err.status_code == 404:
            message, code = f"no route {request.url.path} (the API is under /v1)", "unknown_url"
        elif err.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(err.detail), None
        return JSONResponse(error_body(message, code=code), status_code=err.status_code, headers=err.headers)

    async def api_error(self, request: Request, err: ApiError) -> JSONResponse:
        self.metrics.requests.labels(request.url.path, err.outcome).inc()
        if err.outcome in ("unavailable", "failed"):
            self.metrics.failures.labels(err.outcome).inc()
        headers = {"retry-after": str(BUSY_RETRY_AFTER_S)} if err.status == 429 else {}   # its queue is full
        return JSONResponse(error_body(str(err), err.kind, code=err.code, param=err.param), status_code=err.status,
                            headers={**headers, **err.headers})

    # ---- cluster --------------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        nodes = await self.head_status()
        ready = bool(nodes and nodes[0].get("ready"))
        body = {"status": "ready" if ready else ("not ready" if nodes else "head unreachable")}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics_text(self) -> Response:
        self.metrics.cluster(await self.head_status())
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def status(self) -> JSONResponse:
        nodes = await self.head_status()
        if nodes is None:
            raise unavailable(self.settings.head)
        return JSONResponse({"nodes": nodes})

    async def timeline(self) -> JSONResponse:
        nodes = await self.head_status(timeline=True)
        if not nodes:
            raise unavailable(self.settings.head)
        return JSONResponse(dashboard.timeline_of(nodes[0]))

    async def status_stream(self) -> Response:
        return EventStream(dashboard.status_events(self.head_status), headers={"cache-control": "no-cache"})

    async def models(self) -> JSONResponse:
        nodes = await self.head_status()
        if not nodes:
            raise unavailable(self.settings.head)
        head = nodes[0]
        created = head.get("model_created") or head.get("started_unix") or 0
        return JSONResponse({"object": "list", "data": [
            {"id": model_name(str(head.get("model", ""))), "object": "model", "created": int(created),
             "owned_by": "flowedge"}]})

    # ---- generation -----------------------------------------------------------------------------
    async def chat_completions(self, request: Request, body: ChatRequest) -> Response:
        return await self.answer(request, body, chat=True)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        if body.echo:
            raise ApiError(400, "echo is not supported", "invalid_request_error", "client_error")
        return await self.answer(request, body, chat=False)

    async def served_model(self, asked: str) -> str:
        """The served model's name; 404 model_not_found for a name it does not answer to. The head's id
        is cached (one head serves one model), asked again when a name does not match it."""
        if self._model is None or (asked and not answers_to(self._model, asked)):
            nodes = await self.head_status()
            if nodes:
                self._model = str(nodes[0].get("model", ""))
            elif self._model is None:
                raise classify(HeadUnreachable(f"cannot reach a flowedge head at {self.settings.head}"))
        if asked and not answers_to(self._model, asked):
            raise ApiError(404, f"the model `{asked}` does not exist here; this server serves "
                                f"{', '.join(served_names(self._model))}", "invalid_request_error",
                           "client_error", code="model_not_found", param="model")
        return model_name(self._model)

    async def answer(self, request: Request, body: ChatRequest | CompletionRequest, chat: bool) -> Response:
        kwargs = body.client_kwargs(self.settings.default_max_tokens)
        try:
            # a request that cannot be sent is the client's mistake, whatever model it names
            prompt_request(0, kwargs.get("prompt"), **{k: v for k, v in kwargs.items() if k != "prompt"})
        except (FlowedgeError, ProtocolError) as err:
            raise classify(err) from None
        body.model = await self.served_model(body.model)
        reply = Reply(chat, body.model)
        c = self.client(client=client_name(request.headers.get("authorization"),
                                           request.client.host if request.client else "?", self.settings.api_keys))
        self.metrics.in_flight.inc()
        pieces = c.stream(**kwargs)
        if not body.stream:
            return await self.whole(request, reply, pieces, c)
        try:
            first = await anext(pieces, None)
        except (FlowedgeError, ProtocolError) as err:
            await self.close(pieces, c)
            raise classify(err) from None
        except BaseException:
            await self.close(pieces, c)
            raise
        return EventStream(self.events(request.url.path, reply, first, pieces, c, body.include_usage))

    async def whole(self, request: Request, reply: Reply, pieces: AsyncGenerator[str, None],
                    c: AsyncClient) -> Response:
        """The answer in one JSON body; a client that disconnects meanwhile has its request cancelled."""
        endpoint = request.url.path
        collect = asyncio.ensure_future(_join(pieces))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                collect.cancel()   # the generator's cleanup sends Cancel to the head
                await asyncio.gather(collect, return_exceptions=True)
                self.metrics.requests.labels(endpoint, "cancelled").inc()
                log.info("%s: the client went away; request cancelled at the head", endpoint)
                return Response(status_code=499)
            text = collect.result()
        except (FlowedgeError, ProtocolError) as err:
            raise classify(err) from None
        finally:
            gone.cancel()
            await self.close(pieces, c)
        result = c.last_result.to_dict() if c.last_result else {}
        self.metrics.answered(result)
        self.metrics.requests.labels(endpoint, "ok").inc()
        return JSONResponse(reply.whole({**result, "text": text}))

    async def events(self, endpoint: str, reply: Reply, first: str | None, pieces: AsyncGenerator[str, None],
                     c: AsyncClient, include_usage: bool) -> AsyncIterator[bytes]:
        """The answer as server-sent events; an error after the first byte is an error event."""
        outcome = "cancelled"
        try:
            if reply.chat:
                yield sse(reply.chunk(None, first=True))
            if first:
                yield sse(reply.chunk(first))
            async for piece in pieces:
                yield sse(reply.chunk(piece))
            result = c.last_result.to_dict() if c.last_result else {}
            yield sse(reply.chunk(None, result.get("finish_reason", "stop")))
            if include_usage:
                yield sse(reply.usage_chunk(result))
            yield sse("[DONE]")
            self.metrics.answered(result)
            outcome = "ok"
        except (FlowedgeError, ProtocolError) as err:
            api = classify(err)
            outcome = api.outcome
            yield sse(error_body(str(err), api.kind))
            yield sse("[DONE]")
        finally:
            self.metrics.requests.labels(endpoint, outcome).inc()
            if outcome == "cancelled":
                log.info("%s: the client went away mid-stream; request cancelled at the head", endpoint)
            await self.close(pieces, c)

    async def close(self, pieces: AsyncGenerator[str, None], c: AsyncClient) -> None:
        """End one request: its stream (sends Cancel if it had not finished), its socket, the in-flight count."""
        try:
            await pieces.aclose()
        finally:
            c.close()
            self.metrics.in_flight.dec()


def create_app(settings: ApiSettings) -> FastAPI:
    routes = Routes(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        routes.close_link()

    app = FastAPI(title="flowedge", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.routes = routes
    app.add_middleware(RequestGuard, settings=settings, on_refused=routes.refused)
    app.add_middleware(SecurityHeaders)   # added last: the outermost, so every response carries them
    # the decorator form registers the same handlers: its type says a handler takes the exception it is for
    app.exception_handler(RequestValidationError)(routes.bad_body)
    app.exception_handler(ApiError)(routes.api_error)
    app.exception_handler(HTTPException)(routes.http_error)
    for path, handler in (("/health", routes.health), ("/metrics", routes.metrics_text),
                          ("/v1/status", routes.status), (dashboard.STREAM_PATH, routes.status_stream),
                          (dashboard.TIMELINE_PATH, routes.timeline),
                          ("/v1/models", routes.models)):
        app.add_api_route(path, handler, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    dashboard.mount(app)
    return app


async def _join(pieces: AsyncIterator[str]) -> str:
    return "".join([p async for p in pieces])


async def _disconnected(request: Request) -> None:
    """Returns once the HTTP client has gone (the body was already read by the guard)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
