"""What a hostile or careless client, and a workspace removed underneath, do to a real ``ctrl serve``:
connections that never finish, bodies that wait for a place in the queue, slivers of images,
requests from other sites' pages, paths in errors, and the statuses and counts each case ends with.

Each test reproduces one fault found against the server and states the documented outcome
(docs/serving.md#connections-and-admission). One server (``guarded``) runs with small limits so
that timeouts take a second or two.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import re
import shutil
import socket
import time
from datetime import UTC, datetime

import pytest
import test_serve
from PIL import Image
from test_serve import chat_body, one_line_error, request, start_server, stop_server

trained_ws = test_serve.serve_ws
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 8
MAX_UPLOADS = 3
APP_ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def guarded(trained_ws, tmp_path_factory):
    """A server with small connection limits, one place in the queue beside the request running,
    local images from a directory of its own and one allowed browser origin."""
    _, ws, _ = trained_ws
    root = tmp_path_factory.mktemp("guarded")
    images = root / "images"
    images.mkdir()
    Image.new("RGB", (64, 48), (10, 200, 10)).save(images / "ok.png")
    secret = root / "secret-dir"
    secret.mkdir()
    Image.new("RGB", (8, 8)).save(secret / "target.png")
    (images / "link.png").symlink_to(secret / "target.png")
    server = start_server(ws.root, root / "log.txt", "--controller", "offline-run", "--max-queue", "1",
                          "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
                          "--write-timeout-s", str(WRITE_TIMEOUT_S),
                          "--max-connections", str(MAX_CONNECTIONS), "--max-uploads", str(MAX_UPLOADS),
                          "--local-images", str(images),
                          "--allowed-origins", APP_ORIGIN)
    yield server, secret
    stop_server(server)


def metric(server, name: str, **labels: str) -> float:
    """The value of one sample of GET /metrics (0 when absent)."""
    _, body = request(server, "GET", "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" ([0-9.e+-]+)"
    found = re.search(pattern, body["text"])
    return float(found[1]) if found else 0.0


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def head(length: int, host: str = "127.0.0.1", extra: str = "") -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP response (Content-Length framed), skipping 1xx responses."""
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                msg = f"closed after {data!r}"
                raise ConnectionError(msg)
            data += chunk
        header, _, data = data.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if status >= 200:
            break
    length = int(headers.get("content-length", 0))
    while len(data) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return status, headers, data[:length]


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- connections that never finish ---------------------------------------------------------------

def test_a_body_one_byte_short_is_answered_408_and_closed_after_the_body_timeout(guarded):
    server, _ = guarded
    before = metric(server, "ctrl_connections_dropped_total", reason="body_timeout")
    body = chat_body("What?", max_tokens=1)
    with connect(server) as sock:
        sock.sendall(head(len(body)) + body[:-1])
        started = time.monotonic()
        status, headers, reply = read_reply(sock)
        waited = time.monotonic() - started
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(reply)["error"]["code"] == "body_timeout"
        assert BODY_TIMEOUT_S * 0.9 <= waited < BODY_TIMEOUT_S + 5
        assert closed_by_server(sock, 5)
    assert metric(server, "ctrl_connections_dropped_total", reason="body_timeout") == before + 1
    # a slot is released: two requests (the queue's whole room) are answered afterwards
    for _ in range(2):
        assert request(server, "POST", "/v1/chat/completions", chat_body("What?", max_tokens=1))[0] == 200


def test_a_pipelined_request_cut_short_is_answered_408_after_the_first_is_answered(guarded):
    server, _ = guarded
    before = metric(server, "ctrl_connections_dropped_total", reason="header_timeout")
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /health HTTP/1.1\r\nHo")
        assert read_reply(sock)[0] == 200
        assert read_reply(sock)[0] == 408
    assert metric(server, "ctrl_connections_dropped_total", reason="header_timeout") == before + 1


def test_partial_headers_are_answered_408_and_closed_after_the_header_timeout(guarded):
    server, _ = guarded
    before = metric(server, "ctrl_connections_dropped_total", reason="header_timeout")
    with connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line
        started = time.monotonic()
        status, _, _ = read_reply(sock)
        assert status == 408
        assert HEADER_TIMEOUT_S * 0.9 <= time.monotonic() - started < HEADER_TIMEOUT_S + 5
        assert closed_by_server(sock, 5)
    assert metric(server, "ctrl_connections_dropped_total", reason="header_timeout") == before + 1
    assert "request headers were not complete within 1 s" in server.log()


def test_connections_beyond_the_cap_are_refused_at_once_and_the_rest_time_out(guarded):
    server, _ = guarded
    timeouts = metric(server, "ctrl_connections_dropped_total", reason="header_timeout")
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # all accepted
        with connect(server) as extra:
            status, headers, _ = read_reply(extra)  # answered without sending anything
        assert status == 503 and headers["retry-after"] == "1"
        # the idle ones are closed after the header timeout, without a reply (a client's pool keeps idle
        # connections: that is no fault), and the server takes connections again
        for sock in idle:
            sock.settimeout(HEADER_TIMEOUT_S + 5)
            assert sock.recv(1024) == b""
    finally:
        for sock in idle:
            sock.close()
    assert request(server, "GET", "/health")[0] == 200
    assert metric(server, "ctrl_connections_dropped_total", reason="too_many_connections") >= 1
    assert metric(server, "ctrl_connections_dropped_total", reason="header_timeout") == timeouts


# -- clients that send and never read -----------------------------------------------------------

HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def read_until_closed(sock: socket.socket, within_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_pipelined_requests_beyond_the_cap_end_the_connection_with_every_reply_written(guarded):
    """A client pipelines 20 requests: the first and 8 sent ahead of its reply (--max-pipelined 8) are
    answered, then the server ends the connection; the replies reach the client that reads them."""
    server, _ = guarded
    dropped = metric(server, "ctrl_connections_dropped_total", reason="too_many_pipelined")
    with connect(server) as sock:
        sock.sendall(HEALTH * 20)
        replies = read_until_closed(sock)
    assert replies.count(b"HTTP/1.1 200 OK") == 9
    assert metric(server, "ctrl_connections_dropped_total", reason="too_many_pipelined") == dropped + 1


def test_eight_pipelined_requests_are_all_answered_on_a_connection_that_stays_open(guarded):
    server, _ = guarded
    with connect(server) as sock:
        sock.sendall(HEALTH * 8)
        data = b""
        while data.count(b"HTTP/1.1 200 OK") < 8 or not data.endswith(b"}"):  # replies may share a read
            chunk = sock.recv(65536)
            assert chunk, f"closed after {data.count(b'HTTP/1.1 200 OK')} replies"
            data += chunk
        assert data.count(b"HTTP/1.1 ") == 8
        sock.sendall(HEALTH)
        assert read_reply(sock)[0] == 200


def test_connections_that_pipeline_and_never_read_do_not_lock_others_out(guarded):
    """Every connection place taken by a client that pipelines thousands of requests and reads no
    reply: within a second or two all are closed and the server answers others again."""
    server, _ = guarded
    hogs = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in hogs:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.send(HEALTH * 4000)
        deadline = time.monotonic() + 15
        while True:  # a connection refused for too many open ones is answered 503
            status, _ = request(server, "GET", "/health", timeout=5)
            if status == 200:
                break
            assert time.monotonic() < deadline, "the pipelining clients still hold every connection"
            time.sleep(0.2)
    finally:
        for sock in hogs:
            sock.close()


def test_replies_left_unread_close_the_connection_after_the_write_timeout(guarded):
    """A client with a tiny receive window asks for /metrics again and again, one request at a time
    (no pipelining), and never reads: the replies back up in the server's send buffer and the
    connection is closed --write-timeout-s later, counted as a write timeout."""
    server, _ = guarded
    before = metric(server, "ctrl_connections_dropped_total", reason="write_timeout")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", server.port))
    get = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    deadline = time.monotonic() + 30
    try:
        while metric(server, "ctrl_connections_dropped_total", reason="write_timeout") < before + 1:
            assert time.monotonic() < deadline, "the connection of a client that never reads stayed open"
            with contextlib.suppress(OSError):  # reset once the server has closed it
                for _ in range(20):
                    sock.sendall(get)
                    time.sleep(0.01)
    finally:
        sock.close()


def test_requests_that_are_not_http_are_counted_and_logged_once_per_ten_seconds(guarded):
    server, _ = guarded
    before = metric(server, "ctrl_connections_dropped_total", reason="invalid_request")
    lines = server.log().count("is not an HTTP/1.1 request")
    for _ in range(30):
        with connect(server) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert read_until_closed(sock).startswith(b"HTTP/1.1 400 ")
    assert metric(server, "ctrl_connections_dropped_total", reason="invalid_request") == before + 30
    assert server.log().count("is not an HTTP/1.1 request") <= lines + 1
    assert "Invalid HTTP request received" not in server.log()


def test_upload_places_bound_one_client_address_but_not_loopback_or_a_proxy():
    from serve.connections import UploadPlaces

    places = UploadPlaces(total=4, per_client=2)
    remote = [places.take(("203.0.113.7", 5000 + i)) for i in range(3)]
    assert [p is not None for p in remote] == [True, True, False]  # one address: half of the places
    other = places.take(("198.51.100.2", 6000))
    local = places.take(("127.0.0.1", 7000))
    assert other is not None and local is not None and places.held == 4
    assert places.take(("::1", 7001)) is None  # every place taken
    remote[0]()
    remote[0]()  # giving a place back twice frees it once
    assert places.held == 3
    assert places.take(("203.0.113.7", 5003)) is not None
    behind_proxy = UploadPlaces(total=3, per_client=1, by_address=False)
    assert all(behind_proxy.take(("10.0.0.1", port)) for port in range(3))  # every client has the proxy's address
    mapped = UploadPlaces(total=3, per_client=1)
    assert all(mapped.take(("::ffff:127.0.0.1", port)) for port in range(3))  # a dual-stack socket's loopback


# -- half-closed clients -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["http/1.0", "connection: close", "pipelined"])
def test_a_half_closed_client_gets_every_answer_it_asked_for(guarded, shape):
    server, _ = guarded
    body = chat_body("What?", max_tokens=2)
    if shape == "http/1.0":
        sent = head(len(body)).replace(b"HTTP/1.1", b"HTTP/1.0") + body
    elif shape == "connection: close":
        sent = head(len(body), extra="Connection: close\r\n") + body
    else:
        sent = head(len(body)) + body + head(len(body)) + body
    with connect(server) as sock:
        sock.sendall(sent)
        sock.shutdown(socket.SHUT_WR)
        replies = read_until_closed(sock, 60)
    assert replies.count(b" 200 OK\r\n") == (2 if shape == "pipelined" else 1), replies[:300]
    assert replies.count(b'"role":"assistant"') == replies.count(b" 200 OK\r\n")


def test_a_stream_whose_client_half_closes_after_it_began_runs_to_its_end(guarded):
    server, _ = guarded
    body = chat_body("What?", max_tokens=6, stream=True)
    with connect(server) as sock:
        sock.sendall(head(len(body)) + body)
        first = b""
        while b"data: " not in first:
            first += sock.recv(65536)
        sock.shutdown(socket.SHUT_WR)
        rest = read_until_closed(sock, 60)
    assert (first + rest).rstrip().endswith(b"data: [DONE]") or b"data: [DONE]" in first + rest


# -- framing, Host and file URLs -----------------------------------------------------------------

def test_a_body_framed_by_both_transfer_encoding_and_content_length_is_a_400_that_closes(guarded):
    server, _ = guarded
    body = chat_body("What?", max_tokens=1)
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(head(len(chunked), extra="Transfer-Encoding: chunked\r\n") + chunked)
        status, headers, reply = read_reply(sock)
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(reply)["error"]["code"] == "invalid_framing"
        assert closed_by_server(sock, 5)


@pytest.mark.parametrize("host", ["[::1]evil.example", "[::1]@evil.example", "127.0.0.1@evil.example", ""])
def test_a_host_header_that_is_not_host_and_port_is_a_400(guarded, host):
    server, _ = guarded
    with connect(server) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        status, _, reply = read_reply(sock)
    assert status == 400, reply
    assert json.loads(reply)["error"]["code"] == "invalid_host"


def test_a_file_url_naming_another_host_is_refused(guarded):
    server, _ = guarded
    content = [{"type": "text", "text": "What?"},
               {"type": "image_url", "image_url": {"url": "file://evil.example/ok.png"}}]
    status, body = request(server, "POST", "/v1/chat/completions", chat_body(content, max_tokens=1))
    assert status == 400 and "names host 'evil.example'" in body["error"]["message"]
    local = [content[0], {"type": "image_url", "image_url": {"url": "file://localhost/ok.png"}}]
    status, body = request(server, "POST", "/v1/chat/completions", chat_body(local, max_tokens=1))
    assert status == 400 and "'/ok.png' is outside the --local-images directory" in body["error"]["message"]


# -- what a body's JSON may cost -----------------------------------------------------------------

@pytest.mark.parametrize("shape", [b"{},", b"[],", b"0,", b'"",'])
def test_a_body_of_fifty_thousand_tiny_values_is_refused_before_it_is_parsed(guarded, shape):
    server, _ = guarded
    body = chat_body("What?", max_tokens=1)[:-1] + b', "ignored": [' + shape * 50_000 + b"0]}"
    status, reply = request(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and reply["error"]["code"] == "too_many_values", reply
    assert request(server, "GET", "/health")[0] == 200


def test_commas_inside_strings_are_not_values(guarded):
    server, _ = guarded
    body = chat_body("What, " * 200, max_tokens=1)[:-1] + b', "note": "' + b",[{" * 20_000 + b'"}'
    status, reply = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, reply


# -- the clock starts with the whole body --------------------------------------------------------

def test_time_spent_uploading_is_not_time_waited_for_the_model(guarded):
    """A budget of 100 ms drops a request that waited 4 budgets for the model; a body that takes 1 s
    to arrive on an idle server has not waited and is answered."""
    server, _ = guarded
    body = chat_body("What?", max_tokens=1, latency_budget_ms=100, when_unreachable="run")
    with connect(server) as sock:
        sock.sendall(head(len(body)) + body[:20])
        time.sleep(1.0)
        sock.sendall(body[20:])
        status, _, reply = read_reply(sock)
    assert status == 200, reply


# -- bodies in flight and places in the queue ----------------------------------------------------

def test_sockets_that_send_headers_and_no_body_hold_no_place(guarded):
    """With --max-queue 1 two places exist in the queue, and --max-uploads 3 places for bodies. Five
    connections that sent a request's headers with a Content-Length and no body (an idle client, or
    one that waits for ever) hold neither: a client that sends its request is answered."""
    server, _ = guarded
    body = chat_body("What?", max_tokens=1)
    idle = [connect(server) for _ in range(MAX_UPLOADS + 2)]
    try:
        for sock in idle:
            sock.sendall(head(len(body)))
        time.sleep(0.3)
        assert request(server, "POST", "/v1/chat/completions", body)[0] == 200
    finally:
        for sock in idle:
            sock.close()


def test_a_body_without_a_place_is_read_then_refused_and_the_connection_carries_on(guarded):
    """Three clients that sent the first half of their bodies hold the three places for bodies in
    flight; a fourth that sends its whole body is answered 503 uploads_full with Retry-After once
    its body is in (a client sends its body before it reads), its connection carries its next
    request, and the places come back when the first three are complete."""
    server, _ = guarded
    body = chat_body("What?", max_tokens=1)
    rejected = metric(server, "ctrl_requests_total", status="rejected")
    holders = [connect(server) for _ in range(MAX_UPLOADS)]
    try:
        for sock in holders:
            sock.sendall(head(len(body)) + body[:10])
        time.sleep(0.3)  # each handler takes a place at its body's first byte
        with connect(server) as fourth:
            fourth.sendall(head(len(body)) + body)
            status, headers, reply = read_reply(fourth)
            assert status == 503 and int(headers["retry-after"]) >= 1
            assert json.loads(reply)["error"]["code"] == "uploads_full"
            fourth.sendall(head(len(body)) + body)
            assert read_reply(fourth)[0] == 503  # the holders still hold every place
        assert metric(server, "ctrl_requests_total", status="rejected") == rejected + 2
        for sock in holders:  # one at a time: the queue has two places
            sock.sendall(body[10:])
            assert read_reply(sock)[0] == 200
    finally:
        for sock in holders:
            sock.close()
    assert request(server, "POST", "/v1/chat/completions", chat_body("What?", max_tokens=1))[0] == 200


def refused_through(client: str, server, body: bytes) -> tuple[int, str | None, str]:
    """Status, Retry-After and error code of one request sent through a standard HTTP client."""
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if client == "http.client":
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            reply = conn.getresponse()
            return reply.status, reply.getheader("retry-after"), json.loads(reply.read())["error"]["code"]
        finally:
            conn.close()
    if client == "requests":
        import requests

        reply = requests.post(url, data=body, headers=headers, timeout=30)
        return reply.status_code, reply.headers.get("retry-after"), reply.json()["error"]["code"]
    if client == "httpx":
        import httpx

        reply = httpx.post(url, content=body, headers=headers, timeout=30)
        return reply.status_code, reply.headers.get("retry-after"), reply.json()["error"]["code"]
    import openai

    fields = json.loads(body)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0) as sdk:
        try:
            sdk.chat.completions.create(model=fields.pop("model"), messages=fields.pop("messages"),
                                        extra_body=fields)
        except openai.APIStatusError as exc:
            return exc.status_code, exc.response.headers.get("retry-after"), exc.body["code"]
    return 200, None, ""


@pytest.mark.parametrize("client", ["http.client", "requests", "httpx", "openai"])
def test_a_refused_upload_is_a_503_that_standard_clients_read(guarded, client):
    """Every place for bodies in flight held: a client that sends a large body reads the 503 with its
    Retry-After, never a reset connection."""
    pytest.importorskip(client.partition(".")[0])
    server, _ = guarded
    small = chat_body("What?", max_tokens=1)
    large = chat_body("What?", max_tokens=1, padding="x" * 250_000)
    holders = [connect(server) for _ in range(MAX_UPLOADS)]
    try:
        for sock in holders:
            sock.sendall(head(len(small)) + small[:10])
        time.sleep(0.3)
        assert refused_through(client, server, large) == (503, "1", "uploads_full")
    finally:
        for sock in holders:
            sock.close()


def test_a_client_that_leaves_mid_body_is_a_dropped_connection_not_an_error(guarded):
    server, _ = guarded
    errors = metric(server, "ctrl_requests_total", status="error")
    left = metric(server, "ctrl_connections_dropped_total", reason="client_left")
    body = chat_body("What?", max_tokens=1)
    with connect(server) as sock:
        sock.sendall(head(len(body)) + body[: len(body) // 2])
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while metric(server, "ctrl_connections_dropped_total", reason="client_left") < left + 1:
        assert time.monotonic() < deadline, "the connection was not counted as dropped"
        time.sleep(0.05)
    assert metric(server, "ctrl_requests_total", status="error") == errors
    assert "Traceback" not in server.log()


def test_a_client_that_half_closes_after_its_request_gets_its_answer(guarded):
    server, _ = guarded
    body = chat_body("What?", max_tokens=2)
    with connect(server) as sock:
        sock.sendall(head(len(body)) + body)
        sock.shutdown(socket.SHUT_WR)
        status, _, reply = read_reply(sock)
    assert status == 200, reply
    assert json.loads(reply)["choices"][0]["message"]["role"] == "assistant"


# -- what an image may cost ----------------------------------------------------------------------

def test_a_sliver_image_is_refused_before_preprocessing(guarded):
    server, _ = guarded
    buffer = io.BytesIO()
    Image.new("RGB", (12_500_000, 2)).save(buffer, format="PNG")  # 25 M pixels: within the pixel limit
    assert len(buffer.getvalue()) < 300_000
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    status, reply = request(server, "POST", "/v1/chat/completions", chat_body(
        [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": uri}}], max_tokens=1))
    assert status == 400 and reply["error"]["code"] == "image_too_large"
    assert "12500000 x 2 pixels, a side more than 25 times the other" in one_line_error(reply)


def image_request(data: bytes) -> bytes:
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    return chat_body([{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": uri}}],
                     max_tokens=1)


def test_an_image_format_beyond_the_common_ones_is_refused(guarded):
    server, _ = guarded
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48)).save(buffer, format="TIFF")
    status, reply = request(server, "POST", "/v1/chat/completions", image_request(buffer.getvalue()))
    assert status == 400 and reply["error"]["code"] == "invalid_image"
    assert "the formats accepted: PNG, JPEG, WEBP, GIF, BMP" in one_line_error(reply)


def test_a_png_with_megabytes_of_text_chunks_is_refused(guarded):
    from PIL import PngImagePlugin

    server, _ = guarded
    text = PngImagePlugin.PngInfo()
    for i in range(3):  # 3 x 400 kB of text, compressed to almost nothing
        text.add_text(f"note{i}", "a" * 400_000, zip=True)
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48)).save(buffer, format="PNG", pnginfo=text)
    assert len(buffer.getvalue()) < 300_000
    status, reply = request(server, "POST", "/v1/chat/completions", image_request(buffer.getvalue()))
    assert status == 400 and reply["error"]["code"] == "invalid_image", reply
    assert "its PNG text chunks hold more than the server's limit of 1,048,576 bytes" in one_line_error(reply)
    buffer = io.BytesIO()  # one chunk of 400 kB is within the limit, and answered
    text = PngImagePlugin.PngInfo()
    text.add_text("note", "a" * 400_000, zip=True)
    Image.new("RGB", (64, 48)).save(buffer, format="PNG", pnginfo=text)
    assert request(server, "POST", "/v1/chat/completions", image_request(buffer.getvalue()))[0] == 200


def test_a_temperature_or_top_p_too_small_for_float32_decodes_greedily(guarded):
    server, _ = guarded
    body = {"max_tokens": 6, "knobs": {"max_crops": 1, "top_k": 2, "num_active_blocks": 4}}
    status, greedy = request(server, "POST", "/v1/chat/completions", chat_body("What colour is it?", **body))
    assert status == 200
    answer = greedy["choices"][0]["message"]["content"]
    for sampling in ({"temperature": 1e-320}, {"temperature": 1e-30, "seed": 3}, {"temperature": 1, "top_p": 1e-320},
                     {"temperature": 2, "top_p": 1e-46, "seed": 5}):
        status, reply = request(server, "POST", "/v1/chat/completions",
                                chat_body("What colour is it?", **body, **sampling))
        assert status == 200 and reply["choices"][0]["message"]["content"] == answer, sampling


# -- requests from other sites' pages -------------------------------------------------------------

def test_a_host_header_the_server_does_not_answer_to_is_refused(guarded):
    server, _ = guarded
    body = chat_body("What?", max_tokens=1)
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        status, reply = request(server, "POST", "/v1/chat/completions", body,
                                {"Host": host, "Content-Type": "text/plain"})
        assert status == 403 and reply["error"]["code"] == "host_not_allowed", host
    for host in ("localhost", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert request(server, "GET", "/health", headers={"Host": host})[0] == 200, host


def test_cross_origin_requests_are_refused_unless_their_origin_is_allowed(guarded):
    server, _ = guarded
    body = chat_body("What?", max_tokens=1)
    status, reply = request(server, "POST", "/v1/chat/completions", body,
                            {"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and reply["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in reply["_headers"]
    status, reply = request(server, "POST", "/v1/chat/completions", body, {"Origin": APP_ORIGIN})
    assert status == 200 and reply["_headers"]["access-control-allow-origin"] == APP_ORIGIN
    for asked in ("authorization,content-type", "authorization,content-type,x-stainless-os,x-stainless-lang"):
        status, reply = request(server, "OPTIONS", "/v1/chat/completions", None,
                                {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": asked})
        assert status == 200 and reply["_headers"]["access-control-allow-origin"] == APP_ORIGIN, asked


# -- paths in errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["link.png", "~root/.bashrc", "/proc/self/environ", "../secret-dir/target.png"])
def test_image_path_errors_name_the_path_as_sent(guarded, path):
    server, secret = guarded
    status, reply = request(server, "POST", "/v1/chat/completions", chat_body(
        [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": path}}], max_tokens=1))
    assert status == 400
    message = one_line_error(reply)
    assert repr(path) in message
    for disclosed in (str(secret), "/root", f"/proc/{server.process.pid}"):
        assert disclosed not in message


# -- statuses --------------------------------------------------------------------------------------

def test_a_question_spelling_an_image_token_is_a_400(guarded):
    server, _ = guarded
    status, reply = request(server, "POST", "/v1/chat/completions", chat_body("What is <im_patch> here?",
                                                                               max_tokens=1))
    assert status == 400 and reply["error"]["code"] == "reserved_token"
    assert "'<im_patch>'" in one_line_error(reply)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_in_utf16_or_utf32_is_a_400(guarded, encoding):
    server, _ = guarded
    body = chat_body("What?", max_tokens=1).decode().encode(encoding)
    status, reply = request(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and "not UTF-8" in one_line_error(reply)


def test_a_tiny_budget_is_reported_as_given(guarded):
    server, _ = guarded
    status, reply = request(server, "POST", "/v1/chat/completions",
                            chat_body("What?", max_tokens=1, latency_budget_ms=1e-300))
    assert status == 504
    assert "latency budget of 1e-300 ms" in one_line_error(reply)


def test_method_not_allowed_names_the_allowed_ones_and_head_health_works(guarded):
    server, _ = guarded
    status, reply = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and reply["_headers"]["allow"] == "POST"
    for path in ("/health", "/v1/models", "/metrics"):
        assert request(server, "HEAD", path)[0] == 200, path
    for path in ("/health/", "/v1/chat/completions/"):  # no redirect: an error object naming the path
        status, reply = request(server, "GET", path)
        assert status == 404 and one_line_error(reply) == f"no endpoint {path}"
    status, reply = request(server, "GET", "/" + "x" * 5000)
    assert status == 404 and len(one_line_error(reply)) < 200


# -- the workspace removed while serving -----------------------------------------------------------

def test_the_request_log_is_reopened_or_requests_refused_when_the_workspace_goes(trained_ws, tmp_path):
    _, ws, _ = trained_ws
    root = tmp_path / "ws"
    shutil.copytree(ws.root, root, ignore=shutil.ignore_patterns("requests"))
    server = start_server(root, tmp_path / "log.txt", "--controller", "offline-run")
    try:
        assert request(server, "POST", "/v1/chat/completions", chat_body("What?", max_tokens=1))[0] == 200
        shutil.rmtree(root / "requests")  # the request log's folder alone: recreated, the file reopened
        status, reply = request(server, "POST", "/v1/chat/completions", chat_body("What?", max_tokens=1))
        assert status == 200
        lines = [json.loads(line) for path in (root / "requests").glob("*.jsonl")
                 for line in path.read_text().splitlines()]
        assert [r["request_id"] for r in lines] == [reply["id"]]
        assert "was removed while serving; recording to the file now at that path" in server.log()
        shutil.rmtree(root)  # the whole workspace: nothing more is answered, since nothing could be recorded
        status, reply = request(server, "POST", "/v1/chat/completions", chat_body("What?", max_tokens=1))
        assert status == 503 and reply["error"]["code"] == "request_log_unavailable"
        assert "the workspace was removed while serving" in one_line_error(reply)
        assert str(root) not in one_line_error(reply)  # a reply names no server path; the server's log does
        assert f"error: the workspace {root} was removed while serving" in server.log()
        rejected = metric(server, "ctrl_requests_total", status="rejected")
        assert request(server, "POST", "/v1/chat/completions", chat_body("What?", max_tokens=1))[0] == 503
        assert metric(server, "ctrl_requests_total", status="rejected") == rejected + 1
        status, health = request(server, "GET", "/health")
        assert status == 503 and health["status"] == "unavailable" and str(root) not in json.dumps(health)
        assert not root.exists()  # not resurrected
    finally:
        stop_server(server)


# -- the queue deadline's factor -------------------------------------------------------------------

def test_the_default_queue_deadline_drops_after_four_budgets_not_eight(embedded_runtime, tmp_path):
    """A request that has spent 6 budgets when the worker takes it is dropped by the default (4);
    one that has spent 3 is run."""
    from test_serve import RecordingDecider

    from pipeline.workspace import Workspace
    from serve.config import ServeConfig
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog
    from serve.scheduling import DeadlineExceeded

    engine = Engine(embedded_runtime, RecordingDecider(), model_name="embedded", max_queue=1, default_budget_ms=100.0,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws")),
                    queue_deadline=ServeConfig().queue_deadline)
    budget_ms = 1000.0
    now = time.perf_counter()

    def job(spent_budgets: float):
        request_ = ChatRequest("embedded", "What?", None, 1, budget_ms)
        return new_job(request_, engine, now - spent_budgets * budget_ms / 1000.0, datetime.now(UTC), 0.0)

    assert isinstance(engine._expired(job(6.0)), DeadlineExceeded)
    assert engine._expired(job(3.0)) is None
    engine.stop()
    rows = [json.loads(line) for line in next((tmp_path / "ws" / "requests").glob("*.jsonl")).read_text().splitlines()]
    assert [r["status"] for r in rows] == ["dropped"]


def test_a_request_cancelled_while_decoding_is_recorded_with_how_far_it_got(embedded_runtime, tmp_path, monkeypatch):
    from test_serve import RecordingDecider

    from pipeline.workspace import Workspace
    from serve.engine import Cancelled, Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog

    engine = Engine(embedded_runtime, RecordingDecider(), model_name="embedded", max_queue=1, default_budget_ms=100.0,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws")))
    job = new_job(ChatRequest("embedded", "What?", None, 16, 10_000.0), engine, time.perf_counter(),
                  datetime.now(UTC), 0.0)
    steps = 0
    decode_step = embedded_runtime.decode_step

    def counted(*args, **kwargs):
        nonlocal steps
        steps += 1
        out = decode_step(*args, **kwargs)
        if steps == 2:
            job.cancelled.set()  # the client leaves after the second decode step
        return out

    monkeypatch.setattr(embedded_runtime, "decode_step", counted)
    monkeypatch.setattr(embedded_runtime, "eos_id", -1)  # no early end: every step is taken
    with pytest.raises(Cancelled, match=r"^the client disconnected while decoding, after 3 tokens of the answer$"):
        engine.execute(job)
    engine.stop()


def test_a_request_log_that_cannot_be_created_again_is_retried_at_the_next_request(tmp_path):
    """Not the end of recording: the requests meanwhile are answered and counted as not recorded."""
    from pipeline.workspace import Workspace
    from serve.request_log import RequestLog

    warnings: list[str] = []
    log = RequestLog(Workspace(tmp_path / "ws"), warn=warnings.append)
    assert log.append({"n": 1})
    folder = tmp_path / "ws" / "requests"
    shutil.rmtree(folder)
    folder.write_text("a file where the folder was\n")  # the folder cannot be made again
    log.check()  # as the server asks before a request: answered, warned once for all
    assert not log.append({"n": 2}) and not log.append({"n": 3})
    assert log.failures == 2 and len(warnings) == 1
    assert f"cannot be created again ({folder} is not a folder)" in warnings[0]
    folder.unlink()
    assert log.append({"n": 4})
    assert [json.loads(line)["n"] for line in log.path.read_text().splitlines()] == [4]
    assert "recording again (2 request(s) were not recorded)" in warnings[-1]
    log.close()


def test_a_request_queued_when_the_workspace_goes_is_refused_before_the_model_runs_it(embedded_runtime, tmp_path):
    from test_serve import RecordingDecider

    from pipeline.workspace import Workspace
    from serve.engine import Engine, LogUnavailable, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog

    decider = RecordingDecider()
    engine = Engine(embedded_runtime, decider, model_name="embedded", max_queue=1, default_budget_ms=1000.0,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws"), warn=lambda _: None))
    job = new_job(ChatRequest("embedded", "What?", None, 1, 1000.0), engine, time.perf_counter(),
                  datetime.now(UTC), 0.0)
    shutil.rmtree(tmp_path / "ws")  # while the request waited in the queue
    with pytest.raises(LogUnavailable, match="the workspace was removed while serving"):
        engine.execute(job)
    assert decider.budgets == []  # stage 1 never ran: no model time spent on an answer that cannot be recorded
    assert 'ctrl_requests_total{status="rejected"} 1.0' in engine.metrics.exposition().decode()
    engine.stop()
