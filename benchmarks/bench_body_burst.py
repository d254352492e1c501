"""What a careless or hostile client can make ``ctrl serve`` hold, shape by shape, for one or more
revisions in one run: how many requests are refused and how, how long the server is unavailable to
others, and its peak memory.

    python benchmarks/bench_body_burst.py                                   # this checkout, every shape
    python benchmarks/bench_body_burst.py --source ../old-rev --source .    # before and after, one run
    python benchmarks/bench_body_burst.py --shapes burst,amplification

Shapes (each against a fresh server: the testbed with the bench_serve workspace, which
``benchmarks/bench_serve.py`` builds, at its default limits and ``--max-queue 8``):

* ``burst``: ``--clients`` concurrent chat requests through ``http.client``, each carrying a PNG data
  URI of about ``--body-mb`` MB (random pixels: it does not compress): statuses (-2: the connection
  was reset, -1: another socket error), reply times, peak memory above the idle server's.
* ``lockout``: ``--max-connections`` (128) sockets that each pipeline 20,000 ``GET /health`` and
  never read; another client asks ``/health`` every 0.5 s: the share answered and the first answer.
* ``amplification``: nine concurrent 15.5 MB bodies of ``[{},{},...]`` in an ignored field (and the
  same with one ``\\u003a`` escape in a key): statuses, parse seconds, memory, ``/health``'s slowest reply.
* ``idle``: nine sockets that send headers with a Content-Length and no body, then five requests
  one after another: their statuses.
* ``halfclose``: HTTP/1.0, ``Connection: close``, two pipelined requests, each followed by
  ``shutdown(SHUT_WR)``, and a stream half-closed once it began: whether every answer arrived.

The server's resident memory is read from /proc every 10 ms. Prints one JSON object per source and
shape, then a table.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import io
import json
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve as bs

ROOT = Path(__file__).resolve().parents[1]


def image_body(megabytes: float, seed: int = 0) -> bytes:
    """A chat request whose data URI is about ``megabytes`` MB of base64 PNG (random pixels)."""
    side = int((megabytes * 1e6 * 3 / 4 / 3) ** 0.5)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return json.dumps({"model": "testbed", "max_tokens": 4, "latency_budget_ms": 5000,
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                                 {"type": "image_url", "image_url": {"url": uri}}]}]
                      }).encode()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def burst(port: int, body: bytes, clients: int) -> list[tuple[int, float]]:
    """(status, seconds to the reply) of each client, all started together."""
    results: list[tuple[int, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def one() -> None:
        start.wait()
        outcome = one_request(port, body, timeout=300)
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def memory_peak(pid: int) -> tuple[float, Callable[[], float]]:
    """The idle RSS and a function that stops sampling and returns the peak above it."""
    idle = rss_mib(pid)
    peak, sampling = idle, True

    def sample() -> None:
        nonlocal peak
        while sampling:
            with contextlib.suppress(OSError, ValueError):
                peak = max(peak, rss_mib(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()

    def stop() -> float:
        nonlocal sampling
        sampling = False
        sampler.join()
        return round(peak - idle)

    return idle, stop


def summary(results: list[tuple[int, float]]) -> dict[str, Any]:
    by_status = Counter(status for status, _ in results)

    def times(status: int) -> list[float]:
        return [s for st, s in results if st == status]

    return {"statuses": {str(k): v for k, v in sorted(by_status.items())},
            "median_s": {str(k): round(statistics.median(times(k)), 2) for k in sorted(by_status)},
            "max_s": {str(k): round(max(times(k)), 2) for k in sorted(by_status)}}


def shape_burst(server: bs.Server, args: argparse.Namespace) -> dict[str, Any]:
    body = image_body(args.body_mb)
    idle, stop = memory_peak(server.process.pid)
    results = burst(server.port, body, args.clients)
    peak = stop()
    time.sleep(1.0)
    return {"clients": args.clients, "body_bytes": len(body), **summary(results), "idle_rss_mib": round(idle),
            "peak_above_idle_mib": peak, "after_rss_mib": round(rss_mib(server.process.pid))}


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def health_status(port: int, timeout: float = 2.0) -> tuple[int, float]:
    began = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - began
    except OSError:
        return -1, time.perf_counter() - began
    finally:
        conn.close()


def shape_lockout(server: bs.Server, args: argparse.Namespace) -> dict[str, Any]:
    hogs = []
    for _ in range(128):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.send(HEALTH * 20_000)
        hogs.append(sock)
    began = time.perf_counter()
    probes = []
    try:
        while time.perf_counter() - began < args.lockout_s:
            status, _ = health_status(server.port)
            probes.append((time.perf_counter() - began, status))
            time.sleep(0.5)
    finally:
        for sock in hogs:
            sock.close()
    answered = [t for t, status in probes if status == 200]
    return {"hogs": len(hogs), "probes": len(probes), "answered_share": round(len(answered) / len(probes), 3),
            "first_answer_s": round(answered[0], 1) if answered else None,
            "statuses": dict(Counter(str(status) for _, status in probes))}


def amplification_body(escaped: bool) -> bytes:
    key = b'"ignored\\u003a"' if escaped else b'"ignored"'
    head = (b'{"model": "testbed", "max_tokens": 1, "messages": [{"role": "user", "content": "What?"}], '
            + key + b": [")
    count = (int(15.5e6) - len(head)) // 3
    return head + b"{}," * count + b"{}]}"


def shape_amplification(server: bs.Server, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for escaped in (False, True):
        body = amplification_body(escaped)
        idle, stop = memory_peak(server.process.pid)
        slowest, probing = 0.0, True

        def probe() -> None:
            nonlocal slowest
            while probing:
                slowest = max(slowest, health_status(server.port, timeout=60)[1])
                time.sleep(0.2)

        prober = threading.Thread(target=probe)
        prober.start()
        results = burst(server.port, body, 9)
        probing = False
        prober.join()
        out["escaped" if escaped else "plain"] = {"body_bytes": len(body), **summary(results),
                                                  "peak_above_idle_mib": stop(),
                                                  "health_slowest_s": round(slowest, 2)}
        time.sleep(1.0)
    return out


def shape_idle(server: bs.Server, args: argparse.Namespace) -> dict[str, Any]:
    body = image_body(0.05)
    idle = []
    for _ in range(9):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n")
        idle.append(sock)
    time.sleep(0.5)
    try:
        results = [one_request(server.port, body) for _ in range(5)]
    finally:
        for sock in idle:
            sock.close()
    return {"idle_sockets": len(idle), **summary(results)}


def one_request(port: int, body: bytes, timeout: float = 120.0) -> tuple[int, float]:
    """(status, seconds to the reply) of one chat request; -2: the connection was reset, -1: another
    socket error."""
    began = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - began
    except OSError as exc:
        return (-2 if isinstance(exc, ConnectionResetError) else -1), time.perf_counter() - began
    finally:
        conn.close()


def read_all(sock: socket.socket, timeout: float = 60.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def shape_halfclose(server: bs.Server, args: argparse.Namespace) -> dict[str, Any]:
    body = image_body(0.05)
    stream = json.dumps({**json.loads(body), "stream": True}).encode()

    def head(length: int, version: str = "1.1", extra: str = "") -> bytes:
        return (f"POST /v1/chat/completions HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n{extra}\r\n").encode()

    cases = {"http/1.0": (head(len(body), "1.0") + body, 1),
             "connection: close": (head(len(body), extra="Connection: close\r\n") + body, 1),
             "pipelined": (head(len(body)) + body + head(len(body)) + body, 2)}
    out = {}
    for name, (sent, expected) in cases.items():
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(sent)
            sock.shutdown(socket.SHUT_WR)
            data = read_all(sock)
        out[name] = f"{data.count(b' 200 OK')}/{expected}"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head(len(stream)) + stream)
        sock.settimeout(60)
        first = b""
        with contextlib.suppress(OSError):
            while b"data: " not in first and (chunk := sock.recv(65536)):
                first += chunk
        sock.shutdown(socket.SHUT_WR)
        data = first + read_all(sock)
    out["stream"] = "1/1" if b"data: [DONE]" in data else "0/1"
    return out


SHAPES: dict[str, Callable[[bs.Server, argparse.Namespace], dict[str, Any]]] = {
    "burst": shape_burst, "lockout": shape_lockout, "amplification": shape_amplification, "idle": shape_idle,
    "halfclose": shape_halfclose}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workspace", type=Path, default=bs.CACHE / "serve-ws")
    p.add_argument("--run-id", default="bench-serve")
    p.add_argument("--source", type=Path, action="append",
                   help="a source tree the server runs from (repeat: each in turn, same shapes; default this one)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--body-mb", type=float, default=12.0)
    p.add_argument("--lockout-s", type=float, default=20.0)
    args = p.parse_args()
    shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    rows = []
    for source in args.source or [ROOT]:
        for shape in shapes:
            server = bs.Server(args.workspace, args.run_id, bs.CACHE / f"bench_body_burst.{shape}.server.log",
                               max_queue=8, flags=["--no-warmup"], root=source)
            try:
                result = {"source": str(source), "shape": shape, **SHAPES[shape](server, args)}
                alive = health_status(server.port, timeout=30)[0]
                result["serving_after"] = alive == 200
            finally:
                server.stop()
            print(json.dumps(result), flush=True)
            rows.append(result)


if __name__ == "__main__":
    main()
