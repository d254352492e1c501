"""Batched generation against one request at a time, per configuration, in one run on one loaded model.

    python benchmarks/bench_batch.py                                   # the testbed and a tiny MolmoE, CPU
    python benchmarks/bench_batch.py --models testbed --batch-sizes 1,4,16 --json out.json
    python benchmarks/bench_batch.py --models /path/to/molmoe --dtype bfloat16 --device cuda

Per model and configuration (max_crops/top_k/blocks), ``--requests`` requests (seeded images of
varied sizes, so prompts differ in length, and distinct questions) are generated greedily, each to
``--max-new-tokens`` at most, once one at a time (``runtime.generate``) and once per batch size B
as ``runtime.generate_batch(requests, max_rows=B)`` (B rows decoding at once, the next request
joining as one leaves); the arms alternate for ``--rounds`` rounds and the median wall time gives
generations per second. ``mixed`` is the same requests, each at another of the configurations, in
one batch. Every batched answer is compared with its batch-1 answer (``differ``: how many are not
the same tokens).

``--profile-samples N`` (0: off) then runs ``ctrl profile`` on N testbed samples at
``--profile-configs`` with ``--batch-size 1`` and with ``--batch-size --profile-batch`` (latencies on
``--profile-latency-samples``), and reports both wall times and whether exp5's answers are identical.

The CPU's model is printed beside every figure: compare only figures of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

QUESTIONS = ("What colour is the largest shape?", "How many shapes are in the picture?",
             "What is in the top left corner?", "Is there a circle in the image?")
SIZES = ((320, 240), (640, 480), (300, 300), (1000, 250), (150, 150), (800, 600), (480, 640), (220, 180))


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.split("/")) for item in text.split(",") if item.strip()]  # type: ignore[misc]


def load_model(name: str, device: str, dtype: str):
    from pipeline.execution import ExecutionOptions
    from runtime import load_runtime

    if name == "tiny-molmoe":
        from bench_molmoe import tiny_checkpoint

        name = str(tiny_checkpoint(64))
    elif name == "testbed":
        from runtime.registry import TestbedRecipe
        from testbed.train import train_testbed

        train_testbed(TestbedRecipe())  # the shipped weights, unpacked into the model cache once
    return name, load_runtime(name, ExecutionOptions(device=device, dtype=dtype))


def make_requests(runtime, count: int, knobs: list[tuple[int, int, int]], max_new_tokens: int):
    from PIL import Image, ImageDraw

    from runtime.base import BatchRequest

    requests = []
    for i in range(count):
        c, k, b = knobs[i % len(knobs)]
        width, height = SIZES[i % len(SIZES)]
        image = Image.new("RGB", (width, height), (20 * i % 255, 90, 160))
        ImageDraw.Draw(image).ellipse([width // 5, height // 5, width // 2, height // 2], fill=(230, 40 + i, 40))
        inputs = runtime.preprocess(image, f"{QUESTIONS[i % len(QUESTIONS)]} ({i})", c)
        requests.append(BatchRequest(inputs, max_new_tokens, top_k=k, num_active_blocks=b))
    return requests


def one_at_a_time(runtime, requests) -> list[list[int]]:
    return [runtime.generate(r.inputs, r.max_new_tokens, top_k=r.top_k,
                             num_active_blocks=r.num_active_blocks).token_ids for r in requests]


def batched(runtime, requests, rows: int) -> list[list[int]]:
    return [r.token_ids for r in runtime.generate_batch(requests, max_rows=rows)]


def measure(runtime, requests, batch_sizes: list[int], rounds: int) -> dict:
    """Median wall time per arm (batch 1 = one at a time) over alternating rounds, and the answers."""
    arms = {1: lambda: one_at_a_time(runtime, requests)}
    arms.update({b: (lambda b=b: batched(runtime, requests, b)) for b in batch_sizes if b > 1})
    times: dict[int, list[float]] = {b: [] for b in arms}
    answers: dict[int, list[list[int]]] = {}
    for arm in arms.values():  # warm-up: first-call costs (allocations, lazy imports) out of the timing
        arm()
    for _ in range(rounds):
        for b, arm in arms.items():
            start = time.perf_counter()
            answers[b] = arm()
            times[b].append(time.perf_counter() - start)
    base = answers[1]
    out = {}
    for b in arms:
        median = statistics.median(times[b])
        out[b] = {"wall_s": median, "generations_per_s": len(requests) / median,
                  "speedup": statistics.median(times[1]) / median,
                  "differ": sum(a != s for a, s in zip(answers[b], base, strict=True)),
                  "tokens": sum(len(a) for a in answers[b])}
    return out


def profile_comparison(args, runtime) -> dict:
    from profiler.sweep import ProfileConfig, profile_model
    from testbed.task import generate_dataset

    with tempfile.TemporaryDirectory() as tmp:
        data = generate_dataset(Path(tmp) / "data", num_samples=args.profile_samples, seed=0)
        out = {}
        for label, extra in (("batch 1", {}),
                             (f"batch {args.profile_batch}", {"batch_size": args.profile_batch,
                                                              "latency_samples": args.profile_latency_samples})):
            config = ProfileConfig(datasets=[data], configs=args.profile_configs, out_dir=Path(tmp) / label,
                                   max_new_tokens=args.max_new_tokens, **extra)
            start = time.perf_counter()
            profile_model(config, runtime=runtime)
            texts = {}
            for path in sorted((Path(tmp) / label).glob("exp5_*/*_rank0.json")):
                texts[path.name] = [s["text"] for s in json.loads(path.read_text())["all_samples"]]
            out[label] = {"wall_s": time.perf_counter() - start, "texts": texts}
        first, second = out.values()
        same = sum(a == b for name in first["texts"] for a, b in zip(first["texts"][name], second["texts"][name]))
        total = sum(len(v) for v in first["texts"].values())
        walls = {label: round(v["wall_s"], 2) for label, v in out.items()}
        return walls | {"exp5_answers_identical": f"{same}/{total}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="testbed,tiny-molmoe")
    parser.add_argument("--configs", default="2/8/16,6/4/12,1/1/14")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--profile-samples", type=int, default=16)
    parser.add_argument("--profile-configs", default="2/8/16,6/4/12")
    parser.add_argument("--profile-batch", type=int, default=8)
    parser.add_argument("--profile-latency-samples", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    import torch
    from molmoe_common import cpu_name

    torch.set_num_threads(args.threads)
    configs = parse_configs(args.configs)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    report: dict = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__, "models": {}}
    print(f"CPU: {report['cpu']}, {args.threads} thread(s), torch {torch.__version__}")
    for name in args.models.split(","):
        label, runtime = load_model(name, args.device, args.dtype)
        rows = {}
        for knob in configs:
            requests = make_requests(runtime, args.requests, [knob], args.max_new_tokens)
            rows["/".join(map(str, knob))] = measure(runtime, requests, batch_sizes, args.rounds)
        rows["mixed"] = measure(runtime, make_requests(runtime, args.requests, configs, args.max_new_tokens),
                                batch_sizes, args.rounds)
        report["models"][name] = rows
        print(f"\n{name} ({runtime.kind}, {str(runtime.dtype).removeprefix('torch.')}): "
              f"{args.requests} requests x <= {args.max_new_tokens} tokens, generations per second (speed-up, differ)")
        print("config     " + "".join(f"{'B=' + str(b):>18}" for b in batch_sizes))
        for knob, arms in rows.items():
            cells = "".join(f"{arms[b]['generations_per_s']:>8.2f} ({arms[b]['speedup']:4.2f}x,{arms[b]['differ']:>2})"
                            for b in batch_sizes)
            print(f"{knob:<11}{cells}")
        if args.profile_samples and name == "testbed":
            report["profile"] = profile_comparison(args, runtime)
            print(f"\nctrl profile, {args.profile_samples} samples x {args.profile_configs}: {report['profile']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
