"""``ctrl serve --max-batch N``: continuous batching over a real socket. Requests decoding together
answer what each answers alone, each with its own knobs; one that leaves early (its client gone)
leaves the others' answers as they were; every record says beside how many rows it ran."""

from __future__ import annotations

import http.client
import json
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
    # the role and the prefill's token, then a token of the first decode step beside the short one: only
    # then does the client leave (leaving at the first line may cancel its row before that step)
    events = 0
    while events < 3:
        line = gone_reply.readline()
        assert line, "the stream ended before its first decode step"
        events += line.startswith(b"data: ")
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
    # one at a time: measured to keep more budgets on a CPU than four rows, and unmeasured on a GPU
    assert auto.batch_rows(True) == 1 and auto.batch_rows(False) == 1
    assert ServeConfig(controller="x", max_batch=4).batch_rows(True) == 4
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


class BudgetDecider:
    """Decides by the budget it reads: crops 2 from 100 ms, top-K 4 over 12 blocks from 500 ms (else 2 over
    8); remembers every budget each stage read."""

    phase, controller_run = "offline", "budget-decider"
    max_crops_values = (1, 2)
    budget_range_ms = (10.0, 5000.0)
    reads_prompt_tokens = False

    def __init__(self) -> None:
        from controller.cost import LatencyScale
        from controller.machine import MachineCost

        self.reference_latency_ms: dict = {}
        self.cost = MachineCost(LatencyScale({}))
        self.stage1_budgets: list[float] = []
        self.stage2_budgets: list[float] = []

    def stage1(self, lang, tiling_crops, budget_ms):
        from serve.deciders import Stage1Choice

        self.stage1_budgets.append(budget_ms)
        return Stage1Choice(2 if budget_ms >= 100 else 1, 0, None, "controller")

    def stage2(self, choice, inputs):
        self.stage2_budgets.append(inputs.budget_ms)
        return (4, 12) if inputs.budget_ms >= 500 else (2, 8)


def test_the_controller_chooses_for_the_batch_it_joins_and_records_what_it_would_have_chosen_alone(
        embedded_runtime):
    """Two requests queued together: the first starts alone (batch factor 1) and takes the dear knobs;
    the second joins it, reads its budget divided by the batch factor (measured: here a step fit where
    a shared step is far dearer than a step alone) and takes cheaper knobs at stage 2; its record
    says what it would have taken alone."""
    import asyncio
    from datetime import UTC, datetime

    from serve.batch_cost import step_features
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest

    decider = BudgetDecider()
    engine = Engine(embedded_runtime, decider, model_name="embedded", max_queue=8, default_budget_ms=None,
                    threads=1, request_log=None, max_batch=4)
    layers = embedded_runtime.num_layers
    for blocks in (4, 8, 12, layers):  # batched step 1 + 0.1 / block run + 0.05 / product; alone 0.5 + 0.05 / product
        for k in (1, 4, 8):
            row = embedded_runtime.knobs_after_prefix(0, k, blocks)
            other = embedded_runtime.knobs_after_prefix(0, 2, 4)
            for rows in ([row], [row, other], [row, row, other]):
                u, p = step_features(rows)[1:]
                engine.batch_cost.observe_step(rows, 1 + 0.1 * u + 0.05 * p)
            engine.batch_cost.observe_alone(row, 0.5 + 0.05 * step_features([row])[2])
    for _ in range(5):
        engine.batch_cost.observe_request(model_ms=100.0, decode_ms=90.0)

    async def scenario():
        loop = asyncio.get_running_loop()
        jobs = []
        for question in ("First?", "Second?"):
            j = new_job(ChatRequest("embedded", question, None, 4, 1000.0), engine, time.perf_counter(),
                        datetime.now(UTC), 0.0)
            j.loop, j.future = loop, loop.create_future()
            engine.submit(j)
            jobs.append(j)
        engine.start()  # the worker finds both waiting: the second joins the first's batch
        return await asyncio.gather(*(j.future for j in jobs))

    try:
        first, second = asyncio.run(scenario())
    finally:
        engine.stop()
    a, b = first.record, second.record
    assert (a["batch_rows_expected"], a["batch_factor"]) == (1, 1.0)
    assert (a["max_crops"], a["top_k"], a["num_active_blocks"]) == (2, 4, 12)
    assert a["alone_max_crops"] is None and a["alone_top_k"] is None
    # beside the first row at its knobs: 12 blocks run, 96 products together (step 7), 48 alone (step 2.9);
    # decode steps 90 % of a request's model time
    assert b["batch_rows_expected"] == 2 and b["batch_factor"] == pytest.approx(1 + 0.9 * (7 / 2.9 - 1))
    assert (b["max_crops"], b["top_k"], b["num_active_blocks"]) == (2, 2, 8)
    assert (b["alone_max_crops"], b["alone_top_k"], b["alone_num_active_blocks"]) == (2, 4, 12)
    # stage 1 read the budget in the batch, then alone (x the factor); stage 2 the same two
    in_batch, alone = decider.stage1_budgets[1:3]
    assert in_batch == pytest.approx(b["controller_budget_ms"])
    assert alone == pytest.approx(in_batch * b["batch_factor"]) and 100 <= in_batch < 500 <= alone
    assert decider.stage2_budgets[1:3] == pytest.approx([in_batch, alone])
    assert 0 < b["occupancy"] <= 1


def test_a_stop_sequence_ends_its_row_alone(batched_server, embedded_runtime):
    """Requests decoding together, one of them with a stop sequence its answer reaches: it ends there
    (cut before it), and the others answer what each answers alone."""
    spec = REQUESTS[3]
    full = _alone(embedded_runtime, 3, spec)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    stopped = json.loads(_body(3, spec))
    stopped["stop"] = [stop]
    replies: dict[int, tuple[int, dict]] = {}

    def send(j, body):
        replies[j] = request(batched_server, "POST", "/v1/chat/completions", body)

    bodies = {j: _body(j, s) for j, s in enumerate(REQUESTS[:3])} | {3: json.dumps(stopped).encode()}
    threads = [threading.Thread(target=send, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status, body = replies[3]
    assert status == 200 and body["choices"][0]["message"]["content"] == full[:full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    for j, spec_j in enumerate(REQUESTS[:3]):
        status, body = replies[j]
        assert status == 200 and body["choices"][0]["message"]["content"] == _alone(embedded_runtime, j, spec_j)


def test_a_burst_far_past_capacity_is_shed_and_never_queued_past_its_budget(batched_server, serve_ws):  # noqa: F811
    """Forty controller-decided requests at once with budgets of four times one request's time: the
    server holds what its queue and batch hold, sheds the rest at once (503 with Retry-After) or drops
    from the queue those whose budgets it can no longer meet (504); no request it answers waited for
    the model longer than its budget; the next request after the burst is answered."""
    body = chat_body("What is in the image?", max_tokens=8)
    status, alone = request(batched_server, "POST", "/v1/chat/completions", body)
    assert status == 200
    budget = 4 * alone["ctrl"]["latency_ms"]["total"]
    burst_body = chat_body("What is in the image?", max_tokens=8, latency_budget_ms=budget)
    replies: list[tuple[int, dict]] = []
    lock = threading.Lock()

    def send():
        reply = request(batched_server, "POST", "/v1/chat/completions", burst_body)
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=send) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _ in replies)
    assert set(statuses) <= {200, 503, 504} and statuses.count(200) >= 1
    assert statuses.count(503) + statuses.count(504) >= 1, statuses
    assert all(int(b["_headers"]["retry-after"]) >= 1 for s, b in replies if s == 503)
    answered = [b["ctrl"]["latency_ms"] for s, b in replies if s == 200]
    assert all(lat["parse"] + lat["queue"] <= budget for lat in answered), (budget, answered)
    status, _ = request(batched_server, "POST", "/v1/chat/completions", body)
    assert status == 200
    # the controller decided each answered request for the batch it joined
    _, ws, _ = serve_ws
    rows = run_query(Workspace(ws.root), "SELECT batch_factor, batch_rows_expected, occupancy FROM requests "
                                         f"WHERE status = 'ok' AND budget_ms = {budget}").to_pylist()
    assert len(rows) == statuses.count(200)
    assert all(r["batch_factor"] >= 1 and 1 <= r["batch_rows_expected"] <= 4 and 0 < r["occupancy"] <= 1
               for r in rows)
    assert max(r["batch_rows_expected"] for r in rows) > 1
