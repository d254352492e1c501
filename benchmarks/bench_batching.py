"""The server's worker one request at a time against continuous batching, in one run on one loaded model.

    python benchmarks/bench_batching.py                          # the embedded model, 4 clients, --max-batch 1,4
    python benchmarks/bench_batching.py --model tiny-molmoe --clients 8 --max-batch 1,4,8 --rounds 3

``--clients`` closed-loop clients (each sends its next request when its answer is back) send
``--requests`` requests in all through ``serve.engine.Engine`` (its worker thread, its queue, its
records; no HTTP), every request with fixed knobs (seeded images of varied sizes, three
configurations in turn, ``--max-tokens`` new tokens, greedy) so every arm does the same work. Per
``--max-batch`` setting, the arms alternating for ``--rounds``: requests per second (all of them
over the wall time), the median and 90th percentile of the requests' served latency
(``latency_total_ms``), their median decode time per token, the mean rows a decode step ran, and
how many answers differ from the first setting's (greedy: none should).

``--interleave-steps N`` (0: off) then measures what a joining request's prefill costs the rows
already decoding (the server prefills a joining request whole, between two decode steps): per batch
of ``--interleave-rows`` rows (at the first configuration, decoding without end), N decode steps
alone and N more each right after one new request's whole prefill joins (a 640x480 image at that
configuration's crops), alternating; the medians of the rows' gap between two tokens either way, and
of the prefill pass alone.

The CPU's model is printed: compare only figures of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

SIZES = ((320, 240), (640, 480), (300, 300), (1000, 250), (150, 150), (800, 600))
CONFIGS = ((2, 8, 16), (4, 4, 12), (1, 2, 14))


def load(model: str):
    if model == "tiny-molmoe":
        from molmoe_origin import build_tiny

        from runtime.molmoe import MolmoERuntime

        checkpoint = ROOT / "benchmarks" / ".cache" / "tiny-molmoe"
        if not (checkpoint / "config.json").is_file():
            build_tiny(checkpoint)
        return MolmoERuntime(checkpoint)
    from runtime import load_runtime

    return load_runtime(model)


def requests_for(count: int, max_tokens: int):
    import numpy as np
    from PIL import Image

    from serve.protocol import ChatRequest

    out = []
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        image = Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))
        crops, k, blocks = CONFIGS[i % len(CONFIGS)]
        out.append(ChatRequest("bench", f"What is in picture {i}?", image, max_tokens, 1e6,
                               knobs={"max_crops": crops, "top_k": k, "num_active_blocks": blocks}))
    return out


async def serve_all(engine, requests, clients: int) -> list[dict]:
    from serve.engine import new_job

    loop = asyncio.get_running_loop()
    queue = list(enumerate(requests))
    records: dict[int, dict] = {}

    async def client() -> None:
        while queue:
            i, request = queue.pop(0)
            job = new_job(request, engine, time.perf_counter(), datetime.now(UTC), 0.0)
            job.loop, job.future = loop, loop.create_future()
            engine.submit(job)
            result = await job.future
            records[i] = {**result.record, "text": result.text}

    await asyncio.gather(*(client() for _ in range(clients)))
    return [records[i] for i in range(len(requests))]


def run_arm(runtime, requests, clients: int, max_batch: int, threads: int) -> tuple[float, list[dict]]:
    from controller.cost import LatencyScale
    from controller.machine import MachineCost
    from serve.deciders import FixedKnobs
    from serve.engine import Engine

    decider = FixedKnobs({"max_crops": 1, "top_k": 1, "num_active_blocks": runtime.num_layers}, runtime.num_experts,
                         runtime.num_layers, 12, MachineCost(LatencyScale({})))
    engine = Engine(runtime, decider, model_name="bench", max_queue=len(requests), default_budget_ms=1e6,
                    threads=threads, request_log=None, preprocess_workers=1, max_batch=max_batch, queue_deadline=0.0,
                    refuse_unreachable=False)
    engine.start()
    try:
        start = time.perf_counter()
        records = asyncio.run(serve_all(engine, requests, clients))
        return time.perf_counter() - start, records
    finally:
        engine.stop()


def interleave(runtime, rows_counts: list[int], steps: int, threads: int) -> list[tuple[int, float, float, float]]:
    """Per count of decoding rows: the median gap between two of their tokens with nothing beside their
    decode step, with a request's whole prefill joining before it, and that prefill's median wall (ms)."""
    import numpy as np
    import torch
    from PIL import Image

    from runtime.timing import cpu_threads

    crops, top_k, blocks = CONFIGS[0]
    pixels = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    joining = runtime.decoder_inputs(runtime.preprocess(Image.fromarray(pixels), "What is in the image?", crops))
    prompt = runtime.decoder_inputs(runtime.preprocess(None, "What is in the image?", crops))
    knobs = runtime.knobs_after_prefix(0, top_k, blocks)
    eos = int(runtime.eos_id)

    def no_eos(logits: torch.Tensor) -> int:  # the rows decode on for the whole measurement
        return int(logits.flatten().index_fill(0, torch.tensor([eos]), float("-inf")).argmax())

    out = []
    with cpu_threads(threads, runtime.device), runtime.batch_context():
        for rows in rows_counts:
            batch = runtime.batch_decoder()
            batch.count_products = False
            batch.join([prompt] * rows, [knobs] * rows, [10 * steps + 10] * rows, pick=[no_eos] * rows)
            alone, beside, prefill = [], [], []
            for _ in range(steps):
                tick = time.perf_counter()
                batch.step()
                alone.append((time.perf_counter() - tick) * 1000.0)
                tick = time.perf_counter()
                batch.join([joining], [knobs], [1])  # its first token ends it: the rows' next step is theirs alone
                joined = time.perf_counter()
                batch.step()
                beside.append((time.perf_counter() - tick) * 1000.0)
                prefill.append((joined - tick) * 1000.0)
            out.append((rows, statistics.median(alone), statistics.median(beside), statistics.median(prefill)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="embedded, testbed, tiny-molmoe or a model directory")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch", default="1,4", help="comma-separated --max-batch settings")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads (the server's --threads)")
    parser.add_argument("--interleave-steps", type=int, default=0,
                        help="decode steps with and without a joining prefill per batch size (0: not measured)")
    parser.add_argument("--interleave-rows", default="1,2,4", help="comma-separated batch sizes of --interleave-steps")
    args = parser.parse_args()

    import torch
    from molmoe_common import cpu_name

    runtime = load(args.model)
    requests = requests_for(args.requests, args.max_tokens)
    settings = [int(s) for s in args.max_batch.split(",")]
    run_arm(runtime, requests[:2], 1, settings[-1], args.threads)  # one-time costs out of the first arm
    walls: dict[int, list[float]] = {s: [] for s in settings}
    records: dict[int, list[dict]] = {s: [] for s in settings}
    texts: dict[int, list[str]] = {}
    for _ in range(args.rounds):
        for setting in settings:
            wall, recs = run_arm(runtime, requests, args.clients, setting, args.threads)
            walls[setting].append(wall)
            records[setting] += recs
            texts.setdefault(setting, [r["text"] for r in recs])
    first = settings[0]
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} thread(s); model {args.model}; "
          f"{args.clients} closed-loop clients, {args.requests} requests x {args.rounds} rounds, "
          f"{args.max_tokens} new tokens at most")
    print("| --max-batch | requests/s | served ms p50 | served ms p90 | decode ms per token | rows per step | "
          "answers differing |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for setting in settings:
        recs = records[setting]
        served = sorted(r["latency_total_ms"] for r in recs)
        per_token = [r["latency_decode_ms"] / (r["num_output_tokens"] - 1) for r in recs if r["num_output_tokens"] > 1]
        rows = [r["batch_rows_decode"] for r in recs if r.get("batch_rows_decode") is not None]
        differ = sum(a != b for a, b in zip(texts[setting], texts[first], strict=True))
        print(f"| {setting} | {args.requests / statistics.median(walls[setting]):.2f} | "
              f"{statistics.median(served):.1f} | {served[int(0.9 * (len(served) - 1))]:.1f} | "
              f"{statistics.median(per_token):.2f} | {statistics.mean(rows) if rows else 1.0:.2f} | {differ} |")
    if args.interleave_steps:
        crops, top_k, blocks = CONFIGS[0]
        print(f"\nA joining request's whole prefill between two decode steps ({crops}/{top_k}/{blocks}, a 640x480 "
              f"image joining; medians of {args.interleave_steps} steps each):")
        print("| rows decoding | gap between tokens, ms: step alone | with a prefill joining | the prefill alone |")
        print("|---:|---:|---:|---:|")
        for rows, alone, beside, prefill in interleave(runtime, [int(r) for r in args.interleave_rows.split(",")],
                                                        args.interleave_steps, args.threads):
            print(f"| {rows} | {alone:.2f} | {beside:.2f} | {prefill:.2f} |")


if __name__ == "__main__":
    main()
