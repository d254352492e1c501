"""The OpenAI protocol features common clients use: streaming (server-sent events), stop
sequences, seeded temperature / top-p sampling, and the fields still refused; through the
``openai`` client against a real ``ctrl serve`` process, plus the incremental detokeniser, the
sampler and the event stream in-process.

Requests that compare answers fix their knobs: the controller's choice depends on the load and
the time spent, and another configuration gives another answer.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import UTC, datetime

import pytest
import test_serve
import torch
from test_serve import chat_body, long_request_body, request, start_server, stop_server
from test_serve_limits import records

openai = pytest.importorskip("openai")

#: the workspace with the trained controllers (test_serve's module fixture, taken here under this name)
trained_ws = test_serve.serve_ws
KNOBS = {"max_crops": 2, "top_k": 4, "num_active_blocks": 12}
QUESTION = [{"role": "user", "content": "Describe the picture in detail."}]


@pytest.fixture(scope="module")
def server(trained_ws, tmp_path_factory):
    _, ws, _ = trained_ws
    server = start_server(ws.root, tmp_path_factory.mktemp("protocol") / "log.txt", "--controller", "offline-run")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def ask(client, max_tokens: int = 24, **fields):
    """A non-streaming reply to QUESTION at the fixed knobs."""
    extra = fields.pop("extra_body", {})
    return client.chat.completions.create(model="embedded", messages=QUESTION, max_tokens=max_tokens,
                                          extra_body={"knobs": KNOBS, **extra}, **fields)


def ask_streaming(client, max_tokens: int = 24, **fields) -> list:
    extra = fields.pop("extra_body", {})
    return list(client.chat.completions.create(model="embedded", messages=QUESTION, max_tokens=max_tokens,
                                               extra_body={"knobs": KNOBS, **extra}, stream=True, **fields))


def streamed_text(chunks: list) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def logged(ws_root, server, request_id: str) -> dict:
    return next(r for r in records(ws_root, server) if r["request_id"] == request_id)


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy answer to QUESTION at the fixed knobs: what the other requests are compared with."""
    reply = ask(client)
    text = reply.choices[0].message.content
    assert len(text) >= 6, f"the embedded model's answer is too short to test with: {text!r}"
    return reply


# -- streaming ----------------------------------------------------------------------------------

def test_a_stream_is_the_non_streaming_answer_in_parts_with_ctrl_last(client, greedy, server, trained_ws):
    chunks = ask_streaming(client)
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    assert streamed_text(chunks) == greedy.choices[0].message.content
    assert len([c for c in chunks if c.choices[0].delta.content]) >= 2  # in parts, as decoded
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.choices[0].finish_reason == greedy.choices[0].finish_reason
    extra = last.model_extra["ctrl"]
    assert set(extra) == set(greedy.model_extra["ctrl"])
    assert extra["knobs"] == {**KNOBS, "insertion_position": 0} and extra["decided_by"] == "request"
    assert all(c.model_extra.get("ctrl") is None for c in chunks[:-1])
    assert last.usage is None  # no include_usage: no usage chunk
    _, ws, _ = trained_ws
    row = logged(ws.root, server, last.id)
    assert row["status"] == "ok" and row["stream"] is True and row["answer"] == streamed_text(chunks)
    assert extra["latency_ms"] == {part: row[f"latency_{part}_ms"] for part in extra["latency_ms"]}
    assert extra["met"] == (row["latency_total_ms"] <= row["budget_ms"])


def test_include_usage_adds_a_last_chunk_of_token_counts(client, greedy):
    chunks = ask_streaming(client, stream_options={"include_usage": True})
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == greedy.usage.completion_tokens
    assert usage.usage.prompt_tokens == greedy.usage.prompt_tokens
    assert usage.usage.total_tokens == greedy.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == greedy.choices[0].finish_reason
    assert "ctrl" in chunks[-2].model_extra
    assert streamed_text(chunks) == greedy.choices[0].message.content


def test_the_stream_is_server_sent_events_ending_in_done(server):
    body = chat_body("Describe the picture in detail.", max_tokens=4, knobs=KNOBS, stream=True)
    status, reply = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and reply["_headers"]["content-type"].startswith("text/event-stream")
    events = reply["text"].split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def test_a_request_refused_before_streaming_is_a_plain_http_error(server):
    status, reply = request(server, "POST", "/v1/chat/completions",
                            chat_body("What?", model="gpt-4o", stream=True))
    assert status == 404 and reply["_headers"]["content-type"] == "application/json"
    status, reply = request(server, "POST", "/v1/chat/completions",
                            chat_body("What?", stream=True, stream_options={"include_usage": "yes"}))
    assert status == 400 and reply["error"]["param"] == "stream_options.include_usage"


def test_a_streaming_client_that_disconnects_cancels_its_request(client, server, trained_ws):
    _, ws, _ = trained_ws
    body = json.loads(long_request_body("embedded", max_tokens=200))
    full = client.chat.completions.create(model="embedded", messages=body["messages"], max_tokens=200,
                                          extra_body={"knobs": body["knobs"]})
    assert full.usage.completion_tokens >= 100, "the long request ends too soon to leave it in the middle"
    with client.chat.completions.create(model="embedded", messages=body["messages"], max_tokens=200, stream=True,
                                        extra_body={"knobs": body["knobs"]}) as stream:
        first = next(iter(stream))
    deadline = time.monotonic() + 30
    while request(server, "GET", "/health")[1]["queue_length"] != 0:
        assert time.monotonic() < deadline, "the disconnected stream's request still runs"
        time.sleep(0.02)
    row = logged(ws.root, server, first.id)
    assert row["status"] == "cancelled" and row["answer"] is None
    assert row["error"].startswith("the client disconnected")
    assert client.chat.completions.create(model="embedded", messages=QUESTION, max_tokens=2).choices


# -- stop sequences -----------------------------------------------------------------------------

def test_a_stop_sequence_cuts_the_answer_before_it(client, greedy, server, trained_ws):
    text = greedy.choices[0].message.content
    # three characters from the second half that occur there first: the answer is cut in its middle
    at = next(k for k in range(len(text) // 2, len(text) - 3) if text.find(text[k:k + 3]) == k)
    stop, expected = text[at:at + 3], text[:at]
    reply = ask(client, stop=["\u2603 never", stop])
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < greedy.usage.completion_tokens  # generation stopped there
    chunks = ask_streaming(client, stop=stop)
    assert streamed_text(chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"
    _, ws, _ = trained_ws
    row = logged(ws.root, server, reply.id)
    assert row["stop_hit"] == stop and row["finish_reason"] == "stop" and row["answer"] == expected
    assert logged(ws.root, server, greedy.id)["stop_hit"] is None


def test_a_stop_sequence_never_met_changes_nothing(client, greedy):
    reply = ask(client, stop="\u2603\u2603")
    assert reply.choices[0].message.content == greedy.choices[0].message.content
    assert reply.choices[0].finish_reason == greedy.choices[0].finish_reason


# -- sampling -----------------------------------------------------------------------------------

def test_a_seed_makes_sampling_reproducible_and_seeds_differ(client, greedy, server, trained_ws):
    _, ws, _ = trained_ws
    first = ask(client, temperature=1.0, seed=7)
    again = ask(client, temperature=1.0, seed=7)
    assert first.choices[0].message.content == again.choices[0].message.content
    streamed = ask_streaming(client, temperature=1.0, seed=7)
    assert streamed_text(streamed) == first.choices[0].message.content
    others = {ask(client, temperature=1.0, seed=seed).choices[0].message.content for seed in (1, 2, 3)}
    assert others - {first.choices[0].message.content}, "four seeds, one answer: not sampled"
    row = logged(ws.root, server, first.id)
    assert (row["temperature"], row["top_p"], row["seed"], row["stream"]) == (1.0, 1.0, 7, False)


def test_an_unseeded_sample_records_the_seed_that_reproduces_it(client, server, trained_ws):
    _, ws, _ = trained_ws
    reply = ask(client, temperature=1.5, top_p=0.9)
    row = logged(ws.root, server, reply.id)
    assert isinstance(row["seed"], int) and (row["temperature"], row["top_p"]) == (1.5, 0.9)
    replay = ask(client, temperature=1.5, top_p=0.9, seed=row["seed"])
    assert replay.choices[0].message.content == reply.choices[0].message.content


def test_temperature_0_and_a_tiny_nucleus_are_greedy(client, greedy, server, trained_ws):
    _, ws, _ = trained_ws
    zero = ask(client, temperature=0, seed=3)
    assert zero.choices[0].message.content == greedy.choices[0].message.content
    row = logged(ws.root, server, zero.id)
    assert (row["temperature"], row["seed"]) == (0.0, None)  # no sampling, so no seed was used
    nucleus = ask(client, temperature=1.0, top_p=1e-6, seed=3)  # the nucleus holds the top token alone
    assert nucleus.choices[0].message.content == greedy.choices[0].message.content


def test_metadata_is_recorded_in_the_request_log(client, server, trained_ws):
    _, ws, _ = trained_ws
    labels = {"example_id": "vqa-17", "team": "vision é"}
    reply = ask(client, max_tokens=2, extra_body={"metadata": labels})
    assert json.loads(logged(ws.root, server, reply.id)["metadata"]) == labels
    assert logged(ws.root, server, ask(client, max_tokens=2).id)["metadata"] is None


@pytest.mark.parametrize(("metadata", "param"), [
    ("vqa-17", "metadata"), ({"k": 3}, "metadata.k"), ({"": "x"}, "metadata"), ({"k" * 65: "x"}, "metadata"),
    ({"k": "v" * 513}, "metadata.k"), ({f"k{i}": "v" for i in range(17)}, "metadata")])
def test_bad_metadata_is_a_400_naming_it(client, metadata, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="embedded", messages=QUESTION, max_tokens=2,
                                       extra_body={"metadata": metadata})
    assert refused.value.param == param


# -- refused fields -----------------------------------------------------------------------------

REFUSED = {
    "repetition_penalty": 1.2, "best_of": 2, "function_call": "auto", "parallel_tool_calls": True, "echo": True,
    "n": 2, "logprobs": True, "presence_penalty": 0.5, "temperature": 2.5, "top_p": 0, "seed": 1.5,
    "stop": ["a", "b", "c", "d", "e"], "stream": "yes", "stream_options": {"include_usage": True},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_a_refused_field_is_a_400_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="embedded", messages=QUESTION, max_tokens=2,
                                       extra_body={field: REFUSED[field]})
    assert refused.value.param == field and f"`{field}`" in refused.value.message


@pytest.mark.parametrize(("stop", "param"), [("", "stop"), (["ok", ""], "stop[1]"), (["x" * 257], "stop[0]"),
                                             ([3], "stop[0]")])
def test_a_bad_stop_sequence_is_a_400_naming_it(client, stop, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="embedded", messages=QUESTION, max_tokens=2, extra_body={"stop": stop})
    assert refused.value.param == param


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    reply = client.chat.completions.create(model="embedded", messages=QUESTION, max_tokens=2, n=1, stop=[],
                                           extra_body={"repetition_penalty": 1, "best_of": 1, "echo": False,
                                                       "presence_penalty": 0, "logprobs": False})
    assert reply.choices[0].message.role == "assistant"


# -- in-process: the detokeniser, stop hold-back, sampler and event stream ------------------------

def utf8(tokens) -> str:
    """A byte-level tokenizer: each token one byte."""
    return bytes(tokens).decode("utf-8", errors="replace")


def stream_of(decode, tokens, stop=()) -> tuple[list[str], str, str | None, int]:
    """(parts sent, final text, stop hit, tokens pushed when it stopped)."""
    from serve.decoding import TextStream

    parts: list[str] = []
    text = TextStream(decode, stop, parts.append)
    pushed = 0
    for token in tokens:
        pushed += 1
        if text.push(token):
            break
    return parts, text.finish(), text.stop_hit, pushed


def test_a_multi_byte_character_is_sent_whole_and_spaces_with_what_follows():
    parts, text, hit, _ = stream_of(utf8, "hé €!".encode())
    assert parts == ["h", "é", " €", "!"] and text == "hé €!" and hit is None


def test_held_back_text_is_sent_when_generation_ends():
    parts, text, _, _ = stream_of(utf8, b"ab \xe2")
    assert parts == ["a", "b", " \ufffd"] and text == "ab \ufffd"


def test_a_space_the_tokenizers_clean_up_may_remove_is_held_until_the_next_token():
    vocab = ["Yes", " ", ".", " I", " do", " n", "'t"]

    def cleaned(tokens):  # transformers' clean_up_tokenization_spaces
        return "".join(vocab[t] for t in tokens).replace(" .", ".").replace(" n't", "n't")

    parts, text, _, _ = stream_of(cleaned, range(len(vocab)))
    assert parts == ["Yes", ".", " I", " do", "n't"] and text == "Yes. I don't"


def test_the_start_of_a_stop_sequence_is_held_until_it_is_known():
    parts, text, hit, pushed = stream_of(utf8, b"abENDxyz", ("END",))
    assert parts == ["a", "b"] and text == "ab" and hit == "END" and pushed == 5
    parts, text, hit, _ = stream_of(utf8, b"abENs", ("END",))
    assert parts == ["a", "b", "ENs"] and text == "abENs" and hit is None


def test_the_earliest_stop_sequence_cuts_and_one_inside_a_token_cuts_inside_it():
    vocab = ["xab", "cd", "e", "STOP now"]

    def join(tokens):
        return "".join(vocab[t] for t in tokens)

    parts, text, hit, pushed = stream_of(join, [0, 1, 2], ("cd", "bc"))
    assert (parts, text, hit, pushed) == (["xa"], "xa", "bc", 2)  # "b" held: it may start "bc"
    parts, text, hit, _ = stream_of(join, [3], ("STOP",))
    assert (parts, text, hit) == ([], "", "STOP")


def test_the_sampler_draws_by_temperature_and_nucleus():
    from serve.decoding import TokenPicker, sample_token

    logits = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))])  # probabilities 1/4, 3/4

    def share_of_1(temperature, top_p, n=4000):
        generator = torch.Generator().manual_seed(0)
        return sum(sample_token(logits, temperature, top_p, generator) for _ in range(n)) / n

    assert share_of_1(1.0, 1.0) == pytest.approx(0.75, abs=0.03)
    assert share_of_1(0.5, 1.0) == pytest.approx(0.9, abs=0.02)  # 1 : 9
    assert share_of_1(1.0, 0.8) == pytest.approx(0.75, abs=0.03)  # the nucleus needs both tokens
    assert share_of_1(1.0, 0.7) == 1.0  # the top token alone holds 0.7
    three = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    generator = torch.Generator().manual_seed(1)
    assert {sample_token(three, 1.0, 0.7, generator) for _ in range(500)} == {0, 1}
    a, b = (TokenPicker(1.0, 1.0, 11, torch.device("cpu")) for _ in range(2))
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]
    assert TokenPicker(0.0, 1.0, 11, torch.device("cpu"))(torch.tensor([0.1, 2.0, 0.3])) == 1


class _Connected:
    """A request whose client stays."""
    async def is_disconnected(self) -> bool:
        return False


def _run_stream(worker) -> tuple[int, bytes]:
    """Serve a streaming job while ``worker(job)`` (a thread) emits and finishes it: (status, body)."""
    from fastapi.responses import JSONResponse

    from serve.engine import Job
    from serve.protocol import ChatRequest, RequestError
    from serve.streaming import EventStream, stream_reply

    async def main():
        loop = asyncio.get_running_loop()
        job = Job(ChatRequest("m", "q", None, 4, None, stream=True, include_usage=True), 100.0, "request", 0.0,
                  datetime.now(UTC), 0.0, 0)
        job.request_id, job.loop, job.future, job.deltas = "chatcmpl-x", loop, loop.create_future(), asyncio.Queue()
        thread = threading.Thread(target=worker, args=(job,))
        thread.start()
        response = await stream_reply(
            _Connected(), job, "m", ctrl=lambda row: {"row": row},
            failure=lambda exc: JSONResponse(RequestError(504, str(exc), None, "x").body(), status_code=504),
            on_sent=lambda result: None)
        thread.join()
        if not isinstance(response, EventStream):
            return response.status_code, response.body
        messages = []

        async def send(message):
            messages.append(message)

        async def receive():
            await asyncio.Event().wait()

        await response(None, receive, send)
        return messages[0]["status"], b"".join(m.get("body", b"") for m in messages[1:])

    return asyncio.run(main())


def test_the_event_stream_in_order_and_a_failure_after_it_started():
    from serve.engine import Result

    def answers(job):
        job.emit("He")
        job.emit("llo")
        job.finish(Result("Hello", "length", 3, 4, {"latency_total_ms": 5.0}))

    status, body = _run_stream(answers)
    events = body.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": ""},
                                                              {"content": "He"}, {"content": "llo"}]
    assert chunks[3]["choices"][0]["finish_reason"] == "length" and chunks[3]["ctrl"] == {
        "row": {"latency_total_ms": 5.0}}
    assert chunks[4]["choices"] == [] and chunks[4]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                                 "total_tokens": 7}
    assert all(c["usage"] is None for c in chunks[:4]) and len(chunks) == 5

    def fails_midway(job):
        job.emit("He")
        job.finish(RuntimeError("the model broke"))

    status, body = _run_stream(fails_midway)
    events = body.decode().split("\n\n")
    assert status == 200 and "[DONE]" not in body.decode() and events[-1] == ""
    assert json.loads(events[1].removeprefix("data: "))["choices"][0]["delta"] == {"content": "He"}
    assert json.loads(events[-2].removeprefix("data: "))["error"]["message"] == "the model broke"

    def fails_first(job):
        job.finish(RuntimeError("dropped"))

    status, body = _run_stream(fails_first)
    assert status == 504 and json.loads(body)["error"]["message"] == "dropped"


def test_a_log_written_before_these_columns_reads_them_as_null(tmp_path):
    """Both readers of the request logs (the catalog's DuckDB view and the Arrow table) take an old line."""
    import duckdb

    from pipeline.catalog import request_log_table, requests_view_ddl
    from pipeline.workspace import Workspace

    ws = Workspace(tmp_path / "ws")
    ws.requests_dir.mkdir(parents=True)
    (ws.requests_dir / "old.jsonl").write_text('{"request_id": "old", "status": "ok", "answer": "yes"}\n')
    columns = ["request_id", "stream", "temperature", "top_p", "seed", "finish_reason", "stop_hit"]
    expected = [{"request_id": "old", "stream": None, "temperature": None, "top_p": None, "seed": None,
                 "finish_reason": None, "stop_hit": None}]
    assert request_log_table(ws).select(columns).to_pylist() == expected
    con = duckdb.connect()
    con.execute(requests_view_ddl(str(ws.requests_dir / "*.jsonl")))
    assert con.sql(f"SELECT {', '.join(columns)} FROM requests").to_arrow_table().to_pylist() == expected


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"a": [1, 2, {"b": 3}]}', 5),  # { [ , , {
    (b'{"a": "x, [y], {z}"}', 1),  # inside a string nothing counts
    (b'{"a": "x\\\\", "b": [1,2]}', 4),  # an escaped backslash ends the string before the comma
    (b'{"a": "x\\", [", "b": 1}', 2),  # an escaped quote does not end it
])
def test_json_values_are_counted_outside_strings(body, expected):
    from serve.protocol import json_value_count

    for limit in range(6):  # above the limit exactly when the values outside strings are
        assert (json_value_count(body, limit) > limit) == (expected > limit), limit


def test_json_values_beyond_the_limit_are_refused_by_parse_json_body():
    from serve.protocol import MAX_JSON_VALUES, RequestError, parse_json_body

    at_limit = b"[" + b"0," * (MAX_JSON_VALUES - 1) + b"0]"  # one [ and MAX - 1 commas
    assert len(parse_json_body(at_limit)) == MAX_JSON_VALUES
    with pytest.raises(RequestError, match="more than 10,000 JSON values"):
        parse_json_body(b"[" + b"0," * MAX_JSON_VALUES + b"0]")
    text = b'{"t": "' + b"," * (5 * MAX_JSON_VALUES) + b'"}'  # commas in a string: one value
    assert parse_json_body(text) == {"t": "," * (5 * MAX_JSON_VALUES)}
