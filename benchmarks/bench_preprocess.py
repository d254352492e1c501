"""MolmoE-1B's image preprocessing on the host: one image into its crops, on one core.

    python benchmarks/bench_preprocess.py                       # 640x480 at max_crops 10, and more shapes
    python benchmarks/bench_preprocess.py --repeats 200 --json out.json

What a request pays before the vision tower (``MolmoProcessor.process``: RGB pixels, the resize of
the image onto its tiling's canvas and onto the global crop, normalisation, the crops' patches,
the token layout, the prompt's tokens), timed with one torch thread. Images are seeded noise of
each size (the resize's work does not depend on the pixels). The tokenizer and the processor
config are the released ones from the MolmoE reference folder (``tests/molmoe_origin.py`` finds
it); the model's weights are not needed. The step-by-step resize formulation
(``tests/test_molmoe_processor.py``, what the processor computed before its canvas was filled in
place) is timed beside it in the same run.

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
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
