"""Feature extraction throughput of the embedded model on CPU.

    python benchmarks/bench_features.py            # the synthetic tree (800 samples, 426 images)

Generates the synthetic tree (``data/generate.py --synthetic``, into benchmarks/.cache) if needed,
ingests it into a scratch workspace, then times ``extract_features`` with --force at batch size 1
(the baseline) and 16, and the cached re-run that must do no forward pass. The model is loaded
once, outside the timings. Medians over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()

    import torch

    from features import FeatureConfig, extract_features
    from pipeline import IngestConfig, ingest
    from runtime import load_runtime

    torch.set_num_threads(args.threads)
    data = CACHE / "synthetic-data"
    subprocess.run([sys.executable, str(ROOT / "data" / "generate.py"), "--synthetic", "--out", str(data)],
                   check=True, capture_output=True)
    ws = CACHE / "features-ws"
    shutil.rmtree(ws, ignore_errors=True)
    ingest(IngestConfig(paths=[data / "exp5", data / "exp6"], workspace=ws))
    runtime = load_runtime("embedded")
    rows = []
    for label, batch_size, force in (("batch size 1 (baseline)", 1, True), ("batch size 16", 16, True),
                                     ("cached re-run", 16, False)):
        times, report = [], None
        for _ in range(args.repeats):
            config = FeatureConfig(workspace=ws, images_dir=data / "images", batch_size=batch_size, force=force)
            started = time.perf_counter()
            report = extract_features(config, runtime=runtime)
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
        rows.append((label, seconds, report.num_samples / seconds, report.computed, report.forward_batches))
        print(f"  {label}: {seconds:.2f}s", file=sys.stderr)
    print(f"\n{rows[0][3]} samples, embedded model, CPU, {args.threads} threads, median of {args.repeats}\n")
    print("| run | median s | samples/s | samples computed | forward batches |")
    print("|---|---:|---:|---:|---:|")
    for label, s, sps, computed, batches in rows:
        print(f"| {label} | {s:.2f} | {sps:.1f} | {computed} | {batches} |")


if __name__ == "__main__":
    main()
