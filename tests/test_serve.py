"""``ctrl serve`` through real clients: the ``openai`` package and raw HTTP against a server
started in a subprocess on a free loopback port, plus the engine's budget accounting in-process.

The servers serve the embedded model with controllers trained here on a synthetic workspace:
an offline run (server A) and an online controller file (server B, which also has an API key
and no queue, so a second concurrent request is refused).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import build_offline_workspace
from small_disk import on_small_disk, small_disk_available

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
MAX_BODY_BYTES = 300_000
STARTUP_S = 180.0


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serve_ws(tmp_path_factory, embedded_runtime):
    """A synthetic workspace with an offline run and an online controller file continued from it."""
    from online.config import OnlineTrainConfig
    from online.data import load_online_samples
    from online.train import build_controller

    root = tmp_path_factory.mktemp("serve")
    tree, ws = build_offline_workspace(root, embedded_runtime, 24)
    samples = load_online_samples(ws, embedded_runtime.fingerprint, None)
    config = OnlineTrainConfig(workspace=ws.root, from_run="offline-run", budget_min_ms=30.0, budget_max_ms=300.0)
    controller, _, _ = build_controller(config, ws, embedded_runtime, samples, (30.0, 300.0))
    online_file = root / "online-controller.pt"
    controller.save(online_file)
    return tree, ws, online_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(ws_root: Path, log_path: Path, *extra: str) -> Server:
    port = free_port()
    args = [sys.executable, "-m", "cli", "serve", "--model", "embedded", "-w", str(ws_root), "--port", str(port),
            "--threads", "1", "--no-warmup", "--max-body-bytes", str(MAX_BODY_BYTES), *extra]
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    server = Server(process, port, log_path)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"ctrl serve exited with {process.returncode}:\n{server.log()}")
        try:
            status, _ = request(server, "GET", "/health")
            if status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"ctrl serve did not answer /health within {STARTUP_S} s:\n{server.log()}")


def stop_server(server: Server) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            return server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@pytest.fixture(scope="module")
def server_a(serve_ws, tmp_path_factory):
    """The offline run, data: URIs only, the default queue."""
    _, ws, _ = serve_ws
    server = start_server(ws.root, tmp_path_factory.mktemp("server-a") / "log.txt", "--controller", "offline-run")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def server_b(serve_ws, tmp_path_factory):
    """The online controller file, an API key, no waiting room, one request at a time."""
    _, ws, online_file = serve_ws
    server = start_server(ws.root, tmp_path_factory.mktemp("server-b") / "log.txt", "--controller", str(online_file),
                          "--api-key", "secret-key", "--max-queue", "0", "--served-model-name", "molmoe-test",
                          "--max-batch", "1")
    yield server
    stop_server(server)


# -- helpers -----------------------------------------------------------------------------------

def request(server: Server, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 120.0) -> tuple[int, dict]:
    """Raw HTTP (http.client): status and the decoded JSON body (or {'text': ...})."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
        try:
            decoded = json.loads(raw)
        except ValueError:
            decoded = {"text": raw.decode(errors="replace")}
        return response.status, {**decoded, "_headers": {k.lower(): v for k, v in response.getheaders()}}
    finally:
        conn.close()


def chat_body(content, model: str = "embedded", **fields) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}], **fields}).encode()


def png_data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def sample_image(tree) -> Path:
    return sorted(Path(tree.images_dir).rglob("*.*"))[0]


def bomb_png(width: int, height: int) -> bytes:
    """A small PNG whose header declares width x height pixels (the data would decompress to gigabytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (width + 1) * 64, 9)  # the first rows only; decoding would need them all
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def assert_serving(server: Server) -> None:
    """A good request still gets its answer (after a refused one)."""
    status, body = request(server, "POST", "/v1/chat/completions", chat_body("What is shown?", max_tokens=2))
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"


def one_line_error(body: dict) -> str:
    message = body["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in message
    return message


# -- through the openai client -------------------------------------------------------------------

def test_openai_client_text_request_gets_an_answer_with_the_knobs_and_latencies(server_a):
    client = openai.OpenAI(base_url=server_a.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "How many?"}],
                                           max_tokens=3)
    assert reply.object == "chat.completion" and reply.model == "embedded"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= 3
    extra = reply.model_extra["ctrl"]
    assert set(extra["knobs"]) == {"max_crops", "top_k", "num_active_blocks", "insertion_position"}
    assert extra["knobs"]["insertion_position"] == 0  # an offline controller decides before block 0
    assert extra["budget_source"] == "default" and extra["budget_ms"] > 0
    latency = extra["latency_ms"]
    assert set(latency) == {"parse", "queue", "stage1", "preprocess", "vision", "prefill", "stage2", "decode",
                            "model", "total"}
    assert latency["vision"] is None  # no image, no vision pass
    assert latency["total"] >= latency["stage1"] + latency["prefill"] + latency["decode"] > 0
    # the model time holds the prefill and the decode steps, and the rest of the request is outside it
    assert latency["prefill"] + latency["decode"] <= latency["model"] <= latency["total"] - latency["stage1"]
    assert extra["met"] == (latency["total"] <= extra["budget_ms"])
    # no image, no tiling: the prediction is the configuration's spread over the profile
    assert extra["cost_basis"] == "configuration" and extra["latency_quantile_ms"] >= extra["expected_latency_ms"] > 0


def test_openai_client_image_request_with_a_budget(server_a, serve_ws, embedded_runtime):
    tree, ws, _ = serve_ws
    client = openai.OpenAI(base_url=server_a.base_url + "/v1", api_key="unused")
    image = Image.open(sample_image(tree))
    reply = client.chat.completions.create(
        model="embedded", max_tokens=2, extra_body={"latency_budget_ms": 5000},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What color is the shape?"},
                                               {"type": "image_url", "image_url": {"url": png_data_uri(image)}}]}])
    extra = reply.model_extra["ctrl"]
    assert extra["budget_ms"] == 5000 and extra["budget_source"] == "request"
    assert extra["latency_ms"]["vision"] > 0
    assert extra["knobs"]["max_crops"] in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
    assert extra["decided_by"] in ("controller", "table")
    # the question's family as the run's fallback table reads it (the synthetic data labels families)
    from controller.deploy import DeployedController
    from trainer.fallback import read_fallback
    from trainer.policy import ControllerPolicy

    best = ws.runs_dir / "offline-run" / "checkpoints" / "best.pt"
    deployed = DeployedController(ControllerPolicy.load(best), read_fallback(best))
    lang = embedded_runtime.lang_features(["What color is the shape?"])
    index = int(deployed.question_group(lang)[0])
    assert index >= 0
    assert extra["question_group"] == deployed.group_names()[index]
    # the request's own predicted cost at the configuration it ran: its tiling is known (an image), and
    # its prompt's length is counted as the features count it
    tiling = torch.tensor([[float(r * c) for r, c in (embedded_runtime.tiling(image.width, image.height, m)
                                                      for m in deployed.max_crops_values.tolist())]])
    prompt = torch.tensor([float(embedded_runtime.preprocess(None, "What color is the shape?", 1).num_text_tokens)])
    median, quantile, own, far = deployed.expected_latency(lang, tiling, prompt)
    ran = [tuple(a) for a in deployed.actions.tolist()].index(
        tuple(extra["knobs"][k] for k in ("max_crops", "top_k", "num_active_blocks")))
    assert extra["expected_latency_ms"] == pytest.approx(float(median[0, ran]))
    assert extra["latency_quantile_ms"] == pytest.approx(float(quantile[0, ran]))
    assert extra["cost_basis"] == ("configuration" if not bool(own[0, ran])
                                   else "extrapolated" if bool(far[0, ran]) else "request")
    assert extra["latency_quantile_ms"] >= extra["expected_latency_ms"] > 0
    # an image tiling into more crops than the cost model was fitted on: its record says the cost was extrapolated
    from serve.deciders import OfflineDecider, Stage2Inputs

    decider = OfflineDecider(deployed, "offline-run")
    beyond = torch.full_like(tiling[0], float(deployed.request_cost.fit_max_crops) + 3.0)
    choice = decider.stage1(lang[0], beyond, 5000.0, prompt_tokens=float(prompt[0]))
    decider.stage2(choice, Stage2Inputs(lang[0], beyond, 5000.0, None, None, prompt_tokens=float(prompt[0])))
    assert choice.cost_basis == "extrapolated" and choice.expected_latency_ms > 0


def test_fixed_knobs_are_applied_on_the_execution_path(server_a, serve_ws, embedded_runtime):
    """A request that fixes its knobs gets exactly the answer the model gives with them in-process."""
    tree, _, _ = serve_ws
    image = Image.open(sample_image(tree)).convert("RGB")
    question = "What color is the shape?"
    content = [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": png_data_uri(image)}}]
    for knobs in ({"max_crops": 1, "top_k": 1, "num_active_blocks": 2},
                  {"max_crops": 4, "top_k": embedded_runtime.default_top_k,
                   "num_active_blocks": embedded_runtime.num_layers}):
        status, body = request(server_a, "POST", "/v1/chat/completions",
                               chat_body(content, max_tokens=6, knobs=knobs))
        assert status == 200, body
        assert {k: body["ctrl"]["knobs"][k] for k in knobs} == knobs and body["ctrl"]["decided_by"] == "request"
        inputs = embedded_runtime.preprocess(Image.open(io.BytesIO(base64.b64decode(
            png_data_uri(image).split(",", 1)[1]))), question, knobs["max_crops"])
        with embedded_runtime.knobs(top_k=knobs["top_k"], num_active_blocks=knobs["num_active_blocks"]):
            expected = embedded_runtime.generate(inputs, max_new_tokens=6).text
        assert body["choices"][0]["message"]["content"] == expected


def test_health_models_and_metrics(server_a):
    status, health = request(server_a, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "embedded"
    status, models = request(server_a, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["embedded"]
    # the fast path by default; a CPU captures no graphs and attends in float32
    about = models["data"][0]["ctrl"]
    assert about["execution"] == {"compiled": True, "cuda_graphs": False, "attention_dtype": "float32"}
    assert about["captured_graphs"] == about["graph_captures"] == 0
    assert_serving(server_a)
    status, metrics = request(server_a, "GET", "/metrics")
    text = metrics["text"]
    assert status == 200
    ok = next(float(line.split()[-1]) for line in text.splitlines()
              if line.startswith('ctrl_requests_total{status="ok"}'))
    assert ok >= 1
    assert 'ctrl_decisions_total{knob="max_crops"' in text
    assert 'ctrl_stage_latency_seconds_bucket{le="0.001",stage="stage1"}' in text
    assert "ctrl_queue_length" in text and "ctrl_budget_total" in text


# -- bad requests over raw HTTP -----------------------------------------------------------------

BAD_CASES = {
    "malformed JSON": (b'{"model": "embedded", "messages": [', 400, "not valid JSON"),
    "image referenced without a url": (chat_body([{"type": "text", "text": "What?"}, {"type": "image_url"}]), 400,
                                       "image_url.url` is required"),
    "undecodable image": (chat_body([{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not an image at all" * 10).decode()}}]), 400,
        "not a decodable image"),
    "image over the pixel limit": (chat_body([{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(bomb_png(6000, 6000)).decode()}}]), 400,
        "declares 6000 x 6000 = 36,000,000 pixels, more than the server's limit of 25,000,000 pixels"),
    "decompression bomb": (chat_body([{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(bomb_png(40000, 40000)).decode()}}]), 400,
        "more pixels than the server's limit of 25,000,000 pixels"),
    "body over the limit": (chat_body("x" * (MAX_BODY_BYTES + 10)), 413, "larger than the server's limit"),
    "negative budget": (chat_body("What?", latency_budget_ms=-5), 400, "latency_budget_ms` must be a positive"),
    "NaN budget": (b'{"model": "embedded", "messages": [{"role": "user", "content": "What?"}], '
                   b'"latency_budget_ms": NaN}', 400, "got nan"),
    "non-numeric budget": (chat_body("What?", latency_budget_ms="fast"), 400, "got 'fast'"),
    "unknown model": (chat_body("What?", model="gpt-4o"), 404, "'gpt-4o' is not served here"),
    "sampling too hot": (chat_body("What?", temperature=2.5), 400, "`temperature` must be a number in [0, 2]"),
    "remote image url": (chat_body([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]), 400,
                         "only data: URIs are accepted"),
    "system prompt": (json.dumps({"model": "embedded", "messages": [{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "What?"}]}).encode(),
                      400, "exactly one user message"),
    "a key named twice": (b'{"model": "embedded", "messages": [{"role": "system", "content": "Be brief."}], '
                          b'"messages": [{"role": "user", "content": "What?"}]}', 400,
                          "names 'messages' twice in one object"),
    "a budget beyond any float": (b'{"model": "embedded", "messages": [{"role": "user", "content": "What?"}], '
                                  b'"latency_budget_ms": 1' + b"0" * 400 + b"}", 400,
                                  "`latency_budget_ms` must be a positive, finite number"),
    "a temperature beyond any float": (b'{"model": "embedded", "messages": [{"role": "user", "content": "What?"}], '
                                       b'"temperature": 1' + b"0" * 400 + b"}", 400,
                                       "`temperature` must be a number in [0, 2]"),
    "a lone surrogate": (b'{"model": "embedded", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
                         "not valid Unicode text: a lone surrogate"),
    "nested 5,000 deep": (b'{"model": "embedded", "messages": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", 400,
                          "not valid JSON"),
    "nested 100,000 deep": (b'{"model": "embedded", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
                            "more than 10,000 JSON values"),
    "not UTF-8": (b'{"model": "embedded", "messages": [{"role": "user", "content": "\xff"}]}', 400,
                  "not valid UTF-8 (byte 64"),
    "a prompt over the limit": (chat_body("What? " * 1500), 400, "9,000 characters of text, more than the server's "
                                                                 "limit of 8,000 (--max-prompt-chars)"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_requests_get_one_clear_4xx_and_the_server_keeps_serving(server_a, case):
    body, want_status, want_text = BAD_CASES[case]
    status, reply = request(server_a, "POST", "/v1/chat/completions", body)
    assert status == want_status, reply
    assert want_text in one_line_error(reply)
    assert " object at 0x" not in one_line_error(reply)  # no Python object's repr in a message
    assert_serving(server_a)


def test_a_non_loopback_bind_needs_an_explicit_option(serve_ws):
    _, ws, _ = serve_ws
    done = subprocess.run([sys.executable, "-m", "cli", "serve", "--model", "embedded", "-w", str(ws.root),
                           "--host", "0.0.0.0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "--host '0.0.0.0' is not a loopback address" in done.stderr and "--allow-remote" in done.stderr
    assert "Traceback" not in done.stderr


# -- the request log and its view -------------------------------------------------------------

def test_every_request_is_in_the_requests_view(server_a, serve_ws):
    from pipeline.catalog import run_query
    from pipeline.workspace import Workspace

    _, ws, _ = serve_ws
    before = _ok_count(ws)
    for budget in (50, 5000):
        status, _ = request(server_a, "POST", "/v1/chat/completions",
                            chat_body("Which shape?", max_tokens=2, latency_budget_ms=budget))
        assert status == 200
    assert _ok_count(ws) == before + 2
    rows = run_query(Workspace(ws.root), "SELECT budget_ms, met, latency_total_ms, controller_run, model_fingerprint, "
                                         "answer, waited_ms FROM requests WHERE status = 'ok' "
                                         "ORDER BY time DESC LIMIT 2").to_pylist()
    assert sorted(r["budget_ms"] for r in rows) == [50.0, 5000.0]
    assert all(r["controller_run"] == "offline-run" and r["answer"] is not None for r in rows)
    assert all(r["met"] == (r["latency_total_ms"] <= r["budget_ms"]) for r in rows)
    by_budget = run_query(Workspace(ws.root), "SELECT budget_ms, avg(met::INT) AS met FROM requests "
                                              "WHERE time > now() - INTERVAL 1 HOUR GROUP BY 1 ORDER BY 1")
    assert by_budget.num_rows >= 2


def test_every_budget_term_is_recorded_and_the_reply_is_reserved(server_a, serve_ws):
    """The reply's time (outside the server's clock) is measured and reserved, and the budget the
    controller read is the documented arithmetic of the terms in its record."""
    from pipeline.catalog import run_query
    from pipeline.workspace import Workspace

    _, ws, _ = serve_ws
    for _ in range(6):  # enough arrivals for a rate; every reply before the last one is timed
        status, body = request(server_a, "POST", "/v1/chat/completions",
                               chat_body("Which shape?", max_tokens=2, latency_budget_ms=5000))
        assert status == 200
    info = body["ctrl"]
    assert info["budget_class"] in {"<1x", "1-1.5x", "1.5-2x", "2-3x", "3-5x", ">=5x"}
    row = run_query(Workspace(ws.root), "SELECT * FROM requests WHERE status = 'ok' AND request_id = "
                                        f"'{body['id']}'").to_pylist()[0]
    assert row["reply_reserve_ms"] > 0 and row["reserve_ms"] > row["reply_reserve_ms"]
    assert row["arrival_rate_rps"] > 0 and row["arrival_cap_ms"] is not None
    assert info["reserve_ms"] == row["reserve_ms"] and info["arrival_cap_ms"] == row["arrival_cap_ms"]
    after = row["reserve_ms"] - row["reply_reserve_ms"]
    decided = min([row["budget_left_ms"]] + [cap - after for cap in (row["queue_cap_ms"], row["arrival_cap_ms"])
                                             if cap is not None])
    assert row["controller_budget_ms"] == pytest.approx(decided * row["budget_margin"] / row["latency_scale"],
                                                        rel=1e-9)
    status, models = request(server_a, "GET", "/v1/models")
    about = models["data"][0]["ctrl"]
    assert about["met_target"] == 0.95 and about["arrival_rate_rps"] > 0
    assert about["overhead_reserve_ms"] > 0 and row["budget_class"] in about["budget_margins"]
    status, metrics = request(server_a, "GET", "/metrics")
    assert f'ctrl_budget_margin{{budget_class="{row["budget_class"]}"}}' in metrics["text"]
    assert "ctrl_arrival_rate " in metrics["text"]


def _ok_count(ws) -> int:
    lines = [json.loads(line) for path in (ws.root / "requests").glob("*.jsonl")
             for line in path.read_text().splitlines()]
    return sum(1 for r in lines if r["status"] == "ok")


def test_sigkill_loses_no_recorded_request_and_leaves_no_half_line(serve_ws, tmp_path):
    """Kill -9 under load: every answered request is in the log, and every line is whole JSON."""
    _, ws, _ = serve_ws
    server = start_server(ws.root, tmp_path / "log.txt", "--controller", "offline-run", "--max-queue", "4")
    answered: list[str] = []

    def client() -> None:
        for _ in range(50):
            try:
                status, body = request(server, "POST", "/v1/chat/completions", chat_body("Count?", max_tokens=2),
                                       timeout=30)
            except OSError:
                return
            if status == 200:
                answered.append(body["id"])

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(answered) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    for t in threads:
        t.join()
    logged = {}
    log_files = sorted((ws.root / "requests").glob(f"*-{server.process.pid}.jsonl"))
    assert len(log_files) == 1
    raw = log_files[0].read_bytes()
    assert raw.endswith(b"\n")
    for line in raw.decode().splitlines():
        record = json.loads(line)  # every line is whole
        logged[record["request_id"]] = record
    assert len(answered) >= 5 and set(answered) <= set(logged)


# -- load: queue, disconnects, draining --------------------------------------------------------

def long_request_body(model: str, max_tokens: int = 200) -> bytes:
    """A request that keeps the model busy for a while: the largest knobs, a large image, many tokens."""
    knobs = {"max_crops": 12, "top_k": 8, "num_active_blocks": 16}
    image = Image.new("RGB", (900, 700), (10, 200, 30))
    return chat_body([{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {
        "url": png_data_uri(image)}}], model=model, max_tokens=max_tokens, knobs=knobs)


AUTH = {"Authorization": "Bearer secret-key"}


def test_api_key_is_required_except_for_health(server_b):
    status, reply = request(server_b, "GET", "/v1/models")
    assert status == 401 and "API key" in one_line_error(reply)
    status, reply = request(server_b, "POST", "/v1/chat/completions", chat_body("What?", model="molmoe-test"),
                            {"Authorization": "Bearer wrong"})
    assert status == 401
    assert request(server_b, "GET", "/health")[0] == 200
    client = openai.OpenAI(base_url=server_b.base_url + "/v1", api_key="secret-key")
    reply = client.chat.completions.create(model="molmoe-test", messages=[{"role": "user", "content": "What?"}],
                                           max_tokens=2, extra_body={"latency_budget_ms": 200})
    extra = reply.model_extra["ctrl"]
    assert extra["knobs"]["insertion_position"] >= 1  # the online controller's stage 2 runs inside the prefill
    assert extra["controller_run"] == "online-controller.pt"


def test_a_full_queue_answers_503_with_retry_after(server_b):
    results: list[tuple[int, dict]] = []
    first = threading.Thread(target=lambda: results.append(request(
        server_b, "POST", "/v1/chat/completions", long_request_body("molmoe-test"), AUTH)))
    first.start()
    deadline = time.monotonic() + 30
    while request(server_b, "GET", "/health")[1]["queue_length"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, reply = request(server_b, "POST", "/v1/chat/completions", chat_body("What?", model="molmoe-test"), AUTH)
    first.join()
    assert status == 503 and int(reply["_headers"]["retry-after"]) >= 1
    assert "queue full" in one_line_error(reply)
    assert results[0][0] == 200
    status, _ = request(server_b, "POST", "/v1/chat/completions", chat_body("What?", model="molmoe-test"), AUTH)
    assert status == 200


def test_a_client_that_disconnects_stops_its_work(server_b, serve_ws):
    _, ws, _ = serve_ws
    body = long_request_body("molmoe-test")
    sock = socket.create_connection(("127.0.0.1", server_b.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer secret-key\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while request(server_b, "GET", "/health")[1]["queue_length"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    sock.close()
    deadline = time.monotonic() + 30
    while request(server_b, "GET", "/health")[1]["queue_length"] != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    records = [json.loads(line) for path in (ws.root / "requests").glob(f"*-{server_b.process.pid}.jsonl")
               for line in path.read_text().splitlines()]
    cancelled = [r for r in records if r["status"] == "cancelled"]
    assert cancelled and cancelled[-1]["answer"] is None
    status, _ = request(server_b, "POST", "/v1/chat/completions", chat_body("What?", model="molmoe-test"), AUTH)
    assert status == 200


def test_sigterm_drains_the_request_in_flight_and_exits_0(serve_ws, tmp_path):
    _, ws, _ = serve_ws
    server = start_server(ws.root, tmp_path / "log.txt", "--controller", "offline-run")
    results: list[tuple[int, dict]] = []
    body = long_request_body("embedded", max_tokens=100)
    worker = threading.Thread(target=lambda: results.append(request(server, "POST", "/v1/chat/completions", body)))
    worker.start()
    deadline = time.monotonic() + 30
    while request(server, "GET", "/health")[1]["queue_length"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.process.send_signal(signal.SIGTERM)
    worker.join()
    assert server.process.wait(timeout=60) == 0, server.log()
    assert results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] >= 1


# -- the engine in-process ------------------------------------------------------------------------

class RecordingDecider:
    """Fixed knobs; remembers the budget each stage was given."""

    phase, controller_run = "offline", "recording"
    max_crops_values = (1, 2)
    budget_range_ms = (10.0, 1000.0)
    reads_prompt_tokens = False

    def __init__(self, reference_latency_ms: dict | None = None) -> None:
        from controller.cost import LatencyScale
        from controller.machine import MachineCost

        self.budgets: list[float] = []
        self.reference_latency_ms = reference_latency_ms or {}
        self.cost = MachineCost(LatencyScale(self.reference_latency_ms))

    def stage1(self, lang, tiling_crops, budget_ms):
        from serve.deciders import Stage1Choice

        self.budgets.append(budget_ms)
        self.tiling = tiling_crops
        return Stage1Choice(2, 0, None, "controller")

    def stage2(self, choice, inputs):
        from serve.deciders import held_to_machine

        self.image_feature = inputs.image_feature
        return held_to_machine(choice, 2, 3, inputs, self.cost)  # as an offline controller is


def decider_spent(row: dict) -> float:
    """Time before the stage-1 decision: arrival to stage 1, plus stage 1 (its decision is instant here)."""
    return row["waited_ms"] + row["latency_stage1_ms"]


def test_stage_1_reads_the_budget_less_the_time_already_waited(embedded_runtime, tmp_path):
    from pipeline.workspace import Workspace
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog

    decider = RecordingDecider()
    engine = Engine(embedded_runtime, decider, model_name="embedded", max_queue=1, default_budget_ms=None,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws")))
    assert engine.default_budget_ms == 1000.0  # the top of the controller's range
    image = Image.new("RGB", (640, 320), (200, 20, 20))
    request_ = ChatRequest("embedded", "What color?", image, 2, 900.0)
    arrived = time.perf_counter() - 0.25  # the request arrived 250 ms ago
    job = new_job(request_, engine, arrived, datetime.now(UTC), 0.0)
    result = engine.execute(job)
    assert 900.0 - 250.0 - 50.0 < decider.budgets[0] <= 900.0 - 250.0  # nothing reserved before the first request
    # the work after stage 1 outside the vision pass, prefill and decode is reserved from the next budget:
    # at least preprocessing and stage 2, at most everything but the hook-timed model work
    row = result.record
    # what the plan counted as spent before the decision (its budget left, with nothing reserved yet): the
    # reserve's own reading of that time, not one timed apart from it
    spent = 900.0 - row["budget_left_ms"]
    outside_hooks = row["latency_total_ms"] - row["latency_model_ms"] - spent
    assert row["latency_preprocess_ms"] + row["latency_stage2_ms"] <= engine.overhead_reserve_ms() <= (
        outside_hooks + 1e-6)
    second = engine.execute(new_job(request_, engine, time.perf_counter(), datetime.now(UTC), 0.0))
    assert decider.budgets[1] == pytest.approx(900.0 - second.record["reserve_ms"], abs=25.0)
    assert second.record["budget_left_ms"] == decider.budgets[1]
    engine.stop()
    # the tiling of a 2:1 image at max_crops 1 and 2, from its size alone
    assert decider.tiling.tolist() == [float(r * c) for r, c in (embedded_runtime.tiling(640, 320, 1),
                                                                 embedded_runtime.tiling(640, 320, 2))]
    assert decider.image_feature is not None and torch.isfinite(decider.image_feature).all()
    row = result.record
    assert (row["max_crops"], row["top_k"], row["num_active_blocks"]) == (2, 2, 3)
    assert row["latency_total_ms"] >= 250.0 and row["waited_ms"] >= 250.0
    assert row["met"] == (row["latency_total_ms"] <= 900.0)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_request_the_log_cannot_record_is_still_answered_and_counted(embedded_runtime, tmp_path):
    from pipeline.workspace import Workspace
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog

    warnings: list[str] = []
    # /dev/full fails every write with ENOSPC: a disk that is full for the whole test
    log = RequestLog(Workspace(tmp_path / "ws"), path=Path("/dev/full"), warn=warnings.append)
    engine = Engine(embedded_runtime, RecordingDecider(), model_name="embedded", max_queue=1, default_budget_ms=None,
                    threads=1, request_log=log)
    request_ = ChatRequest("embedded", "What color?", Image.new("RGB", (64, 64)), 2, 900.0)
    for _ in range(2):
        result = engine.execute(new_job(request_, engine, time.perf_counter(), datetime.now(UTC), 0.0))
        assert result.record["status"] == "ok" and result.record["answer"] is not None
    engine.stop()
    assert engine.metrics.registry.get_sample_value("ctrl_request_log_failures_total") == 2
    assert log.failures == 2
    assert warnings == ["warning: request log /dev/full: No space left on device; requests are answered but not "
                        "recorded until writing works again (ctrl_request_log_failures_total counts them)"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_warning_that_cannot_be_written_does_not_fail_the_append(tmp_path):
    from pipeline.workspace import Workspace
    from serve.request_log import RequestLog

    def stderr_on_the_full_disk(message: str) -> None:
        with open("/dev/full", "w") as full:
            print(message, file=full, flush=True)

    log = RequestLog(Workspace(tmp_path / "ws"), path=Path("/dev/full"), warn=stderr_on_the_full_disk)
    assert [log.append({"request_id": f"r{i}"}) for i in range(3)] == [False, False, False]
    assert log.failures == 3


_FILL_AND_GROW = """
import json, subprocess, sys
from pipeline.workspace import Workspace
from serve.request_log import RequestLog

ws = Workspace(sys.argv[1])
warnings = []
log = RequestLog(ws, warn=warnings.append)
results = [log.append({"request_id": f"r{i}", "pad": "x" * 700}) for i in range(12)]
subprocess.run(["mount", "-o", "remount,size=1m", str(ws.requests_dir)], check=True)
results += [log.append({"request_id": f"r{i}", "pad": "x" * 700}) for i in range(12, 15)]
log.close()
print(json.dumps({"results": results, "warnings": warnings, "text": log.path.read_text()}))
"""


@pytest.mark.skipif(not small_disk_available(), reason="cannot mount a tmpfs in a private namespace here")
@pytest.mark.skipif(os.sysconf("SC_PAGE_SIZE") != 4096, reason="the record counts assume 4 KiB pages")
def test_a_full_disk_cuts_one_request_log_line_at_most_and_recording_resumes(tmp_path):
    ws = tmp_path / "ws"
    script = tmp_path / "fill.py"
    script.write_text(_FILL_AND_GROW)
    (out,) = on_small_disk(ws / "requests", "4k", [f"{sys.executable} {script} {ws}"])
    assert out.splitlines()[-1] == "exit 0", out
    got = json.loads(out.splitlines()[0])
    # a record is 731 bytes: five fit in a 4 KiB page, the sixth is cut short, then nothing until the disk grows
    assert got["results"] == [True] * 5 + [False] * 7 + [True] * 3
    assert len(got["warnings"]) == 2 and "No space left on device" in got["warnings"][0]
    assert got["warnings"][1].endswith("recording again (7 request(s) were not recorded)")

    def request_id(line: str) -> str | None:
        try:
            return json.loads(line)["request_id"]
        except ValueError:
            return None

    assert [request_id(line) for line in got["text"].splitlines()] == ["r0", "r1", "r2", "r3", "r4", None, "r12",
                                                                       "r13", "r14"]


# -- options: written once --------------------------------------------------------------------

def test_cli_options_and_docs_take_default_and_help_from_the_config():
    from dataclasses import MISSING, fields

    import typer.main

    from cli import app
    from serve.config import ServeConfig, options_markdown

    command = typer.main.get_command(app).commands["serve"]
    params = {p.name: p for p in command.params}
    shared = {"workspace"}  # one option of every command (cli/), not of this one alone
    for f in fields(ServeConfig):
        param = params[f.name]
        assert f.name in shared or param.help == f.metadata["help"], f.name
        if f.default is not MISSING:
            assert param.default == f.default, f.name
    assert options_markdown() in (ROOT / "docs" / "serving.md").read_text()


def test_config_refuses_bad_values_with_one_line():
    from serve.config import ServeConfig

    for kwargs, text in (({"host": "10.1.2.3"}, "not a loopback address"), ({"port": 70000}, "--port must be"),
                         ({"max_queue": -1}, "--max-queue must be"), ({"default_budget_ms": float("nan")},
                                                                        "--default-budget-ms must be"),
                         ({"api_key": " "}, "--api-key must not be empty"),
                         ({"latency_scale": 0.0}, "--latency-scale must be a positive number, got 0.0"),
                         ({"latency_scale": float("inf")}, "--latency-scale must be a positive number, got inf"),
                         ({"latency_scale_quantile": 1.2}, r"--latency-scale-quantile must be in \[0, 1\], got 1.2"),
                         ({"met_target": 1.0}, r"--met-target must be in \[0, 1\) \(0: no margin\), got 1.0")):
        with pytest.raises(ValueError, match=text):
            ServeConfig(**kwargs)
    assert ServeConfig(host="::1").host == "::1" and ServeConfig(host="10.1.2.3", allow_remote=True, api_key="k")
    with pytest.raises(ValueError, match="without --api-key would let anyone"):
        ServeConfig(host="0.0.0.0", allow_remote=True)
    assert ServeConfig(host="0.0.0.0", allow_remote=True, auth_by_proxy=True).api_key is None
    with pytest.raises(ValueError, match="--device must be cpu, cuda or cuda:N, got 'tpu'"):
        ServeConfig(device="tpu")
    assert ServeConfig(device="cuda:1").device == "cuda:1"


def in_process_engine(runtime, decider, tmp_path, scale=None, met_target=None):
    from pipeline.workspace import Workspace
    from serve.engine import Engine
    from serve.request_log import RequestLog

    return Engine(runtime, decider, model_name="embedded", max_queue=1, default_budget_ms=None, threads=1,
                  request_log=RequestLog(Workspace(tmp_path / "ws")), latency_scale=scale, met_target=met_target)


def serve_once(engine, budget_ms: float = 900.0) -> dict:
    from serve.engine import new_job
    from serve.protocol import ChatRequest

    request_ = ChatRequest("embedded", "What color?", Image.new("RGB", (640, 320), (200, 20, 20)), 2, budget_ms)
    return engine.execute(new_job(request_, engine, time.perf_counter(), datetime.now(UTC), 0.0)).record


def test_the_controller_reads_budgets_divided_by_the_measured_latency_scale(embedded_runtime, tmp_path):
    from controller.cost import LatencyScale

    decider = RecordingDecider({(2, 2, 3): 10.0})  # the controller's median training latency of its 2/2/3
    scale = LatencyScale(decider.reference_latency_ms, quantile=0.5)
    engine = in_process_engine(embedded_runtime, decider, tmp_path, scale)
    # a budget that stays above the reference latency at any scale a loaded machine measures, so
    # that the controller (not the cheapest rule) decides the second request
    first = serve_once(engine, budget_ms=60_000.0)
    assert first["latency_scale"] == 1.0 and decider.budgets[0] == first["budget_left_ms"]  # nothing measured yet
    # the first request's model time (vision pass, prefill, decoding) per ms of the reference: between the
    # hook-timed parts and everything after stage 1 but preprocessing and stage 2
    low = first["latency_vision_ms"] + first["latency_prefill_ms"] + first["latency_decode_ms"]
    high = (first["latency_total_ms"] - decider_spent(first) - first["latency_preprocess_ms"]
            - first["latency_stage2_ms"])
    measured = scale.value
    assert scale.source == "measured" and low / 10.0 <= measured <= high / 10.0
    second = serve_once(engine, budget_ms=60_000.0)
    assert second["latency_scale"] == measured
    assert decider.budgets[1] == pytest.approx(second["budget_left_ms"] / second["latency_scale"], rel=1e-12)
    engine.stop()


def test_a_fixed_latency_scale_is_applied_and_never_measured(embedded_runtime, tmp_path):
    from controller.cost import LatencyScale

    decider = RecordingDecider({(2, 2, 3): 10.0})
    engine = in_process_engine(embedded_runtime, decider, tmp_path, LatencyScale(decider.reference_latency_ms,
                                                                                 fixed=2.0))
    rows = [serve_once(engine, 700.0) for _ in range(2)]
    engine.stop()
    assert [r["latency_scale"] for r in rows] == [2.0, 2.0] and engine.latency_scale.source == "fixed"
    assert decider.budgets == [pytest.approx(r["budget_left_ms"] / 2.0, rel=1e-12) for r in rows]


def test_the_budget_margin_tracks_a_met_share():
    import math

    from serve.budget import BudgetMargin

    margin = BudgetMargin(0.9, step=0.1, bounds=(0.5, 1.2))
    assert margin.value == 1.0
    assert margin.observe(False) == pytest.approx(math.exp(-0.09))  # a miss: down by step x target
    assert margin.observe(True) == pytest.approx(math.exp(-0.08))  # within budget: up by step x (1 - target)
    for _ in range(100):
        margin.observe(True)
    assert margin.value == pytest.approx(1.2)  # held at the upper bound
    for _ in range(100):
        margin.observe(False)
    assert margin.value == pytest.approx(0.5)
    # misses at the target rate leave it where it was: 9 met and 1 missed per 10 requests
    steady = BudgetMargin(0.9, step=0.1)
    for _ in range(5):
        for met in [True] * 9 + [False]:
            steady.observe(met)
    assert steady.value == pytest.approx(1.0)
    off = BudgetMargin(None)
    assert off.observe(False) == 1.0 and off.value == 1.0
    for bad in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match="the met target must be in"):
            BudgetMargin(bad)


def test_a_missed_budget_shrinks_the_budget_the_controller_reads_next(embedded_runtime, tmp_path):
    import math

    from controller.cost import LatencyScale
    from serve.engine import new_job
    from serve.protocol import ChatRequest

    decider = RecordingDecider({(2, 2, 3): 10.0})
    engine = in_process_engine(embedded_runtime, decider, tmp_path,
                               LatencyScale(decider.reference_latency_ms, fixed=1.0), met_target=0.95)
    # a budget of 500 ms (50 x the cheapest configuration's 10) that had passed before the request reached the model
    late = ChatRequest("embedded", "What color?", Image.new("RGB", (640, 320), (200, 20, 20)), 2, 500.0)
    missed = engine.execute(new_job(late, engine, time.perf_counter() - 1.0, datetime.now(UTC), 0.0)).record
    assert missed["met"] is False and missed["budget_margin"] == 1.0 and missed["budget_class"] == ">=5x"
    met = serve_once(engine, 5000.0)  # the same class
    assert met["met"] is True and met["budget_margin"] == pytest.approx(math.exp(-0.095))
    assert missed["decided_by"] == "cheapest" and met["decided_by"] == "controller"
    assert decider.budgets == [pytest.approx(met["budget_left_ms"] * math.exp(-0.095), rel=1e-12)]
    fixed = engine.execute(new_fixed_job(engine)).record  # fixed knobs: neither read nor moved
    assert fixed["budget_margin"] == 1.0
    impossible = serve_once(engine, 1.0)  # below the cheapest configuration: its own class, no margin moved
    assert impossible["budget_class"] == "<1x" and impossible["met"] is False
    assert engine.planner.margins() == {">=5x": pytest.approx(math.exp(-0.095 + 0.005))}
    engine.stop()


def test_the_margin_judges_a_request_on_the_clients_clock(embedded_runtime, tmp_path):
    """Within budget on the server's clock, past it once the reply's time is added: a miss for the margin."""
    from controller.cost import LatencyScale

    decider = RecordingDecider({(2, 2, 3): 0.001})
    engine = in_process_engine(embedded_runtime, decider, tmp_path,
                               LatencyScale(decider.reference_latency_ms, fixed=1.0), met_target=0.95)
    engine.planner.observe_reply(1000.0)  # replies have taken a second to write
    row = serve_once(engine, 1000.5)  # 1000.5 / (0.001 + 1000): class 1-1.5x
    assert row["met"] is True and row["budget_class"] == "1-1.5x" and row["reply_reserve_ms"] == 1000.0
    assert engine.planner.margins() == {"1-1.5x": pytest.approx(math.exp(-0.095))}
    engine.stop()


def new_fixed_job(engine):
    from serve.engine import new_job
    from serve.protocol import ChatRequest

    request_ = ChatRequest("embedded", "What color?", Image.new("RGB", (640, 320), (200, 20, 20)), 2, 1.0,
                           knobs={"max_crops": 1, "top_k": 2, "num_active_blocks": 3})
    return new_job(request_, engine, time.perf_counter(), datetime.now(UTC), 0.0)


def test_warm_up_runs_each_crops_choice_fastest_and_slowest_and_seeds_the_scale(embedded_runtime, tmp_path):
    from serve.warmup import warm_up, warmup_configs

    reference = {(1, 2, 3): 5.0, (1, 4, 4): 9.0, (1, 3, 3): 7.0, (2, 2, 3): 10.0, (6, 8, 16): 80.0}
    engine = in_process_engine(embedded_runtime, RecordingDecider(reference), tmp_path)
    assert warmup_configs(engine) == [(1, 2, 3), (1, 4, 4), (2, 2, 3)]  # crops 6 is not a choice of this controller
    results = warm_up(engine, max_tokens=3)
    assert len(results) == 6  # twice: it seeds the latency scale
    # as long as asked: a shorter warm-up than the requests served seeds too small a scale
    assert [r.num_output_tokens for r in results] == [3] * 6
    assert engine.latency_scale.source == "measured" and engine.latency_scale.value > 0
    assert engine.served == 0 and engine.log.path.stat().st_size == 0  # unrecorded
    engine.stop()
    plain = in_process_engine(embedded_runtime, RecordingDecider(), tmp_path)  # no references: model defaults, once
    assert warmup_configs(plain) == [(1, 8, 16), (2, 8, 16)]
    assert len(warm_up(plain, max_tokens=2)) == 2 and plain.latency_scale.source == "none"
    plain.stop()


def test_queue_cap_leaves_each_waiting_request_room_for_the_cheapest_configuration():
    from serve.budget import queue_cap_ms

    assert queue_cap_ms([], 30.0) is None
    # one waiting with 100 ms left: this one may take 100 - 30 = 70 ms
    assert queue_cap_ms([100.0], 30.0) == 70.0
    # the second waits for the first too: 150 - 2 x 30 = 90; the tighter first one decides
    assert queue_cap_ms([100.0, 150.0], 30.0) == 70.0
    assert queue_cap_ms([200.0, 110.0], 30.0) == 50.0
    # a waiting request that misses even when this one is the cheapest caps nothing (40 - 30 < 30)
    assert queue_cap_ms([40.0], 30.0) is None
    assert queue_cap_ms([40.0, 130.0], 30.0) == 70.0


def test_the_controller_reads_the_budget_capped_by_the_requests_waiting(embedded_runtime, tmp_path):
    """Two requests wait behind the one deciding; the controller's budget leaves them room."""
    from controller.cost import LatencyScale
    from serve.engine import new_job
    from serve.protocol import ChatRequest

    decider = RecordingDecider({(2, 2, 3): 10.0, (1, 2, 3): 8.0})  # cheapest reference: 8 ms
    engine = in_process_engine(embedded_runtime, decider, tmp_path, LatencyScale(decider.reference_latency_ms,
                                                                                 fixed=2.0))
    image = Image.new("RGB", (640, 320), (200, 20, 20))
    now = time.perf_counter()
    for budget in (300.0, 100.0):  # queued, never started (the worker thread is not running)
        engine.submit(new_job(ChatRequest("embedded", "What color?", image, 2, budget), engine, now,
                              datetime.now(UTC), 0.0))
    row = engine.execute(new_job(ChatRequest("embedded", "What color?", image, 2, 900.0), engine, now,
                                 datetime.now(UTC), 0.0)).record
    # cheapest served = 8 x 2 + reserve (0: nothing served before); the waiting are served earliest deadline
    # first, so the 100 ms one is next: 100 - 1 x 16 = 84 (less the few ms since the jobs arrived), below
    # the 300 ms one's 300 - 2 x 16 and this request's own 900
    assert row["reserve_ms"] == 0.0
    assert 76.0 < row["queue_cap_ms"] <= 84.0
    assert decider.budgets[0] == pytest.approx(row["queue_cap_ms"] / 2.0)
    assert row["budget_left_ms"] > 800.0  # its own budget, uncapped, is still recorded
    engine.planner.queue_aware = False
    second = serve_once(engine)
    assert second["queue_cap_ms"] is None and decider.budgets[1] == pytest.approx(second["budget_left_ms"] / 2.0)
    engine.stop()


def test_the_guard_runs_a_smaller_configuration_when_the_chosen_one_cannot_fit(embedded_runtime, tmp_path):
    from controller.cost import LatencyScale

    decider = RecordingDecider({(2, 2, 3): 100.0, (2, 1, 3): 5.0})  # it always chooses 2/2/3
    engine = in_process_engine(embedded_runtime, decider, tmp_path,
                               LatencyScale(decider.reference_latency_ms, fixed=1.0))
    wide = serve_once(engine, 900.0)  # reads about 890 ms: 2/2/3 (100 ms) fits
    assert (wide["top_k"], wide["guarded_from"]) == (2, None)
    tight = serve_once(engine, 60.0)  # reads under 60 ms: 2/2/3 cannot fit, 2/1/3 (5 ms) does
    assert (tight["max_crops"], tight["top_k"], tight["num_active_blocks"]) == (2, 1, 3)
    assert tight["guarded_from"] == "2/2/3" and tight["decided_by"] == "controller"
    engine.scheduler.guard = False
    assert serve_once(engine, 60.0)["top_k"] == 2
    engine.stop()


def test_arrivals_are_counted_at_the_door_apart_by_who_chooses_their_cost(embedded_runtime, tmp_path):
    """Five controller requests that reached the server 0.1 s apart read as 10 requests/s (however late
    they were parsed); requests with fixed knobs and budgets below the cheapest configuration are
    counted apart, as load the controller does not choose."""
    from controller.cost import LatencyScale
    from pipeline.workspace import Workspace
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog

    decider = RecordingDecider({(2, 2, 3): 10.0})
    engine = Engine(embedded_runtime, decider, model_name="embedded", max_queue=16, default_budget_ms=None,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws")),
                    latency_scale=LatencyScale(decider.reference_latency_ms, fixed=1.0), met_target=0.95)
    image = Image.new("RGB", (640, 320), (200, 20, 20))
    door = time.perf_counter() - 10.0
    for i in range(5):
        engine.submit(new_job(ChatRequest("embedded", "What color?", image, 2, 500.0), engine, door + 0.1 * i,
                              datetime.now(UTC), 0.0))
    for budget, knobs in ((500.0, {"max_crops": 1, "top_k": 2, "num_active_blocks": 3}), (5.0, None)):
        engine.submit(new_job(ChatRequest("embedded", "What color?", image, 2, budget, knobs=knobs), engine,
                              door + 0.2, datetime.now(UTC), 0.0))
    rate, load = engine.planner.load(door + 0.4)
    assert rate == pytest.approx(10.0)  # (5 - 1) / (0.4 - 0.0): the five controller arrivals only
    assert load.rate_other == 0.0  # two others: too few for a rate of their own
    engine.stop()


def test_a_request_the_queue_leaves_no_room_for_is_refused_on_arrival(embedded_runtime, tmp_path):
    """Five requests wait, each at least the cheapest configuration's 200 ms: a sixth with a 1000 ms budget
    would need 5 x 200 + 200 ms; refused with 503 and recorded (its knobs fixed or not), while one with room
    and one without a budget of its own are queued."""
    import json

    from controller.cost import LatencyScale
    from pipeline.workspace import Workspace
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog
    from serve.scheduling import BudgetUnreachable

    decider = RecordingDecider({(2, 2, 3): 150.0, (1, 2, 3): 100.0})  # the cheapest: 100 ms x scale 2
    engine = Engine(embedded_runtime, decider, model_name="embedded", max_queue=16, default_budget_ms=None,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws")),
                    latency_scale=LatencyScale(decider.reference_latency_ms, fixed=2.0), met_target=0.95)
    image = Image.new("RGB", (640, 320), (200, 20, 20))

    def job(budget, knobs=None, when_unreachable="refuse"):
        return new_job(ChatRequest("embedded", "What color?", image, 2, budget, knobs=knobs,
                                   when_unreachable=when_unreachable), engine, time.perf_counter(),
                       datetime.now(UTC), 0.0)

    engine.submit(job(50.0))  # below the cheapest configuration, but nothing is ahead: queued
    for _ in range(4):
        engine.submit(job(1000.0))  # the 50 ms one can no longer make it: only these four count as ahead
    engine.submit(job(1150.0))  # 4 x 200 + 200 = 1000 <= 1150: queued
    with pytest.raises(BudgetUnreachable) as refused:
        engine.submit(job(1190.0))  # now 5 x 200 ahead + 200 > 1190
    assert refused.value.status == 503 and refused.value.code == "budget_unreachable"
    assert refused.value.retry_after_s == 2  # the six waiting at 200 ms: 1.2 s
    with pytest.raises(BudgetUnreachable):  # fixed knobs cost at least the cheapest configuration's time
        engine.submit(job(1190.0, knobs={"max_crops": 1, "top_k": 2, "num_active_blocks": 3}))
    engine.submit(job(None))  # no budget of its own (the default)
    late = job(1190.0, when_unreachable="run")  # asked to be run anyway: queued, marked for the cheapest
    engine.submit(late)
    assert late.unreachable and engine.pending == 8
    engine.stop()
    rows = [json.loads(line) for line in engine.log.path.read_text().splitlines()]
    assert [(r["status"], r["budget_ms"]) for r in rows] == [("refused", 1190.0)] * 2
    assert "1,000 ms of the model at the least" in rows[0]["error"]


def test_a_queued_request_whose_budget_is_left_behind_is_dropped_not_run(embedded_runtime, tmp_path):
    """The cheapest configuration takes 200 ms: a 300 ms request that waited 150 ms can no longer make it."""
    import json

    from controller.cost import LatencyScale
    from pipeline.workspace import Workspace
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog
    from serve.scheduling import BudgetLeftBehind

    decider = RecordingDecider({(2, 2, 3): 150.0, (1, 2, 3): 100.0})
    engine = Engine(embedded_runtime, decider, model_name="embedded", max_queue=16, default_budget_ms=None,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws")),
                    latency_scale=LatencyScale(decider.reference_latency_ms, fixed=2.0), met_target=0.95)
    image = Image.new("RGB", (640, 320), (200, 20, 20))

    def job(budget, waited_s, behind=1, **kwargs):
        made = new_job(ChatRequest("embedded", "What color?", image, 2, budget, **kwargs), engine,
                       time.perf_counter() - waited_s, datetime.now(UTC), 0.0)
        made.queue_length = behind  # requests waiting or running when it arrived
        return made

    assert engine._expired(job(300.0, 0.15, behind=0)) is None  # it found the server idle: run as on arrival
    dropped = engine._expired(job(300.0, 0.15))
    assert isinstance(dropped, BudgetLeftBehind) and dropped.status == 504 and dropped.code == "budget_unreachable"
    assert engine._expired(job(300.0, 0.0)) is None  # 300 ms left: worth running
    assert engine._expired(job(100.0, 0.05)) is None  # a budget nothing meets runs as before (cheapest)
    assert isinstance(engine._expired(job(300.0, 0.15, knobs={"max_crops": 1, "top_k": 2, "num_active_blocks": 3})),
                      BudgetLeftBehind)  # fixed knobs take at least the cheapest configuration's time
    assert engine._expired(job(300.0, 0.15, when_unreachable="run")) is None
    engine.default_budget_ms = 300.0
    assert engine._expired(job(None, 0.15)) is None  # the default budget: only the queue deadline drops it
    engine.scheduler.refuse_unreachable = False
    assert engine._expired(job(300.0, 0.15)) is None
    engine.stop()
    rows = [json.loads(line) for line in engine.log.path.read_text().splitlines()]
    assert [(r["status"], r["budget_ms"]) for r in rows] == [("dropped", 300.0)] * 2
    assert "less than the cheapest configuration's 200 ms" in rows[0]["error"]


def test_a_model_that_needs_an_image_refuses_a_question_without_one(embedded_runtime, tmp_path):
    from runtime.embedded_model import RECIPE_FILE
    from serve.protocol import Limits, RequestError, parse_chat_request

    text_only = {"model": "testbed", "messages": [{"role": "user", "content": "What color is the background?"}]}
    image_only = Limits(default_max_tokens=4, max_tokens_limit=8, max_image_pixels=10_000, image_required=True)
    with pytest.raises(RequestError) as refused:
        parse_chat_request(text_only, image_only)
    assert refused.value.status == 400 and refused.value.param == "messages[0].content"
    assert refused.value.code == "image_required" and "'testbed'" in str(refused.value)
    uri = png_data_uri(Image.new("RGB", (32, 32), (0, 0, 200)))
    with_image = {**text_only, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What color is the background?"}, {"type": "image_url", "image_url": {"url": uri}}]}]}
    assert parse_chat_request(with_image, image_only).image is not None
    anything = Limits(default_max_tokens=4, max_tokens_limit=8, max_image_pixels=10_000)
    assert parse_chat_request(text_only, anything).image is None
    # the embedded model answers text; a directory that records a testbed recipe is the trained testbed
    assert embedded_runtime.answers_without_image is True
    assert not (embedded_runtime.path / RECIPE_FILE).exists()


def test_a_budget_below_every_reference_latency_takes_the_cheapest_configuration(embedded_runtime, tmp_path):
    from controller.cost import LatencyScale

    decider = RecordingDecider({(2, 2, 3): 10.0, (1, 2, 3): 5.0, (1, 4, 4): 7.0})
    engine = in_process_engine(embedded_runtime, decider, tmp_path,
                               LatencyScale(decider.reference_latency_ms, fixed=2.0))
    tight = serve_once(engine, 9.0)  # at most 9 ms left, read as 4.5 profile ms: under the cheapest 5 ms
    assert tight["decided_by"] == "cheapest" and decider.budgets == []  # the controller was not asked
    assert (tight["max_crops"], tight["top_k"], tight["num_active_blocks"]) == (1, 2, 3)
    assert tight["controller_run"] == "recording"  # still the controller's request, not a fixed-knobs one
    roomy = serve_once(engine, 900.0)
    assert roomy["decided_by"] == "controller" and len(decider.budgets) == 1
    engine.stop()


def test_an_image_path_the_file_system_refuses_is_a_400_naming_the_field(tmp_path):
    from serve.protocol import Limits, RequestError, load_image

    limits = Limits(default_max_tokens=4, max_tokens_limit=8, max_image_pixels=10_000, local_images=tmp_path,
                    max_image_file_bytes=100)
    (tmp_path / "big.png").write_bytes(b"\x89PNG" + b"0" * 200)
    for path, text in ((str(tmp_path / "a\x00b.png"), "must not contain a NUL character"),
                       (str(tmp_path / ("x" * 300 + ".png")), "cannot read the image file (File name too long)"),
                       (str(tmp_path / "big.png"), "the image file has 204 bytes, more than the server's limit")):
        with pytest.raises(RequestError) as refused:
            load_image(path, limits, "messages[0].content[1].image_url.url")
        assert refused.value.status == 400 and text in refused.value.message
        assert refused.value.param == "messages[0].content[1].image_url.url"


def test_a_taken_port_is_refused_before_the_model_loads():
    from serve.startup import check_bind

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {port}: cannot listen on 127.0.0.1:{port}"):
            check_bind("127.0.0.1", port)
    check_bind("127.0.0.1", 0)  # any free port: nothing to check


def test_a_repeated_key_is_named_by_the_shared_json_reader():
    from pipeline.parse import RepeatedKeyError, loads_unique_keys

    assert loads_unique_keys(b'{"a": {"b": 1, "c": 2}}') == {"a": {"b": 1, "c": 2}}
    with pytest.raises(RepeatedKeyError) as repeated:
        loads_unique_keys(b'{"a": {"b": 1, "b": 2}}')
    assert repeated.value.key == "b"
    assert math.isnan(loads_unique_keys(b'{"x": NaN}')["x"])  # the stdlib parser's literal, accepted


def test_a_left_requests_outcome_is_not_left_as_an_exception_no_one_reads():
    import asyncio

    from serve.engine import Cancelled, Job

    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(None, 1.0, "request", 0.0, datetime.now(UTC), 0.0, 0) for _ in range(2)]
        for job in jobs:
            job.loop, job.future = loop, loop.create_future()
        jobs[0].cancelled.set()  # its client went away: the handler answered 499 and returned
        for job in jobs:
            job.finish(Cancelled())
        loop.run_until_complete(asyncio.sleep(0))
        assert jobs[0].future.cancelled()  # nothing for asyncio to report as "never retrieved"
        assert isinstance(jobs[1].future.exception(), Cancelled)  # a waiting handler still gets the error
    finally:
        loop.close()


def test_a_full_queue_refuses_before_the_body_is_parsed(embedded_runtime, tmp_path):
    from serve.engine import new_job
    from serve.protocol import ChatRequest
    from serve.scheduling import Overloaded

    engine = in_process_engine(embedded_runtime, RecordingDecider(), tmp_path)  # max_queue 1, no worker
    engine.check_room()
    for _ in range(2):  # one running, one waiting
        engine.submit(new_job(ChatRequest("embedded", "What?", None, 2, 100.0), engine, time.perf_counter(),
                              datetime.now(UTC), 0.0))
    with pytest.raises(Overloaded):
        engine.check_room()
    engine.stop()


def test_the_budget_a_served_request_reads_is_its_budget_less_the_time_spent_and_the_reserve(
        embedded_runtime, tmp_path):
    """Budget 900 ms, 100 ms spent before stage 1, a reserve of 50 ms (the p90 of the recorded
    overheads), latency scale 2, margin 0.8: the controller reads (900 - 100 - 50) x 0.8 / 2 = 300 ms,
    less the few ms stage 1 itself takes before it decides."""
    from controller.cost import LatencyScale
    from serve.engine import new_job
    from serve.protocol import ChatRequest

    decider = RecordingDecider({(2, 2, 3): 10.0, (1, 2, 3): 5.0})
    engine = in_process_engine(embedded_runtime, decider, tmp_path,
                               LatencyScale(decider.reference_latency_ms, fixed=2.0), met_target=0.95)
    engine.planner.initial_margin = 0.8  # as a warm-up would have seeded it
    for after in [10.0] * 5 + [50.0] * 5:  # p90 of ten: the tenth smallest but one, 50 ms
        engine.planner.observe_served(after_ms=after, service_ms=100.0, adjustable=False, model_over_reference=None)
    request_ = ChatRequest("embedded", "What color?", Image.new("RGB", (640, 320), (200, 20, 20)), 2, 900.0)
    row = engine.execute(new_job(request_, engine, time.perf_counter() - 0.100, datetime.now(UTC), 0.0)).record
    assert row["reserve_ms"] == 50.0 and row["latency_scale"] == 2.0 and row["budget_margin"] == pytest.approx(0.8)
    stage1_ms = 15.0  # generous: stage 1 of the embedded model takes a few ms before the decision
    assert 750.0 - stage1_ms < row["budget_left_ms"] <= 750.0
    assert 300.0 - stage1_ms * 0.4 < decider.budgets[0] <= 300.0
    assert decider.budgets[0] == pytest.approx(row["budget_left_ms"] * 0.8 / 2.0, rel=1e-12)
    engine.stop()


def test_an_online_run_is_served_under_its_latency_guard(serve_ws, embedded_runtime, tmp_path_factory):
    """An online run with a guard, served by its run id: real clients over a socket, a bad request
    refused with one line, and the server still answering after it."""
    import openai

    from controller.latency_guard import GUARD_FILE, load_run_guard
    from online.config import OnlineTrainConfig
    from online.train import train_online

    tree, ws, _ = serve_ws
    run = train_online(OnlineTrainConfig(workspace=ws.root, from_run="offline-run", run_id="guarded", steps=1,
                                         samples_per_step=1, group_size=2, max_new_tokens=2, budget_min_ms=30.0,
                                         budget_max_ms=300.0, evaluate=False, check_every=0, guard_samples=1),
                       runtime=embedded_runtime)
    guard = load_run_guard(run.run_dir)
    # the run's guard, edited so that it expects the dearest configuration to be by far the fastest:
    # at a budget nothing else fits, a server that keeps to the guard runs it, the controller alone never
    dearest = max(guard.actions)
    guard.config_ratio[guard.actions.index(dearest)] = 1e-6
    guard.save(run.run_dir / GUARD_FILE)
    server = start_server(ws.root, tmp_path_factory.mktemp("server-guarded") / "log.txt", "--controller", "guarded")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        image = png_data_uri(Image.open(sample_image(tree)))
        content = [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": image}}]
        reply = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": content}],
                                               max_tokens=2, extra_body={"latency_budget_ms": 5})
        knobs = reply.model_extra["ctrl"]["knobs"]
        assert reply.model_extra["ctrl"]["controller_run"] == "guarded" and knobs["insertion_position"] >= 1
        assert (knobs["max_crops"], knobs["top_k"], knobs["num_active_blocks"]) == dearest
        status, reply = request(server, "POST", "/v1/chat/completions",
                                chat_body("What?", latency_budget_ms="fast"))
        assert status == 400 and "latency_budget_ms" in one_line_error(reply)
        assert request(server, "POST", "/v1/chat/completions", chat_body("What?", latency_budget_ms=200))[0] == 200
    finally:
        stop_server(server)


def test_a_gateways_objective_headers_state_the_budget(server_a):
    """x-slo-ttft-ms + x-slo-tpot-ms x (max_tokens - 1) is the budget of a request whose body states
    none (an OpenAI client through such a gateway changes nothing); the body's own budget wins; a
    per-token objective without a first-token one, or a bad number, is a 400 naming the header."""
    client = openai.OpenAI(base_url=server_a.base_url + "/v1", api_key="unused",
                           default_headers={"x-slo-ttft-ms": "400", "x-slo-tpot-ms": "50"})
    reply = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "How many?"}],
                                           max_tokens=3)
    assert (reply.model_extra["ctrl"]["budget_ms"], reply.model_extra["ctrl"]["budget_source"]) == (500.0, "request")
    status, body = request(server_a, "POST", "/v1/chat/completions", chat_body("How many?", max_tokens=4),
                           headers={"x-slo-ttft-ms": "250"})
    assert status == 200 and body["ctrl"]["budget_ms"] == 250.0  # the first token's deadline for the whole answer
    status, body = request(server_a, "POST", "/v1/chat/completions",
                           chat_body("How many?", max_tokens=3, latency_budget_ms=900),
                           headers={"x-slo-ttft-ms": "400", "x-slo-tpot-ms": "50"})
    assert status == 200 and body["ctrl"]["budget_ms"] == 900.0
    for headers, param, message in (({"x-slo-tpot-ms": "50"}, "x-slo-tpot-ms", "needs x-slo-ttft-ms beside it"),
                                    ({"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms", "got 'soon'"),
                                    ({"x-slo-ttft-ms": "-3"}, "x-slo-ttft-ms", "positive, finite"),
                                    ({"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "inf"}, "x-slo-tpot-ms", "got 'inf'")):
        status, body = request(server_a, "POST", "/v1/chat/completions", chat_body("How many?", max_tokens=3),
                               headers=headers)
        assert status == 400 and body["error"]["param"] == param and message in body["error"]["message"]
    assert_serving(server_a)
