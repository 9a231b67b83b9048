"""A small HTTP front for gateway apps that do not speak Python: `flowedge http`.

    POST /v1/generate  {"prompt": str, "max_new_tokens": int, "temperature": float, "top_k": int,
                        "top_p": float, "seed": int, "strategy": str, "stream": bool}
        stream=false -> 200 application/json: the same object as `flowedge prompt --json`
        stream=true  -> 200 text/event-stream: `data: {"text": piece}` events, then
                        `data: {"done": true, ...totals}`; an error mid-way is `data: {"error": msg}`
    GET  /v1/status    -> 200 application/json: {"nodes": [...]} as `flowedge status --json`

Bad input is 400 {"error": msg}; an unreachable or failing cluster is 503 {"error": msg}. Each HTTP
request gets its own ZeroMQ client (clients are not thread-safe); the head serves one prompt at a time
and queues the rest.
"""
from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from flowedge.daemon.client import Client, RequestFailed
from flowedge.errors import FlowedgeError

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
FIELDS = {"prompt": str, "max_new_tokens": int, "temperature": (int, float), "top_k": int, "top_p": (int, float),
          "seed": int, "strategy": str, "stream": bool}


class BadRequest(Exception):
    pass


def parse_generate(body: bytes) -> tuple[str, dict, bool]:
    try:
        data = json.loads(body or b"{}")
    except ValueError as err:
        raise BadRequest(f"body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; known: {sorted(FIELDS)}")
    for name, kind in FIELDS.items():
        if name in data and data[name] is not None and (
                not isinstance(data[name], kind) or (kind is int and isinstance(data[name], bool))):
            raise BadRequest(f"{name} has the wrong type")
    prompt = data.pop("prompt", None)
    if not prompt:
        raise BadRequest("prompt is required")
    stream = bool(data.pop("stream", False))
    return prompt, {k: v for k, v in data.items() if v is not None}, stream


def make_handler(head: str, keys_dir=None, insecure: bool = False, timeout_s: float = 300.0):
    class Handler(BaseHTTPRequestHandler):
        server_version = "flowedge"

        def log_message(self, fmt, *args):  # route http.server's access log through logging
            log.info("%s %s", self.address_string(), fmt % args)

        def _json(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _client(self) -> Client:
            return Client(head, keys_dir=keys_dir, insecure=insecure, timeout_s=timeout_s)

        def do_GET(self):
            if self.path != "/v1/status":
                return self._json(404, {"error": f"no such endpoint {self.path}"})
            try:
                with self._client() as c:
                    self._json(200, {"nodes": c.status()})
            except FlowedgeError as err:
                self._json(503, {"error": str(err)})

        def do_POST(self):
            if self.path != "/v1/generate":
                return self._json(404, {"error": f"no such endpoint {self.path}"})
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._json(413, {"error": f"body over {MAX_BODY} bytes"})
            try:
                prompt, kwargs, stream = parse_generate(self.rfile.read(length))
            except BadRequest as err:
                return self._json(400, {"error": str(err)})
            try:
                with self._client() as c:
                    if not stream:
                        return self._json(200, c.generate(prompt, **kwargs))
                    self._stream(c, prompt, kwargs)
            except RequestFailed as err:
                self._json(400, {"error": str(err)})
            except FlowedgeError as err:
                self._json(503, {"error": str(err)})

        def _stream(self, client: Client, prompt: str, kwargs: dict) -> None:
            pieces = client.stream(prompt, **kwargs)
            try:
                first = next(pieces, None)   # errors before the first token still get a status code
            except RequestFailed as err:
                return self._json(400, {"error": str(err)})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()

            def event(obj: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

            try:
                if first is not None:
                    event({"text": first})
                for piece in pieces:
                    event({"text": piece})
                event({"done": True, **(client.last_result or {})})
            except FlowedgeError as err:
                event({"error": str(err)})

    return Handler


def serve_http(listen: str, head: str, keys_dir=None, insecure: bool = False) -> ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")
    server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), make_handler(head, keys_dir, insecure))
    server.daemon_threads = True
    return server
