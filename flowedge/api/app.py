"""The routes of `flowedge http` (see flowedge/api/__init__.py for the parts).

    GET  /health                503 until the cluster is ready, then 200 (no API key needed)
    GET  /metrics               Prometheus text format
    GET  /v1/models             the one model the cluster serves
    POST /v1/chat/completions   OpenAI chat completions (messages through the chat template), stream or not
    POST /v1/completions        OpenAI text completions (the prompt as is, no template), stream or not
    GET  /v1/status             the head's status (`flowedge status --json`)

Each generation request opens its own AsyncClient on one shared zmq.asyncio context, so nothing
blocks the event loop and the head sees one client per HTTP request. A stream whose HTTP client
disconnects is cancelled at the head (AsyncClient sends `Cancel`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import anyio
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flowedge.api.guard import RequestGuard, error_body
from flowedge.api.metrics import ApiMetrics
from flowedge.api.schema import ChatRequest, CompletionRequest, Reply
from flowedge.api.settings import ApiSettings
from flowedge.daemon.async_client import AsyncClient
from flowedge.daemon.client import RequestFailed
from flowedge.errors import FlowedgeError, ProtocolError

log = logging.getLogger(__name__)

UNAVAILABLE = ("cluster not ready", "request aborted")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, outcome: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.outcome = status, kind, outcome


def classify(err: Exception) -> ApiError:
    """A flowedge error as the HTTP answer it deserves: the client's mistake 400, the cluster's 503."""
    text = str(err)
    if isinstance(err, ProtocolError):
        return ApiError(400, text, "invalid_request_error", "client_error")
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


def create_app(settings: ApiSettings) -> FastAPI:
    metrics = ApiMetrics()
    ctx = zmq.asyncio.Context()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        ctx.destroy(linger=0)

    app = FastAPI(title="flowedge", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.settings, app.state.metrics = settings, metrics

    def client(timeout_s: float | None = None) -> AsyncClient:
        return AsyncClient(settings.head, keys_dir=settings.keys_dir, insecure=settings.insecure,
                           timeout_s=timeout_s or settings.request_timeout_s, context=ctx)

    async def head_status() -> list[dict] | None:
        c = client(settings.status_timeout_s)
        try:
            return await c.status()
        except (FlowedgeError, ProtocolError):
            return None
        finally:
            c.close()

    def refused(status: int) -> None:
        metrics.requests.labels("-", "unauthorized" if status == 401 else "client_error").inc()

    app.add_middleware(RequestGuard, settings=settings, on_refused=refused)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid request body")
        metrics.requests.labels(request.url.path, "client_error").inc()
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        metrics.requests.labels(request.url.path, err.outcome).inc()
        if err.outcome in ("unavailable", "failed"):
            metrics.failures.labels(err.outcome).inc()
        return JSONResponse(error_body(str(err), err.kind), status_code=err.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        nodes = await head_status()
        ready = bool(nodes and nodes[0].get("ready"))
        body = {"status": "ready" if ready else ("not ready" if nodes else "head unreachable")}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        metrics.cluster(await head_status())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/status")
    async def status() -> JSONResponse:
        nodes = await head_status()
        if nodes is None:
            raise ApiError(503, f"the head at {settings.head} does not answer", "service_unavailable",
                           "unavailable")
        return JSONResponse({"nodes": nodes})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        nodes = await head_status()
        if not nodes:
            raise ApiError(503, f"the head at {settings.head} does not answer", "service_unavailable",
                           "unavailable")
        return JSONResponse({"object": "list", "data": [
            {"id": str(nodes[0].get("model", "")), "object": "model", "created": 0, "owned_by": "flowedge"}]})

    async def model_name() -> str:
        nodes = await head_status()
        return str(nodes[0].get("model", "")) if nodes else ""

    async def answer(request: Request, body: ChatRequest | CompletionRequest, chat: bool) -> Response:
        kwargs = body.client_kwargs(settings.default_max_tokens)
        reply = Reply(chat, body.model or await model_name())
        endpoint = request.url.path
        c = client()
        metrics.in_flight.inc()
        pieces = c.stream(**kwargs)
        if not body.stream:
            return await whole(request, reply, pieces, c, endpoint)
        try:
            first = await anext(pieces, None)
        except (FlowedgeError, ProtocolError) as err:
            await _close(pieces, c, metrics)
            raise classify(err) from None
        except BaseException:
            await _close(pieces, c, metrics)
            raise
        return EventStream(events(reply, first, pieces, c, body.include_usage, endpoint))

    async def whole(request: Request, reply: Reply, pieces: AsyncIterator[str], c: AsyncClient,
                    endpoint: str) -> Response:
        """The answer in one JSON body; a client that disconnects meanwhile has its request cancelled."""
        collect = asyncio.ensure_future(_join(pieces))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                collect.cancel()   # the generator's cleanup sends Cancel to the head
                await asyncio.gather(collect, return_exceptions=True)
                metrics.requests.labels(endpoint, "cancelled").inc()
                log.info("%s: the client went away; request cancelled at the head", endpoint)
                return Response(status_code=499)
            text = collect.result()
        except (FlowedgeError, ProtocolError) as err:
            raise classify(err) from None
        finally:
            gone.cancel()
            await _close(pieces, c, metrics)
        result = c.last_result or {}
        metrics.answered(result)
        metrics.requests.labels(endpoint, "ok").inc()
        return JSONResponse(reply.whole({**result, "text": text}))

    async def events(reply: Reply, first: str | None, pieces: AsyncIterator[str], c: AsyncClient,
                     include_usage: bool, endpoint: str) -> AsyncIterator[bytes]:
        outcome = "cancelled"
        try:
            if reply.chat:
                yield sse(reply.chunk(None, first=True))
            if first:
                yield sse(reply.chunk(first))
            async for piece in pieces:
                yield sse(reply.chunk(piece))
            result = c.last_result or {}
            yield sse(reply.chunk(None, result.get("finish_reason", "stop")))
            if include_usage:
                yield sse(reply.usage_chunk(result))
            yield sse("[DONE]")
            metrics.answered(result)
            outcome = "ok"
        except (FlowedgeError, ProtocolError) as err:
            api = classify(err)
            outcome = api.outcome
            yield sse(error_body(str(err), api.kind))
            yield sse("[DONE]")
        finally:
            metrics.requests.labels(endpoint, outcome).inc()
            if outcome == "cancelled":
                log.info("%s: the client went away mid-stream; request cancelled at the head", endpoint)
            await _close(pieces, c, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        return await answer(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        if body.echo:
            raise ApiError(400, "echo is not supported", "invalid_request_error", "client_error")
        return await answer(request, body, chat=False)

    return app


async def _join(pieces: AsyncIterator[str]) -> str:
    return "".join([p async for p in pieces])


async def _disconnected(request: Request) -> None:
    """Returns once the HTTP client has gone (the body was already read by the guard)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _close(pieces, c: AsyncClient, metrics: ApiMetrics) -> None:
    """End one request: its stream (sends Cancel if it had not finished), its socket, the in-flight count."""
    try:
        await pieces.aclose()
    finally:
        c.close()
        metrics.in_flight.dec()
