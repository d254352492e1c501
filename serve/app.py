"""The HTTP API (FastAPI): OpenAI chat completions plus health, models and metrics.

Endpoints (docs/serving.md#http-api):

* ``POST /v1/chat/completions``: the OpenAI request (:mod:`serve.protocol`); the reply is an
  OpenAI ``chat.completion`` whose extra ``ctrl`` object holds the knobs, the per-stage
  latencies and whether the budget was met.
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
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.config import normalize_api_key
from serve.engine import LATENCY_PARTS, Cancelled, Engine, Overloaded, Result, new_job
from serve.protocol import Limits, RequestError, check_prompt_tokens, parse_chat_request, parse_json_body

#: how often a waiting handler checks whether its client is still connected
DISCONNECT_POLL_S = 0.05
#: requests whose bodies are parsed and images decoded at once (the others wait, holding only their bytes)
DECODE_SLOTS = 2

logger = logging.getLogger("uvicorn.error")


def internal_error(request_id: str | None = None) -> RequestError:
    """The 500 of an unexpected failure: one line, no exception text (it may hold paths or object reprs)."""
    ref = f" (request {request_id})" if request_id else ""
    return RequestError(500, f"the server failed to answer this request{ref}; the server's log has the details",
                        None, "internal_error")


def create_app(engine: Engine, limits: Limits, *, max_body_bytes: int, api_key: str | None = None) -> FastAPI:
    """The ASGI app around a started-or-not :class:`Engine` (its lifespan starts and stops it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            # uvicorn has waited for the requests in flight; the queue is empty or finishes here
            await run_in_threadpool(engine.stop)

    app = FastAPI(title="ctrl serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    decode_slots = threading.BoundedSemaphore(DECODE_SLOTS)

    def parse_bounded(data: Any) -> Any:
        with decode_slots:  # decoded images are what a burst of requests holds in memory
            chat = parse_chat_request(data, limits)
        # tokenized here, before the request is queued: a prompt too long never waits for the model
        check_prompt_tokens(engine.runtime.prompt_token_count(chat.question), limits)
        return chat

    def error(exc: RequestError) -> JSONResponse:
        if 400 <= exc.status < 500:  # 503s, 504s and 500s are counted where they arise
            engine.metrics.requests.labels(status="invalid").inc()
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises it after this answer, so the traceback still reaches the server's log
        engine.metrics.requests.labels(status="error").inc()
        return error(internal_error())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = {404: f"no endpoint {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error(RequestError(exc.status_code, reason.get(exc.status_code, str(exc.detail)), None, None))

    # the one normalisation of the key (ServeConfig's), applied to the configured key and to the token sent
    expected_key = None if api_key is None else normalize_api_key(api_key).encode()

    def authorize(request: Request) -> None:
        if expected_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(normalize_api_key(token).encode(), expected_key):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                               "invalid_api_key")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_name, "queue_length": engine.pending}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        about = {"model_fingerprint": engine.runtime.fingerprint, "controller_run": engine.decider.controller_run,
                 "default_budget_ms": engine.default_budget_ms, "latency_scale": engine.latency_scale.value,
                 "latency_scale_source": engine.latency_scale.source,
                 "met_target": engine.planner.met_target, "budget_margins": engine.planner.margins(),
                 "feasible_rates": engine.planner.feasible_rates(),
                 "arrival_rate_rps": engine.planner.load(time.perf_counter())[0],
                 "overhead_reserve_ms": engine.overhead_reserve_ms(), "execution": engine.runtime.execution,
                 "captured_graphs": getattr(engine.runtime, "captured_graphs", 0)}
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": created,
                                            "owned_by": "ctrl", "ctrl": about}]}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        authorize(request)
        return Response(engine.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        arrival, arrival_time = time.perf_counter(), datetime.now(UTC)
        authorize(request)
        body = await _read_body(request, max_body_bytes)
        engine.check_room()  # a full queue refuses before the image is decoded, not after
        data = await run_in_threadpool(parse_json_body, body)
        chat = await run_in_threadpool(parse_bounded, data)  # image decoding off the event loop
        if chat.model != engine.model_name:
            raise RequestError(404, f"model {chat.model!r} is not served here; this server serves "
                                    f"{engine.model_name!r} (GET /v1/models)", "model", "model_not_found")
        job = new_job(chat, engine, arrival, arrival_time, (time.perf_counter() - arrival) * 1000.0)
        job.loop = asyncio.get_running_loop()
        job.future = job.loop.create_future()
        engine.submit(job)
        while True:
            done, _ = await asyncio.wait({job.future}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                job.cancelled.set()  # the worker stops at the next stage or token
                return JSONResponse({}, status_code=499)
        try:
            result: Result = job.future.result()
        except RequestError:
            raise
        except Cancelled:  # the server was stopped at once (a gone client's handler has left already)
            return error(RequestError(503, "the server was stopped before it answered this request", None,
                                      "server_stopped"))
        except Exception as exc:  # the engine has recorded and counted it as an error
            logger.error("request %s failed: %s: %s", job.request_id, type(exc).__name__, exc, exc_info=exc)
            return error(internal_error(job.request_id))
        answered = job.arrival + float(result.record.get("latency_total_ms") or 0.0) / 1000.0
        return TimedJSONResponse(_completion(job.request_id, engine.model_name, result),
                                 on_sent=lambda: engine.planner.observe_reply((time.perf_counter() - answered) * 1000.0)
                                 if result.record else None)

    return app


class TimedJSONResponse(JSONResponse):
    """A JSON response that reports when its last byte was handed to the connection: the time from the
    answer's text to then is outside the server's clock but inside the client's, so it is reserved."""

    def __init__(self, content: Any, *, on_sent: Callable[[], None]) -> None:
        super().__init__(content)
        self._on_sent = on_sent

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)
        self._on_sent()


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it exceeds ``limit`` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    too_large = RequestError(413, f"the request body is larger than the server's limit of {limit:,} bytes", None,
                             "body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _completion(request_id: str, model: str, result: Result) -> dict[str, Any]:
    row = result.record
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "finish_reason": result.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": result.num_prompt_tokens, "completion_tokens": result.num_output_tokens,
                  "total_tokens": result.num_prompt_tokens + result.num_output_tokens},
        "ctrl": {
            "knobs": {k: row.get(k) for k in ("max_crops", "top_k", "num_active_blocks", "insertion_position")},
            "decided_by": row.get("decided_by"), "question_group": row.get("question_group"),
            "controller_run": row.get("controller_run"),
            "budget_ms": row.get("budget_ms"), "budget_source": row.get("budget_source"),
            "met": row.get("met"), "waited_ms": row.get("waited_ms"), "latency_scale": row.get("latency_scale"),
            "budget_margin": row.get("budget_margin"), "budget_class": row.get("budget_class"),
            "met_target": row.get("met_target"), "feasible_rate": row.get("feasible_rate"),
            "arrival_rate_rps": row.get("arrival_rate_rps"), "arrival_cap_ms": row.get("arrival_cap_ms"),
            "queue_cap_ms": row.get("queue_cap_ms"), "reserve_ms": row.get("reserve_ms"),
            "latency_ms": {part: row.get(f"latency_{part}_ms") for part in LATENCY_PARTS},
        },
    }
