"""Matrix products over half-precision weights on this CPU: which kernel ``--dtype bfloat16`` picks.

    python benchmarks/bench_precision.py                 # 2 threads, bfloat16, 7 rounds
    python benchmarks/bench_precision.py --dtype float16 --threads 1

For MolmoE-1B's weight shapes (an expert's gate/up 1024 x 2048 and down 2048 x 1024, an attention
projection 2048 x 2048, the LM head 50304 x 2048) and a range of rows (1 = a decode step), times
in one run, median of ``--rounds``:

* ``float32``: the float32 kernel on float32 weights (the baseline: what ``--dtype float32`` does);
* ``half kernel``: the bf16/f16 kernel on the half weights (inputs rounded, output rounded);
* ``convert``: the weight converted to float32 for the call, the float32 kernel on rounded inputs;
* ``picked``: what ``runtime.precision.HalfStorageCompute`` does (the half kernel up to
  ``CPU_HALF_KERNEL_MAX_ROWS`` rows, else convert).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [("expert gate/up", 1024, 2048), ("expert down", 2048, 1024), ("attention", 2048, 2048),
          ("LM head", 50304, 2048)]
ROWS = (1, 4, 8, 16, 64, 512)


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from runtime.precision import CPU_HALF_KERNEL_MAX_ROWS, HalfStorageCompute

    torch.set_num_threads(args.threads)
    half = getattr(torch, args.dtype)
    mode = HalfStorageCompute(half)
    print(f"{args.dtype} weights, {args.threads} threads, median of {args.rounds} (ms); half kernel up to "
          f"{CPU_HALF_KERNEL_MAX_ROWS} rows")
    print("| weight | rows | float32 | half kernel | convert | picked | picked / float32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for label, out_dim, in_dim in SHAPES:
        w32 = torch.randn(out_dim, in_dim, generator=generator) / in_dim ** 0.5
        wh = w32.to(half)
        for rows in ROWS:
            if label == "LM head" and rows > 64:
                continue  # generation takes the head of the last position only
            x = torch.randn(rows, in_dim, generator=generator)
            f32 = median_ms(lambda: F.linear(x, w32), args.rounds)
            kernel = median_ms(lambda: F.linear(x.to(half), wh).float(), args.rounds)
            convert = median_ms(lambda: F.linear(x.to(half).float(), wh.float()).to(half).float(), args.rounds)

            def picked():
                with mode:
                    F.linear(x, wh)

            chosen = median_ms(picked, args.rounds)
            print(f"| {label} {out_dim} x {in_dim} | {rows} | {f32:.2f} | {kernel:.2f} | {convert:.2f} | "
                  f"{chosen:.2f} | {chosen / f32:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
