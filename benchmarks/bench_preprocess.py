"""MolmoE-1B's image preprocessing on the host: one image into its crops, on one core.

    python benchmarks/bench_preprocess.py                       # 640x480 at max_crops 10, and more shapes
    python benchmarks/bench_preprocess.py --repeats 200 --json out.json

What a request pays before the vision tower (``MolmoProcessor.process``: RGB pixels, the resize of
the image onto its tiling's canvas and onto the global crop, normalisation, the crops' patches,
the token layout, the prompt's tokens), timed with one torch thread. Images are seeded noise of
each size (the resize's work does not depend on the pixels). The tokenizer and the processor
config are the released ones from the MolmoE reference folder (``tests/molmoe_origin.py`` finds
it); the model's weights are not needed. The step-by-step resize formulation
(``tests/test_molmoe_processor.py``: every step its own tensor, the reference the processor's
in-place canvas is held to bit for bit) is timed beside it in the same run.

``--engine-requests N`` (0: off) then serves N requests (seeded 640x480 images, max_crops 10,
8 new tokens) through ``serve.engine.Engine`` on a tiny MolmoE checkpoint (the reference's builder,
cached in benchmarks/.cache), all queued at once and run one after another on this thread, as the
worker runs them: once with ``--preprocess-workers 0`` (the model's thread preprocesses) and once
with 1 (the pool prepares the queued requests while the model runs), the arms alternating for
``--rounds``. It reports the requests' median ``preprocess`` segment (what the model's thread
waited for their inputs) and the wall time of the N.

The target (docs/results.md, "Host preprocessing"): a 640x480 image into 10 crops in <= 3 ms
median on one core. The CPU's model is printed: compare only figures of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = ((640, 480, 10), (640, 480, 4), (1000, 250, 12), (300, 300, 6), (1920, 1080, 12))
TARGET_MS = 3.0


def paired_medians(runs, repeats: int) -> list[float]:
    """Median ms of each of ``runs``, timed in turn in every repeat (a noisy machine's drift hits
    them alike), after one unmeasured call each (allocator, kernels)."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, out in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            out.append((time.perf_counter() - start) * 1000.0)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument("--engine-requests", type=int, default=16, help="requests served per arm (0: skip)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the two engine arms")
    args = parser.parse_args()

    import numpy as np
    import torch
    from molmoe_common import cpu_name, stage_reference_files
    from molmoe_origin import SKIP_REASON, reference_dir
    from PIL import Image
    from test_molmoe_processor import _resize_and_pad_unfused

    from runtime.molmoe_processor import MolmoImageConfig, MolmoProcessor, load_molmo_tokenizer

    reference = reference_dir()
    if reference is None:
        sys.exit(f"bench_preprocess: {SKIP_REASON}")
    torch.set_num_threads(1)
    files = stage_reference_files(reference, Path(tempfile.mkdtemp(prefix="bench-preprocess-")))
    processor = MolmoProcessor(load_molmo_tokenizer(files), MolmoImageConfig.from_dir(files))
    unfused = MolmoProcessor(processor.tokenizer, processor.config)
    # the unfused formulation read the uint8 image itself
    unfused._unit_pixels = lambda image: image
    unfused._resize_and_pad = lambda image, h, w: _resize_and_pad_unfused(processor.config, image, h, w)

    rows = []
    for width, height, max_crops in SHAPES:
        pixels = np.random.default_rng(width + height).integers(0, 256, (height, width, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
        crops = int(np.prod(processor.tiling(width, height, max_crops)))
        question = "What is written on the sign?"
        now, before = paired_medians([lambda image=image, m=max_crops: processor.process(image, question, m),
                                      lambda image=image, m=max_crops: unfused.process(image, question, m)],
                                     args.repeats)
        rows.append({"width": width, "height": height, "max_crops": max_crops, "crops": crops,
                     "median_ms": round(now, 3), "unfused_median_ms": round(before, 3)})

    print(f"{cpu_name()}, torch {torch.__version__}, 1 thread; the two formulations in turn, median of "
          f"{args.repeats} after one unmeasured")
    print("| image | max_crops | crops | ms | unfused ms |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['width']}x{row['height']} | {row['max_crops']} | {row['crops']} | {row['median_ms']:.2f} | "
              f"{row['unfused_median_ms']:.2f} |")
    first = rows[0]
    verdict = "met" if first["median_ms"] <= TARGET_MS else "not met"
    print(f"target: 640x480 into {first['crops']} crops <= {TARGET_MS} ms: {first['median_ms']:.2f} ms, {verdict}")
    engine = engine_arms(args.engine_requests, args.rounds) if args.engine_requests else None
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "rows": rows,
                                         "engine": engine}, indent=2))


def engine_arms(requests: int, rounds: int) -> dict[str, dict[str, float]]:
    """The same queued requests served with the model's thread preprocessing and with the pool."""
    from datetime import UTC, datetime

    import numpy as np
    from molmoe_origin import build_tiny
    from PIL import Image

    from controller.cost import LatencyScale
    from controller.machine import MachineCost
    from runtime.molmoe import MolmoERuntime
    from serve.deciders import FixedKnobs
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest

    checkpoint = ROOT / "benchmarks" / ".cache" / "tiny-molmoe"
    if not (checkpoint / "config.json").is_file():
        build_tiny(checkpoint)
    runtime = MolmoERuntime(checkpoint)
    knobs = {"max_crops": 10, "top_k": runtime.default_top_k, "num_active_blocks": runtime.num_layers}
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (480, 640, 3), dtype=np.uint8))
              for i in range(requests)]
    waits: dict[int, list[float]] = {0: [], 1: []}
    walls: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(rounds):
        for workers in (0, 1):
            decider = FixedKnobs(knobs, runtime.num_experts, runtime.num_layers, 12, MachineCost(LatencyScale({})))
            engine = Engine(runtime, decider, model_name="tiny", max_queue=requests, default_budget_ms=1e6,
                            threads=1, request_log=None, preprocess_workers=workers, queue_deadline=0.0)
            start = time.perf_counter()
            jobs = []
            for i, image in enumerate(images):
                job = new_job(ChatRequest("tiny", f"What is in picture {i}?", image, 8, 1e6), engine,
                              time.perf_counter(), datetime.now(UTC), 0.0)
                engine.submit(job)
                jobs.append(job)
            for job in jobs:
                result = engine.execute(job)
                waits[workers].append(result.record["latency_preprocess_ms"])
            walls[workers].append(time.perf_counter() - start)
            engine.stop()
    out = {str(w): {"preprocess_median_ms": statistics.median(waits[w]), "wall_median_s": statistics.median(walls[w])}
           for w in (0, 1)}
    print(f"engine: {requests} queued requests (640x480, max_crops 10, 8 new tokens), tiny MolmoE, {rounds} rounds")
    print("| --preprocess-workers | preprocess wait ms (median) | wall s for the requests (median) |")
    print("|---:|---:|---:|")
    for w in (0, 1):
        print(f"| {w} | {out[str(w)]['preprocess_median_ms']:.2f} | {out[str(w)]['wall_median_s']:.2f} |")
    return out


if __name__ == "__main__":
    main()
