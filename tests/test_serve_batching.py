"""``ctrl serve --max-batch N``: continuous batching over a real socket. Requests decoding together
answer what each answers alone, each with its own knobs; one that leaves early (its client gone)
leaves the others' answers as they were; every record says beside how many rows it ran."""

from __future__ import annotations

import http.client
import threading
import time

import pytest
from PIL import Image
from test_serve import chat_body, png_data_uri, request, serve_ws, start_server, stop_server  # noqa: F401

from pipeline.catalog import run_query
from pipeline.workspace import Workspace

#: (image size or None, question, max_crops, top_k, num_active_blocks, max_tokens)
REQUESTS = [((320, 240), "What colour is it?", 1, 8, 16, 10), ((640, 480), "How many shapes?", 4, 2, 12, 12),
            (None, "Say something.", 1, 4, 14, 9), ((300, 300), "Where is the circle?", 2, 6, 16, 12),
            ((1000, 250), "Which shape is largest?", 3, 1, 13, 11), ((200, 200), "Is it red?", 1, 3, 15, 12)]


@pytest.fixture(scope="module")
def batched_server(serve_ws, tmp_path_factory):  # noqa: F811
    _, ws, _ = serve_ws
    server = start_server(ws.root, tmp_path_factory.mktemp("batched") / "log.txt", "--controller", "offline-run",
                          "--max-batch", "4", "--max-queue", "16")
    yield server
    stop_server(server)


def _image(size, seed):
    return None if size is None else Image.new("RGB", size, (40 * seed % 255, 90, 200 - 20 * seed))


def _body(j, spec):
    size, question, crops, k, blocks, n = spec
    image = _image(size, j)
    content = question if image is None else [{"type": "text", "text": question},
                                              {"type": "image_url", "image_url": {"url": png_data_uri(image)}}]
    return chat_body(content, max_tokens=n, latency_budget_ms=60_000,
                     knobs={"max_crops": crops, "top_k": k, "num_active_blocks": blocks})


def _alone(runtime, j, spec) -> str:
    size, question, crops, k, blocks, n = spec
    inputs = runtime.preprocess(_image(size, j), question, crops)
    return runtime.generate(inputs, n, top_k=k, num_active_blocks=blocks).text


def test_requests_decoding_together_answer_what_each_answers_alone(batched_server, serve_ws,  # noqa: F811
                                                                     embedded_runtime):
    replies: dict[int, tuple[int, dict]] = {}

    def send(j, spec):
        replies[j] = request(batched_server, "POST", "/v1/chat/completions", _body(j, spec))

    for _ in range(2):  # the second round finds the first's batch warm
        threads = [threading.Thread(target=send, args=(j, spec)) for j, spec in enumerate(REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for j, spec in enumerate(REQUESTS):
            status, body = replies[j]
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == _alone(embedded_runtime, j, spec)
            knobs = body["ctrl"]["knobs"]
            assert (knobs["max_crops"], knobs["top_k"], knobs["num_active_blocks"]) == spec[2:5]
    _, ws, _ = serve_ws
    rows = run_query(Workspace(ws.root), "SELECT batch_rows_prefill, batch_rows_decode, latency_decode_ms, "
                                         "num_output_tokens FROM requests WHERE status = 'ok' "
                                         "AND batch_rows_prefill IS NOT NULL").to_pylist()
    assert len(rows) >= 2 * len(REQUESTS)
    assert all(1 <= r["batch_rows_prefill"] <= 4 for r in rows)
    decoding = [r for r in rows if r["num_output_tokens"] > 1]
    assert all(1 <= r["batch_rows_decode"] <= 4 and r["latency_decode_ms"] > 0 for r in decoding)
    assert max(r["batch_rows_decode"] for r in decoding) > 1  # some requests did share their decode steps


def _streaming(server, body: bytes) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    return conn


def _wait_for_queue(server, pending: int) -> None:
    deadline = time.monotonic() + 30
    while request(server, "GET", "/health")[1]["queue_length"] < pending:
        assert time.monotonic() < deadline, f"fewer than {pending} requests reached the server"
        time.sleep(0.01)


def test_a_client_that_leaves_mid_decode_ends_its_row_alone(batched_server, serve_ws,  # noqa: F811
                                                             embedded_runtime):
    """A long request and a short one wait behind a request running alone, then decode together; the
    long one's client disconnects mid-decode: its row is cancelled at the next step, and the short one
    answers what it answers alone."""
    long_body = chat_body("Tell me everything.", max_tokens=200, latency_budget_ms=60_000, stream=True,
                          knobs={"max_crops": 1, "top_k": 8, "num_active_blocks": 16})
    before = request(batched_server, "GET", "/health")[1]["queue_length"]
    assert before == 0
    first = _streaming(batched_server, long_body)  # alone: nobody waits when it starts
    first_reply = first.getresponse()
    first_reply.readline()
    gone = _streaming(batched_server, long_body)
    spec = REQUESTS[1]
    replies = {}
    short = threading.Thread(target=lambda: replies.setdefault(
        "short", request(batched_server, "POST", "/v1/chat/completions", _body(1, spec))))
    short.start()
    _wait_for_queue(batched_server, 3)  # the lone request running, the two waiting behind it
    first.close()  # the lone request is cancelled; the two waiting join one batch
    gone_reply = gone.getresponse()
    assert gone_reply.status == 200
    gone_reply.readline()  # decoding beside the short one
    gone.close()
    short.join(timeout=60)
    status, body = replies["short"]
    assert status == 200 and body["choices"][0]["message"]["content"] == _alone(embedded_runtime, 1, spec)
    assert body["ctrl"]["batch_rows_prefill"] == 2 and body["ctrl"]["batch_rows_decode"] > 1
    _, ws, _ = serve_ws
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cancelled = run_query(Workspace(ws.root), "SELECT error FROM requests WHERE status = 'cancelled' "
                                                  "AND error LIKE '%while decoding%'").to_pylist()
        if len(cancelled) == 2:
            break
        time.sleep(0.2)
    assert len(cancelled) == 2 and all("client disconnected" in r["error"] for r in cancelled)
    assert request(batched_server, "GET", "/health")[0] == 200


def test_a_failed_pass_ends_its_rows_with_the_error_and_the_worker_serves_on(embedded_runtime, monkeypatch):
    """Requests queued together join one batch; a decode step that raises ends each of them with that
    error (once each: their places freed), and the next request is answered."""
    import asyncio
    from datetime import UTC, datetime

    from test_serve import RecordingDecider

    from runtime.batched_decoder import BatchedDecoder
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest

    real_step, failures = BatchedDecoder.step, []

    def failing_step(self):
        if not failures:
            failures.append(len(self.live))
            msg = "injected failure"
            raise RuntimeError(msg)
        return real_step(self)

    monkeypatch.setattr(BatchedDecoder, "step", failing_step)
    engine = Engine(embedded_runtime, RecordingDecider(), model_name="embedded", max_queue=8, default_budget_ms=None,
                    threads=1, request_log=None, max_batch=4)

    async def scenario():
        loop = asyncio.get_running_loop()

        def job(question):
            j = new_job(ChatRequest("embedded", question, None, 6, 5000.0), engine, time.perf_counter(),
                        datetime.now(UTC), 0.0)
            j.loop, j.future = loop, loop.create_future()
            return j

        queued = [job(f"Question {i}?") for i in range(3)]
        for j in queued:
            engine.submit(j)
        engine.start()  # the worker finds all three waiting: one batch
        outcomes = await asyncio.gather(*(j.future for j in queued), return_exceptions=True)
        after = job("And now?")
        engine.submit(after)
        return outcomes, await after.future

    try:
        outcomes, after = asyncio.run(scenario())
    finally:
        engine.stop()
    assert failures == [3]
    assert all(isinstance(o, RuntimeError) and str(o) == "injected failure" for o in outcomes)
    assert after.num_output_tokens >= 1 and engine.pending == 0


def test_max_batch_is_auto_or_a_positive_count():
    from serve.config import ServeConfig

    auto = ServeConfig(controller="x")
    assert auto.max_batch == "auto"
    assert auto.batch_rows("cpu", True) == 4  # measured faster on a CPU
    assert auto.batch_rows("cuda", True) == 1 and auto.batch_rows("cpu", False) == 1
    assert ServeConfig(controller="x", max_batch=3).batch_rows("cuda", True) == 3
    for bad in ("0", "many", -1, True):
        with pytest.raises(ValueError, match="--max-batch must be 'auto' or a positive integer"):
            ServeConfig(controller="x", max_batch=bad)


def test_a_batch_holds_max_batch_requests_beside_the_queue(serve_ws, tmp_path):  # noqa: F811
    """--max-batch 2 --max-queue 0: the server holds two requests (running, or waiting to join the
    batch), and a third is answered 503 at once."""
    _, ws, _ = serve_ws
    server = start_server(ws.root, tmp_path / "log.txt", "--controller", "offline-run", "--max-batch", "2",
                          "--max-queue", "0")
    try:
        body = chat_body("Tell me everything.", max_tokens=200, latency_budget_ms=60_000, stream=True,
                         knobs={"max_crops": 1, "top_k": 8, "num_active_blocks": 16})
        running = [_streaming(server, body) for _ in range(2)]
        _wait_for_queue(server, 2)
        status, reply = request(server, "POST", "/v1/chat/completions", chat_body("What?", max_tokens=2))
        assert status == 503 and int(reply["_headers"]["retry-after"]) >= 1
        for conn in running:
            conn.close()
    finally:
        stop_server(server)
