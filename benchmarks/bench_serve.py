"""``ctrl serve`` under open-loop Poisson load: the controller against the p95 table's static configurations.

    python benchmarks/bench_serve.py                       # the shipped sample data, the testbed model
    python benchmarks/bench_serve.py --requests 120 --rates 0.25,0.5,0.75,1.0,1.5

What it does, on the trained testbed and the shipped sample profile (the workspace is built
under ``--workspace`` on first use: ingest, extract-features, ``ctrl train --offline``):

1. starts ``ctrl serve --model testbed --controller RUN`` in a subprocess (one model thread, as
   the profile was measured);
2. reads the server's **latency scale** after a few requests (its model time per ms of the
   profile, docs/serving.md#latency-calibration) and its reserve, and turns the tested budgets,
   quantiles of the run's training budget range (profile ms), into this machine's ms:
   ``profile budget x scale + reserve``;
3. measures the server's **capacity**: requests/s of one client sending back to back, the
   controller deciding at the middle budget;
4. for every budget and every arrival rate (fractions of that capacity), sends the same
   sequence of test-split requests (question + image from the sample data) at Poisson
   arrival times, open loop (a request is sent at its time whether or not earlier ones have
   finished), once with the controller deciding and once per **static configuration** the
   run's p95 lookup table picks at the tested budgets (the request fixes its ``knobs``);
5. per (budget, rate, decider): the fraction answered within the budget (latency measured by
   the client, from the scheduled send to the last byte; a 503 counts as missed and wrong),
   accuracy (answers scored with the dataset metric against the references), throughput
   (answers per second over the run) and p50 / p99 latency.

Results go to ``--out`` (a CSV) and a plot (``--plot``); docs/results.md quotes them.
"""

from __future__ import annotations

import argparse
import base64
import csv
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_TOKENS = 8  # as the sample profile was measured


@dataclass
class Outcome:
    status: int
    latency_ms: float
    score: float
    knobs: tuple[int, int, int] | None


def ctrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, check=True)


def prepare_workspace(ws: Path, run_id: str) -> None:
    """Sample data, the testbed, ingest, features and an offline run (each step skipped when done)."""
    if not (ROOT / "data" / "exp6").exists():
        subprocess.run([sys.executable, str(ROOT / "data" / "generate.py")], check=True)
    ctrl("testbed", "train", "--eval-samples", "0")
    if not (ws / "CURRENT").exists():
        ctrl("ingest", str(ROOT / "data" / "exp5"), str(ROOT / "data" / "exp6"), "-w", str(ws))
    ctrl("extract-features", "-w", str(ws), "--model", "testbed", "--images", str(ROOT / "data" / "testbed" / "images"))
    if not (ws / "runs" / run_id / "checkpoints" / "best.pt").exists():
        ctrl("train", "--offline", "-w", str(ws), "--run-id", run_id)


def test_requests(ws: Path, limit: int) -> list[dict]:
    """Bodies of the test split's samples with an image (question, data URI, references)."""
    from online.data import load_online_samples
    from pipeline.workspace import Workspace
    from runtime import load_runtime

    runtime = load_runtime("testbed")
    samples = load_online_samples(Workspace(ws), runtime.fingerprint, None)
    rows = [i for i in samples.rows("test") if samples.image_path[i] is not None][:limit]
    out = []
    for i in rows:
        path = Path(samples.image_path[i])
        mime = "image/png" if path.suffix.lower() == ".png" else "image/jpeg"
        uri = f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()
        out.append({"dataset": samples.dataset[i], "answers": samples.answers[i], "content": [
            {"type": "text", "text": samples.question[i]}, {"type": "image_url", "image_url": {"url": uri}}]})
    return out


def table_configs(ws: Path, run_id: str, budgets: list[float]) -> dict[float, tuple[int, int, int]]:
    """The run's p95 lookup table (its fallback table): the configuration it picks at each budget."""
    from trainer.fallback import read_fallback

    fallback = read_fallback(ws / "runs" / run_id / "checkpoints" / "best.pt")
    if fallback is None:
        msg = f"run {run_id} has no table fallback to take the p95 table from"
        raise SystemExit(msg)
    table = fallback.lookup_table()
    return {b: tuple(int(v) for v in table.lookup(b)) for b in budgets}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(ws: Path, run_id: str, port: int, log: Path, max_queue: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--model", "testbed", "--controller", run_id,
                                "-w", str(ws), "--port", str(port), "--threads", "1", "--max-queue", str(max_queue)],
                               cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            msg = f"ctrl serve exited: {log.read_text()[-2000:]}"
            raise SystemExit(msg)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return process
        except OSError:
            time.sleep(0.3)
    process.kill()
    msg = "ctrl serve did not start"
    raise SystemExit(msg)


def send(port: int, body: bytes, scheduled: float, request: dict) -> Outcome:
    from runtime.scoring import score_answer

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    latency = (time.perf_counter() - scheduled) * 1000.0
    if response.status != 200:
        return Outcome(response.status, latency, 0.0, None)
    reply = json.loads(raw)
    score, _ = score_answer(request["dataset"], reply["choices"][0]["message"]["content"], request["answers"])
    k = reply["ctrl"]["knobs"]
    return Outcome(200, latency, float(score), (k["max_crops"], k["top_k"], k["num_active_blocks"]))


def body_of(request: dict, budget: float, knobs: tuple[int, int, int] | None) -> bytes:
    payload = {"model": "testbed", "max_tokens": MAX_TOKENS, "latency_budget_ms": budget,
               "messages": [{"role": "user", "content": request["content"]}]}
    if knobs is not None:
        payload["knobs"] = dict(zip(("max_crops", "top_k", "num_active_blocks"), knobs))
    return json.dumps(payload).encode()


def run_open_loop(port: int, requests: list[dict], budget: float, knobs: tuple[int, int, int] | None,
                  rate: float, seed: int) -> tuple[list[Outcome], float]:
    """Send every request at Poisson arrival times (``rate`` per second); the outcomes and the run's wall time."""
    gaps = random.Random(seed)
    bodies = [body_of(r, budget, knobs) for r in requests]
    outcomes: list[Outcome | None] = [None] * len(requests)
    start = time.perf_counter() + 0.05
    at = start
    with ThreadPoolExecutor(max_workers=64) as pool:
        futures = []
        for i, body in enumerate(bodies):
            at += gaps.expovariate(rate)
            delay = at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append((i, pool.submit(send, port, body, at, requests[i])))
        for i, future in futures:
            outcomes[i] = future.result()
    return [o for o in outcomes if o is not None], time.perf_counter() - start


def server_calibration(port: int) -> tuple[float, float]:
    """The server's current latency scale and overhead reserve (ms), from GET /v1/models."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    about = json.loads(conn.getresponse().read())["data"][0]["ctrl"]
    conn.close()
    return float(about["latency_scale"]), float(about["overhead_reserve_ms"])


def capacity(port: int, requests: list[dict], budget: float, n: int) -> float:
    """Requests per second of one client sending back to back (the controller deciding)."""
    start = time.perf_counter()
    for r in requests[:n]:
        send(port, body_of(r, budget, None), time.perf_counter(), r)
    return n / (time.perf_counter() - start)


def summarize(outcomes: list[Outcome], budget: float, wall_s: float) -> dict:
    latencies = sorted(o.latency_ms for o in outcomes if o.status == 200)
    answered = len(latencies)

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {"within_budget": sum(o.status == 200 and o.latency_ms <= budget for o in outcomes) / len(outcomes),
            "accuracy": sum(o.score for o in outcomes) / len(outcomes), "correct": sum(o.score for o in outcomes),
            "rejected": sum(o.status == 503 for o in outcomes), "throughput_rps": answered / wall_s,
            "p50_ms": statistics.median(latencies) if latencies else float("nan"), "p99_ms": pct(0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", type=Path, default=ROOT / "benchmarks" / ".cache" / "serve-ws")
    parser.add_argument("--run-id", default="bench-serve")
    parser.add_argument("--requests", type=int, default=100, help="requests per (budget, rate, decider)")
    parser.add_argument("--rates", default="0.25,0.5,0.75,1.0,1.5", help="arrival rates, fractions of capacity")
    parser.add_argument("--budget-quantiles", default="0.25,0.5,0.75",
                        help="tested budgets, as quantiles of the run's training budget range")
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / ".cache" / "bench_serve.csv")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "serve_bench.png")
    args = parser.parse_args()

    os.environ.setdefault("CTRL_WORKSPACE", str(args.workspace))
    prepare_workspace(args.workspace, args.run_id)
    config = json.loads((args.workspace / "runs" / args.run_id / "config.json").read_text())
    lo, hi = float(config["budget_min_ms"]), float(config["budget_max_ms"])
    profile_budgets = [round(lo + float(q) * (hi - lo), 1) for q in args.budget_quantiles.split(",")]
    requests = test_requests(args.workspace, args.requests)
    table = table_configs(args.workspace, args.run_id, profile_budgets)
    port = free_port()
    log = args.out.with_suffix(".server.log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(args.workspace, args.run_id, port, log, args.max_queue)
    rows: list[dict] = []
    try:
        # warm the client and server paths; the requests also calibrate the server's latency scale
        capacity(port, requests, 10 * hi, 20)
        scale, reserve = server_calibration(port)
        budgets = [round(b * scale + reserve, 1) for b in profile_budgets]
        statics_at = {b: table[p] for b, p in zip(budgets, profile_budgets)}
        print(f"latency scale {scale:.2f}, reserve {reserve:.1f} ms: profile budgets {profile_budgets} ms are "
              f"{budgets} ms here", flush=True)
        middle = budgets[len(budgets) // 2]
        cap = capacity(port, requests, middle, min(60, len(requests)))
        print(f"capacity {cap:.1f} requests/s (one client, back to back, controller at {middle} ms)", flush=True)
        print(f"static configurations of the p95 table: {sorted(set(statics_at.values()))}", flush=True)
        for budget in budgets:
            for fraction in (float(f) for f in args.rates.split(",")):
                rate = fraction * cap
                for knobs in (None, *sorted(set(statics_at.values()))):
                    outcomes, wall = run_open_loop(port, requests, budget, knobs, rate, args.seed)
                    name = "controller" if knobs is None else "static {}/{}/{}".format(*knobs)
                    row = {"budget_ms": budget, "profile_budget_ms": profile_budgets[budgets.index(budget)],
                           "latency_scale": round(scale, 3), "rate_fraction": fraction, "rate_rps": round(rate, 2),
                           "decider": name, **summarize(outcomes, budget, wall)}
                    if knobs is None:
                        chosen = [o.knobs for o in outcomes if o.knobs]
                        row["configs"] = " ".join(f"{c}/{k}/{b}:{chosen.count((c, k, b))}"
                                                  for c, k, b in sorted(set(chosen)))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=120)
    with args.out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, budgets, args.plot, cap)
    print(f"wrote {args.out} and {args.plot}")


def plot(rows: list[dict], budgets: list[float], path: Path, cap: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(budgets), figsize=(4.2 * len(budgets), 6.5), squeeze=False, sharex=True)
    deciders = sorted({r["decider"] for r in rows}, key=lambda d: (d != "controller", d))
    for j, budget in enumerate(budgets):
        for decider in deciders:
            sel = [r for r in rows if r["budget_ms"] == budget and r["decider"] == decider]
            style = {"linewidth": 2.5, "color": "black"} if decider == "controller" else {"linestyle": "--"}
            x = [r["rate_fraction"] for r in sel]
            axes[0][j].plot(x, [r["within_budget"] for r in sel], marker="o", label=decider, **style)
            axes[1][j].plot(x, [r["accuracy"] for r in sel], marker="o", label=decider, **style)
        axes[0][j].axhline(0.95, color="grey", linewidth=0.8)
        axes[0][j].set_title(f"budget {budget:g} ms")
        axes[1][j].set_xlabel(f"arrival rate / capacity ({cap:.1f} req/s)")
    axes[0][0].set_ylabel("fraction within budget")
    axes[1][0].set_ylabel("accuracy (503 = wrong)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
