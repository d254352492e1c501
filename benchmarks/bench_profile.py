"""`ctrl profile` throughput on CPU: (configuration x sample) generations per minute.

    python benchmarks/bench_profile.py                 # 40 testbed samples x 6 configurations, 8 new tokens

Generates (once, cached in benchmarks/.cache) a testbed dataset, then profiles the embedded
model on it three ways in the same run, each into a fresh output directory:

* ``1 process``: the baseline, one process, one torch thread per request;
* ``1 process, 2 threads``: the same with two torch threads per request;
* ``2 processes``: two ranks started like ``torchrun --nproc-per-node 2`` (gloo), one thread each,
  every rank measuring its half of the samples, rank 0 merging.

For each it reports the wall time (the in-process runs reuse one loaded model; the 2-process run
includes starting two interpreters and loading the model in each), generations per minute, and
the median of the measured per-request ``T_total_ms`` (what ends up in exp6): parallel work
raises throughput but may stretch single requests on a shared machine, which the latency column
shows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"
CONFIGS = [(2, 4, 12), (2, 12, 16), (6, 8, 14), (10, 4, 12), (10, 8, 16), (10, 12, 16)]


def _config(dataset: Path, out: Path, num_samples: int, max_new_tokens: int, threads: int):
    from profiler.sweep import ProfileConfig

    return ProfileConfig(datasets=[dataset], model="embedded", configs=CONFIGS, num_samples=num_samples,
                         out_dir=out, max_new_tokens=max_new_tokens, threads=threads)


def _worker(rank: int, world: int, port: int, dataset: str, out: str, num_samples: int, max_new_tokens: int) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch

    from profiler.sweep import profile_model

    profile_model(_config(Path(dataset), Path(out), num_samples, max_new_tokens, threads=1))
    torch.distributed.destroy_process_group()


def _latencies(out: Path) -> list[float]:
    values = []
    for path in sorted(out.glob("exp6_latency_*/exp6_latency_crops*_topk*_blocks*.json")):
        if "_rank" in path.name:
            continue
        values += [r["T_total_ms"] for r in json.loads(path.read_text())["per_sample_latencies"]]
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from profiler.sweep import profile_model
    from runtime import load_runtime
    from testbed.task import generate_dataset

    dataset = generate_dataset(CACHE / "profile-testbed", args.num_samples, seed=7, split="validation")
    generations = args.num_samples * len(CONFIGS)
    runtime = load_runtime("embedded")
    rows = []
    for label, threads in (("1 process", 1), ("1 process, 2 threads", 2)):
        out = CACHE / "profile-out"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        profile_model(_config(dataset, out, args.num_samples, args.max_new_tokens, threads), runtime=runtime)
        rows.append((label, time.perf_counter() - start, _latencies(out)))
    out = CACHE / "profile-out"
    shutil.rmtree(out, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()  # includes starting 2 interpreters and loading the model twice
    mp.start_processes(_worker, args=(2, port, str(dataset), str(out), args.num_samples, args.max_new_tokens),
                       nprocs=2, start_method="spawn")
    rows.append(("2 processes (torchrun-style, incl. start-up)", time.perf_counter() - start, _latencies(out)))
    shutil.rmtree(out, ignore_errors=True)

    print(f"{args.num_samples} samples x {len(CONFIGS)} configurations = {generations} generations, "
          f"max_new_tokens {args.max_new_tokens}")
    print("| run | wall s | generations / min | median T_total_ms |")
    print("|---|---:|---:|---:|")
    for label, seconds, lat in rows:
        print(f"| {label} | {seconds:.1f} | {60 * generations / seconds:.0f} | {statistics.median(lat):.1f} |")


if __name__ == "__main__":
    main()
