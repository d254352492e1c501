"""Write the project's synthetic sample data (data/exp5, data/exp6, data/images).

Usage: ``python data/generate.py [--out DIR] [--force]``

The tree is ``SyntheticSpec(num_samples=400)`` (coco_2014_vqa + text_vqa, 400 samples each,
the 27 balanced configurations, world_size 2); see data/README.md. 400 per dataset (not the
spec default of 150) so that the 10 % test split of ``ctrl evaluate`` has ~80 samples. A stamp file ``.generated``
holds the spec fingerprint, so re-running with an unchanged generator is instant.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent

try:
    from pipeline.synthetic import SyntheticSpec, generate_tree, spec_fingerprint
except ImportError:  # run from elsewhere: make the repo importable
    sys.path.insert(0, str(REPO_ROOT))
    from pipeline.synthetic import SyntheticSpec, generate_tree, spec_fingerprint

STAMP = ".generated"
#: samples per dataset of the shipped tree (the evaluation's test split is ~10 % of 2x this)
SAMPLES_PER_DATASET = 400


def _tree_size(out: Path) -> tuple[int, int]:
    files = [p for sub in ("exp5", "exp6", "images") for p in (out / sub).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory (default: the data/ folder)")
    parser.add_argument("--force", action="store_true", help="regenerate even if the stamp matches")
    args = parser.parse_args(argv)

    spec = SyntheticSpec(num_samples=SAMPLES_PER_DATASET)
    out: Path = args.out.resolve()
    stamp = out / STAMP
    fingerprint = spec_fingerprint(spec)
    complete = all((out / sub).is_dir() for sub in ("exp5", "exp6", "images"))
    if not args.force and complete and stamp.is_file() and stamp.read_text().strip() == fingerprint:
        print(f"{out}: up to date (spec {fingerprint[:12]}); use --force to regenerate")
        return 0

    stamp.unlink(missing_ok=True)  # a crash mid-way must not leave a valid-looking stamp
    start = time.perf_counter()
    tree = generate_tree(spec, out, overwrite=True)
    stamp.write_text(fingerprint + "\n")
    n_files, n_bytes = _tree_size(out)
    print(f"{out}: wrote {n_files} files, {n_bytes / 1e6:.1f} MB, {tree.num_records} per-sample records "
          f"in {time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
