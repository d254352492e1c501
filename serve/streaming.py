"""``stream: true``: the answer as server-sent events of OpenAI ``chat.completion.chunk`` objects.

The worker passes each settled part of the text to the event loop as it decodes it
(:meth:`serve.engine.Job.emit`, through ``call_soon_threadsafe`` into the job's unbounded queue):
it never waits for a slow reader. The handler waits for the first part (or the outcome) before it
answers, so a request refused or dropped before any text (400, 503, 504, 500) still gets a plain
HTTP error. Then the events are, in order:

* ``{"delta": {"role": "assistant", "content": ""}}``;
* one ``{"delta": {"content": ...}}`` per part of the text;
* ``{"delta": {}, "finish_reason": ...}`` with the ``ctrl`` object of a non-streaming reply;
* with ``stream_options.include_usage``: ``{"choices": [], "usage": {...}}``;
* ``data: [DONE]``.

A failure after the first event is sent as ``data: {"error": {...}}`` and ends the stream (no
``[DONE]``). A client that disconnects cancels its request, as a non-streaming one does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve.engine import Job, Result

#: how often a waiting handler (for the first text, or for a whole answer) checks whether its client is
#: still connected
DISCONNECT_POLL_S = 0.05

#: the job's queue item after its last part of the text: the outcome is in ``job.future``
_END = object()


def chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    """One ``chat.completion.chunk`` server-sent event."""
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **extra}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def delta(content: str, role: str | None = None) -> dict[str, Any]:
    """A choice carrying a part of the text (and, first, the role)."""
    return {"index": 0, "delta": {"role": role, "content": content} if role else {"content": content},
            "finish_reason": None, "logprobs": None}


async def stream_reply(request: Request, job: Job, model: str, *, failure: Callable[[BaseException], Response],
                       ctrl: Callable[[dict[str, Any]], dict[str, Any]], on_sent: Callable[[Result], None]
                       ) -> Response:
    """The response to a submitted streaming job: an SSE stream once its first text (or a successful
    outcome) is there; ``failure(exc)`` when it fails before; 499 when its client left while it waited."""
    assert job.deltas is not None and job.future is not None
    events: asyncio.Queue[Any] = job.deltas
    job.future.add_done_callback(lambda _: events.put_nowait(_END))  # after every part queued before it
    first = asyncio.ensure_future(events.get())
    try:
        while True:
            done, _ = await asyncio.wait({first}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                job.cancelled.set()  # the worker stops at the next stage, block or token
                return JSONResponse({}, status_code=499)
    finally:
        first.cancel()  # (when it has not returned) a part put meanwhile stays queued
    item = first.result()
    if item is _END and (job.future.cancelled() or job.future.exception() is not None):
        return failure(_outcome_error(job))
    return EventStream(job, item, model, failure=failure, ctrl=ctrl, on_sent=on_sent)


def _outcome_error(job: Job) -> BaseException:
    assert job.future is not None
    if job.future.cancelled():
        return asyncio.CancelledError()
    error = job.future.exception()
    assert error is not None
    return error


class EventStream(Response):
    """The server-sent events of one streamed job, its first queue item already taken; a
    disconnect (a ``http.disconnect`` message, or a failed write) cancels the job."""

    media_type = "text/event-stream"

    def __init__(self, job: Job, first: Any, model: str, *, failure: Callable[[BaseException], Response],
                 ctrl: Callable[[dict[str, Any]], dict[str, Any]], on_sent: Callable[[Result], None]) -> None:
        self.job, self.first, self.model = job, first, model
        self.failure, self.ctrl, self.on_sent = failure, ctrl, on_sent
        self.created = int(time.time())
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        job = self.job
        watcher = asyncio.ensure_future(_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await self._body(send, watcher)
        except OSError:  # the connection is gone (an ASGI server reports it as an OSError)
            job.cancelled.set()
        finally:
            watcher.cancel()

    async def _body(self, send: Any, watcher: asyncio.Future) -> None:
        job, usage = self.job, self.job.request.include_usage
        extra = {"usage": None} if usage else {}
        events: asyncio.Queue[Any] = job.deltas  # type: ignore[assignment]

        async def write(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        await write(chunk(job.request_id, self.created, self.model, [delta("", role="assistant")], **extra))
        item = self.first
        while item is not _END:
            await write(chunk(job.request_id, self.created, self.model, [delta(item)], **extra))
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                job.cancelled.set()  # the client left: the worker stops before its next token
                return
            item = getter.result()
        assert job.future is not None
        if job.future.cancelled() or job.future.exception() is not None:
            error = self.failure(_outcome_error(job))
            await write(b"data: " + bytes(error.body) + b"\n\n", more=False)
            return
        result: Result = job.future.result()
        final = {"index": 0, "delta": {}, "finish_reason": result.finish_reason, "logprobs": None}
        await write(chunk(job.request_id, self.created, self.model, [final], **extra, ctrl=self.ctrl(result.record)))
        if usage:
            await write(chunk(job.request_id, self.created, self.model, [], usage=result.usage()))
        await write(b"data: [DONE]\n\n", more=False)
        self.on_sent(result)


async def _disconnect(receive: Any) -> None:
    """Returns when the client has disconnected (the body was read before: nothing else arrives)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a receive channel that fails is a connection that is gone
        return
