"""A burst of concurrent requests carrying large image bodies against ``ctrl serve``: how many are
refused at once (503), how long a refusal and an answer take, and the server's peak memory.

    python benchmarks/bench_body_burst.py                      # this checkout
    python benchmarks/bench_body_burst.py --source ../old-rev  # another revision's checkout, same burst

Each client sends one chat request whose image is a data URI of about ``--body-mb`` MB (a PNG
of random pixels, so it does not compress) with a generous budget; the server runs the testbed
with the bench_serve workspace (``benchmarks/bench_serve.py`` builds it) and its default limits.
The server's resident memory is read from /proc every 10 ms; the peak is reported above the
idle server's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

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
        began = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            outcome = response.status
        except OSError as exc:
            outcome = -1 if not isinstance(exc, ConnectionResetError) else -2
        finally:
            conn.close()
        with lock:
            results.append((outcome, time.perf_counter() - began))

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workspace", type=Path, default=bs.CACHE / "serve-ws")
    p.add_argument("--run-id", default="bench-serve")
    p.add_argument("--source", type=Path, default=ROOT, help="the source tree the server runs from")
    p.add_argument("--clients", type=int, default=80)
    p.add_argument("--body-mb", type=float, default=14.0)
    args = p.parse_args()

    body = image_body(args.body_mb)
    server = bs.Server(args.workspace, args.run_id, bs.CACHE / "bench_body_burst.server.log", max_queue=8,
                       flags=["--no-warmup"], root=args.source)
    try:
        idle = rss_mib(server.process.pid)
        peak, sampling = idle, True

        def sample() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, rss_mib(server.process.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        results = burst(server.port, body, args.clients)
        sampling = False
        sampler.join()
        time.sleep(1.0)
        after = rss_mib(server.process.pid)
    finally:
        server.stop()
    by_status = Counter(status for status, _ in results)

    def median_s(status: int) -> float | None:
        times = [s for st, s in results if st == status]
        return round(statistics.median(times), 2) if times else None

    def max_s(status: int) -> float | None:
        times = [s for st, s in results if st == status]
        return round(max(times), 2) if times else None

    print(json.dumps({"source": str(args.source), "clients": args.clients, "body_bytes": len(body),
                      "statuses": {str(k): v for k, v in sorted(by_status.items())},
                      "median_s": {str(k): median_s(k) for k in sorted(by_status)},
                      "max_s": {str(k): max_s(k) for k in sorted(by_status)},
                      "idle_rss_mib": round(idle), "peak_above_idle_mib": round(peak - idle),
                      "after_rss_mib": round(after)}))


if __name__ == "__main__":
    main()
