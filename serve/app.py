"""The HTTP API (FastAPI): OpenAI chat completions plus health, models and metrics.

Endpoints (docs/serving.md#http-api):

* ``POST /v1/chat/completions``: the OpenAI request (:mod:`serve.protocol`); the reply is an
  OpenAI ``chat.completion`` whose extra ``ctrl`` object holds the knobs, the per-stage
  latencies and whether the budget was met (with ``stream: true``, server-sent
  ``chat.completion.chunk`` events, the last with ``ctrl``: :mod:`serve.streaming`).
* ``GET /v1/models``: the one served model.
* ``GET /health``: 200 with the queue length once the model is loaded.
* ``GET /metrics``: Prometheus text format (:mod:`serve.metrics`).

Every error is an OpenAI error object with one clear message; 4xx for the client's mistakes
(400 bad request, 401 no or wrong key, 404 unknown model or path, 413 body too large), 503 with
Retry-After when the queue is full, 504 for a request dropped from the queue after its budget had
long passed, and 500 (counted as ``error``, the details in the server's log, never in the reply)
for anything unexpected. With an API key, every endpoint but ``/health`` requires
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import io
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from PIL import Image
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serve.config import normalize_api_key
from serve.connections import ConnectionLimits, UploadPlaces
from serve.engine import (
    COST_COLUMNS,
    LATENCY_PARTS,
    Cancelled,
    Engine,
    Job,
    LogUnavailable,
    Result,
    new_job,
)
from serve.protocol import (
    ChatRequest,
    Limits,
    RequestError,
    check_prompt_tokens,
    parse_chat_request,
    parse_json_body,
    slo_budget_ms,
)
from serve.scheduling import Overloaded
from serve.streaming import DISCONNECT_POLL_S, stream_reply

#: requests whose bodies are parsed and images decoded at once (the others wait, holding only their bytes)
DECODE_SLOTS = 2

logger = logging.getLogger("uvicorn.error")


def internal_error(request_id: str | None = None) -> RequestError:
    """The 500 of an unexpected failure: one line, no exception text (it may hold paths or object reprs)."""
    ref = f" (request {request_id})" if request_id else ""
    return RequestError(500, f"the server failed to answer this request{ref}; the server's log has the details",
                        None, "internal_error")


class ClientLeft(Exception):
    """The client closed its connection before its request's body was complete."""


class UploadsFull(RequestError):
    """No place for one more body in flight (HTTP 503 with Retry-After, after the body was read and dropped)."""

    retry_after_s = 1

    def __init__(self, uploads: UploadPlaces) -> None:
        each = f", {uploads.per_client} from one client address" if uploads.by_address else ""
        super().__init__(503, f"the server is receiving as many request bodies as it takes at once (--max-uploads: "
                              f"{uploads.total}{each}); retry in {self.retry_after_s} s", None, "uploads_full")


@dataclass
class Served:
    """What every route reads (``app.state.served``): the engine, the request limits and the
    server's bounds on bodies and connections."""

    engine: Engine
    limits: Limits
    max_body_bytes: int
    body_timeout_s: float
    uploads: UploadPlaces
    connections: ConnectionLimits | None = None
    #: the configured key, normalised as the tokens sent are (ServeConfig's one normalisation); None: no key
    expected_key: bytes | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    decode_slots: threading.BoundedSemaphore = field(default_factory=lambda: threading.BoundedSemaphore(DECODE_SLOTS))

    def parse_bounded(self, body: bytes) -> ChatRequest:
        with self.decode_slots:  # what parsing builds and the decoded images are what a burst of requests holds
            chat = parse_chat_request(parse_json_body(body), self.limits)
        # tokenized here, before the request is queued: a prompt too long never waits for the model
        check_prompt_tokens(self.engine.runtime.prompt_token_count(chat.question), self.limits)
        return chat

    def warm_parsing(self) -> None:
        """Parse one request as a client would send it, on the thread pool the handlers use: the
        pool's first start and the parser's first call cost the first request tens of milliseconds of
        its budget otherwise (40 ms on a 2-core VM)."""
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), (120, 110, 100)).save(buffer, format="PNG")
        image_url = f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"
        content = [{"type": "text", "text": "What is in the image?"},
                   {"type": "image_url", "image_url": {"url": image_url}}]
        body = {"model": self.engine.model_name, "messages": [{"role": "user", "content": content}]}
        with contextlib.suppress(RequestError):  # limits that refuse it still leave the pool and parser warm
            self.parse_bounded(json.dumps(body).encode())

    def error(self, exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
        if 400 <= exc.status < 500:  # 503s, 504s and 500s are counted where they arise
            self.engine.metrics.requests.labels(status="invalid").inc()
        headers = dict(headers or {})
        if isinstance(exc, Overloaded | UploadsFull):
            headers["Retry-After"] = str(exc.retry_after_s)
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if exc.status in (408, 413):  # the rest of the body is not read: the connection cannot carry another request
            headers["Connection"] = "close"
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    def failure(self, exc: BaseException, request_id: str) -> JSONResponse:
        """The reply to a submitted request that failed (before any of a stream was sent)."""
        if isinstance(exc, RequestError):
            return self.error(exc)
        if isinstance(exc, Cancelled):  # the server was stopped at once (a gone client's handler has left already)
            return self.error(RequestError(503, "the server was stopped before it answered this request", None,
                                           "server_stopped"))
        # the engine has recorded and counted it as an error
        logger.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
        return self.error(internal_error(request_id))

    def reply_sent(self, job: Job, result: Result) -> None:
        """Time the reply from the answer's last token to its last byte handed to the connection."""
        if result.record:
            answered = job.arrival + float(result.record.get("latency_total_ms") or 0.0) / 1000.0
            self.engine.planner.observe_reply((time.perf_counter() - answered) * 1000.0)

    def authorize(self, request: Request) -> None:
        if self.expected_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(normalize_api_key(token).encode(),
                                                                 self.expected_key):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                               "invalid_api_key")


def create_app(engine: Engine, limits: Limits, *, max_body_bytes: int, api_key: str | None = None,
               hosts: frozenset[str] | None = None, origins: tuple[str, ...] = (), body_timeout_s: float = 30.0,
               connections: ConnectionLimits | None = None, uploads: UploadPlaces | None = None) -> FastAPI:
    """The ASGI app around a started-or-not :class:`Engine` (its lifespan starts and stops it).

    ``hosts``: the names a Host header may name (None: any); ``origins``: the browser origins
    allowed to call it (CORS), any other Origin header is refused; ``connections``: where dropped
    connections are counted; ``uploads``: the places of bodies in flight (None: 2 x the queue's)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        await run_in_threadpool(app.state.served.warm_parsing)
        try:
            yield
        finally:
            # uvicorn has waited for the requests in flight; the queue is empty or finishes here
            await run_in_threadpool(engine.stop)

    # no redirects to a path with or without a trailing slash: a 404 error object says which paths exist
    app = FastAPI(title="ctrl serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.served = Served(engine, limits, max_body_bytes, body_timeout_s,
                              uploads or UploadPlaces(2 * (engine.max_queue + 1), engine.max_queue + 1), connections,
                              None if api_key is None else normalize_api_key(api_key).encode())
    app.include_router(routes)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    if origins:  # the preflight and the response headers a browser needs; other origins never get here
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)  # client libraries add headers of their own
    app.add_middleware(HostAndOriginCheck, hosts=hosts, origins=origins,
                       refused=lambda: engine.metrics.requests.labels(status="invalid").inc())
    return app


def _served(request: Request) -> Served:
    return request.app.state.served


async def _request_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return _served(request).error(exc)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises it after this answer, so the traceback still reaches the server's log
    served = _served(request)
    served.engine.metrics.requests.labels(status="error").inc()
    return served.error(internal_error())


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    path = request.url.path if len(request.url.path) <= 100 else request.url.path[:100] + "..."
    reason = {404: f"no endpoint {path}", 405: f"{request.method} is not allowed on {path}"}
    return _served(request).error(RequestError(exc.status_code, reason.get(exc.status_code, str(exc.detail)), None,
                                               None), headers=exc.headers)  # a 405's Allow


routes = APIRouter()


@routes.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Any:
    engine = _served(request).engine
    try:
        engine.check_log(count=False)
    except LogUnavailable as exc:
        return JSONResponse({"status": "unavailable", "reason": exc.message, "model": engine.model_name,
                             "queue_length": engine.pending}, status_code=503)
    return {"status": "ok", "model": engine.model_name, "queue_length": engine.pending}


@routes.api_route("/v1/models", methods=["GET", "HEAD"])
async def models(request: Request) -> dict[str, Any]:
    served = _served(request)
    served.authorize(request)
    engine = served.engine
    about = {"model_fingerprint": engine.runtime.fingerprint, "controller_run": engine.decider.controller_run,
             "default_budget_ms": engine.default_budget_ms, "latency_scale": engine.latency_scale.value,
             "latency_scale_source": engine.latency_scale.source,
             "met_target": engine.planner.met_target, "budget_margins": engine.planner.margins(),
             "feasible_rates": engine.planner.feasible_rates(), "floors": engine.planner.floor_states(),
             "arrival_rate_rps": engine.planner.load(time.perf_counter())[0],
             "overhead_reserve_ms": engine.overhead_reserve_ms(), "execution": engine.runtime.execution,
             "captured_graphs": getattr(engine.runtime, "captured_graphs", 0),
             "graph_captures": engine.runtime.graph_captures}
    return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": served.created,
                                        "owned_by": "ctrl", "ctrl": about}]}


@routes.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(request: Request) -> Response:
    served = _served(request)
    served.authorize(request)
    return Response(served.engine.metrics.exposition(), media_type="text/plain; version=0.0.4")


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    served = _served(request)
    engine, connections = served.engine, served.connections
    served.authorize(request)
    engine.check_log()  # a request that could not be recorded is not taken
    try:
        # a place of its own from the body's first byte: a body in flight holds no place in the queue
        body, give_back = await read_body(request, served.max_body_bytes, served.body_timeout_s, served.uploads)
    except ClientLeft:
        if connections is not None:
            connections.dropped("client_left", request.client)
        return Response(status_code=499)  # no one reads it
    except UploadsFull:
        engine.metrics.requests.labels(status="rejected").inc()
        raise
    except RequestError as exc:
        if exc.status == 408 and connections is not None:
            connections.dropped("body_timeout", request.client)
        raise
    # the request's clock starts with its whole body: upload time is the network's, not the model's
    arrival, arrival_time = time.perf_counter(), datetime.now(UTC)
    try:
        slot = engine.reserve()  # a full queue refuses now, and the client, done sending, reads the 503
        try:
            chat = await run_in_threadpool(served.parse_bounded, body)  # parsing and decoding off the event loop
            del body  # held until the answer otherwise, beside the image decoded from it
            give_back()
            if chat.budget_ms is None:  # a gateway's objectives, where the body states no budget
                chat.budget_ms = slo_budget_ms(request.headers, chat.max_tokens)
            if chat.model != engine.model_name:
                raise RequestError(404, f"model {chat.model!r} is not served here; this server serves "
                                        f"{engine.model_name!r} (GET /v1/models)", "model", "model_not_found")
            job = new_job(chat, engine, arrival, arrival_time, (time.perf_counter() - arrival) * 1000.0)
            job.loop = asyncio.get_running_loop()
            job.future = job.loop.create_future()
            engine.submit(job, slot)
        finally:
            slot.release()  # every path that did not queue the request (a no-op once queued)
    finally:
        give_back()  # a no-op once given back
    try:
        if chat.stream:
            return await stream_reply(request, job, engine.model_name, ctrl=_ctrl,
                                      failure=lambda exc: served.failure(exc, job.request_id),
                                      on_sent=lambda result: served.reply_sent(job, result))
        while True:
            done, _ = await asyncio.wait({job.future}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                job.cancelled.set()  # the worker stops at the next stage or token
                return JSONResponse({}, status_code=499)
    except asyncio.CancelledError:  # a forced stop cancels the handler: no one reads the outcome
        job.cancelled.set()
        raise
    try:
        result: Result = job.future.result()
    except Exception as exc:
        return served.failure(exc, job.request_id)
    return TimedJSONResponse(_completion(job.request_id, engine.model_name, result),
                             on_sent=lambda: served.reply_sent(job, result))


class TimedJSONResponse(JSONResponse):
    """A JSON response that reports when its last byte was handed to the connection: the time from the
    answer's text to then is outside the server's clock but inside the client's, so it is reserved."""

    def __init__(self, content: Any, *, on_sent: Callable[[], None]) -> None:
        super().__init__(content)
        self._on_sent = on_sent

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)
        self._on_sent()


async def read_body(request: Request, limit: int, timeout_s: float,
                    uploads: UploadPlaces) -> tuple[bytes, Callable[[], None]]:
    """The body and the function that gives its place in ``uploads`` back (taken at its first byte).
    Refused with 413 as soon as it exceeds ``limit`` bytes (declared or streamed), with 408 when it
    has not arrived within ``timeout_s``; :class:`ClientLeft` when the client closed its connection
    first; :class:`UploadsFull` where no place was free, once the body has been read and dropped (a
    client that sends its whole body before it reads gets the 503, not a reset connection)."""
    declared = request.headers.get("content-length")
    too_large = RequestError(413, f"the request body is larger than the server's limit of {limit:,} bytes", None,
                             "body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    give_back: Callable[[], None] | None = None
    refused, complete = False, False
    try:
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    if chunk and give_back is None and not refused:
                        give_back = uploads.take(request.client)
                        refused = give_back is None
                    if not refused:
                        chunks.append(chunk)
        except TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {timeout_s:g} s (the server's "
                                    f"--body-timeout-s); {size:,} bytes came", None, "body_timeout") from None
        except ClientDisconnect:
            raise ClientLeft from None
        complete = True
    finally:
        if not complete and give_back is not None:
            give_back()
    if refused:
        raise UploadsFull(uploads)
    return b"".join(chunks), give_back or (lambda: None)


class HostAndOriginCheck:
    """Refuse a request whose framing or Host header is malformed (400: a Host that is not
    ``host[:port]``, none on HTTP/1.1, or a body framed both by Transfer-Encoding and
    Content-Length, which RFC 9112 6.3 says to close: a proxy that frames by length would read
    another request in its body), whose Host header names a host not in ``hosts`` (403: a page of
    another site reaching a loopback server through a DNS name of its own) or whose Origin header
    (a browser's cross-site request) is not in ``origins`` (403)."""

    def __init__(self, app: Any, hosts: frozenset[str] | None, origins: tuple[str, ...],
                 refused: Callable[[], None]) -> None:
        self.app, self.hosts, self.origins, self.refused = app, hosts, frozenset(origins), refused

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            problem = self.problem(scope)
            if problem is not None:
                self.refused()
                status, message, code = problem
                headers = {"Connection": "close"} if status == 400 else None
                reply = JSONResponse(RequestError(status, message, None, code).body(), status_code=status,
                                     headers=headers)
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def problem(self, scope: Any) -> tuple[int, str, str] | None:
        names = [k for k, _ in scope["headers"]]
        if b"transfer-encoding" in names and b"content-length" in names:
            return (400, "the request frames its body both by Transfer-Encoding and by Content-Length; send one",
                    "invalid_framing")
        headers = {k: v for k, v in scope["headers"] if k in (b"host", b"origin")}
        raw = headers.get(b"host")
        if raw is None or not raw.strip():
            if scope.get("http_version") == "1.0" and raw is None:
                host = None  # HTTP/1.0 has no Host header to check
            else:
                return 400, "the Host header is empty: an HTTP/1.1 request names the server's host", "invalid_host"
        else:
            try:
                host = host_name(raw.decode("latin-1"))
            except ValueError:
                shown = raw[:100].decode("latin-1")
                return 400, f"the Host header {shown!r} is not host[:port]", "invalid_host"
        origin = headers.get(b"origin")
        if self.hosts is not None and host is not None and host not in self.hosts:
            return (403, f"the Host header names {host!r}, which this server does not answer to (--allowed-hosts "
                         f"{','.join(sorted(self.hosts))})", "host_not_allowed")
        if origin is not None and origin.decode("latin-1").lower().rstrip("/") not in self.origins:
            return (403, "cross-origin requests from a browser page are refused (--allowed-origins names the "
                         "origins allowed)", "origin_not_allowed")
        return None


#: a Host header: a name (or IPv4 address), or an IPv6 address in brackets, then an optional port
_HOST_HEADER = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+(?:%25[0-9a-z._~-]+)?)\]|(?P<name>[a-z0-9._~!$&'()*+;=%-]+))"
                          r"(?::(?P<port>[0-9]{0,5}))?")


def host_name(header: str) -> str:
    """The host of a Host header, lower case, without its port, brackets or trailing dot; ValueError
    when the header is not ``host[:port]`` (``[::1]evil.example`` and ``a@b`` are not)."""
    found = _HOST_HEADER.fullmatch(header.strip().lower())
    if found is None:
        msg = f"not a Host header: {header!r}"
        raise ValueError(msg)
    return found["ip6"] if found["ip6"] is not None else found["name"].rstrip(".")


def _completion(request_id: str, model: str, result: Result) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "finish_reason": result.finish_reason, "logprobs": None}],
        "usage": result.usage(),
        "ctrl": _ctrl(result.record),
    }


def _ctrl(row: dict[str, Any]) -> dict[str, Any]:
    """A reply's ``ctrl`` object (a stream's last chunk has it too): the request log record's knobs,
    budget terms and latencies."""
    return {
        "knobs": {k: row.get(k) for k in ("max_crops", "top_k", "num_active_blocks", "insertion_position")},
        "decided_by": row.get("decided_by"), "question_group": row.get("question_group"),
        "controller_run": row.get("controller_run"),
        "budget_ms": row.get("budget_ms"), "budget_source": row.get("budget_source"),
        "met": row.get("met"), "unreachable": row.get("unreachable"), "waited_ms": row.get("waited_ms"),
        "latency_scale": row.get("latency_scale"),
        "budget_margin": row.get("budget_margin"), "budget_class": row.get("budget_class"),
        "met_target": row.get("met_target"), "feasible_rate": row.get("feasible_rate"),
        "arrival_rate_rps": row.get("arrival_rate_rps"), "arrival_cap_ms": row.get("arrival_cap_ms"),
        "arrival_scv": row.get("arrival_scv"), "floor": row.get("floor"),
        "queue_cap_ms": row.get("queue_cap_ms"), "reserve_ms": row.get("reserve_ms"),
        "latency_ms": {part: row.get(f"latency_{part}_ms") for part in LATENCY_PARTS},
        **{name: row.get(name) for name in COST_COLUMNS},
        "batch_rows_prefill": row.get("batch_rows_prefill"), "batch_rows_decode": row.get("batch_rows_decode"),
    }
