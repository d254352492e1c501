"""Write the project's sample data: a real ``ctrl profile`` of the trained testbed (data/README.md).

Usage::

    python data/generate.py [--out DIR] [--force]     # the sample data (seconds)
    python data/generate.py --pack PROFILE_DIR        # maintainers: record a new profile (see data/README.md)
    python data/generate.py --synthetic [--out DIR]   # the synthetic MolmoE-like tree instead (test tool)

The sample data is

* ``testbed/``: the profiled VQA samples (``dataset.json`` + ``images/``), regenerated from the
  seed by ``testbed.task.generate_dataset`` (the same generator the testbed trains on, another seed);
* ``exp5/``, ``exp6/``: the exp5 / exp6 trees ``ctrl profile`` wrote for them, unpacked from the
  committed archive ``testbed_profile.parquet`` (``profiler.archive``; byte-identical to
  the measured tree).

A stamp file ``.generated`` holds the archive's and generator's fingerprint, so re-running with
nothing changed is instant.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(REPO_ROOT) not in sys.path:  # run from elsewhere: make the repo importable
    sys.path.insert(0, str(REPO_ROOT))

# imported after the sys.path insert above: the script must run from anywhere, before the package is installed
from profiler.archive import pack_profile, unpack_profile  # noqa: E402
from synthetic import SyntheticSpec, generate_tree, spec_fingerprint  # noqa: E402
from testbed.task import generate_dataset  # noqa: E402

STAMP = ".generated"
ARCHIVE = HERE / "testbed_profile.parquet"
#: the profiled samples: testbed.task.generate_dataset(..., NUM_SAMPLES, seed=SEED, split=SPLIT)
NUM_SAMPLES = 600
SEED = 2026
SPLIT = "validation"
#: synthetic tree (--synthetic): samples per dataset
SYNTHETIC_SAMPLES_PER_DATASET = 400
SUBDIRS = ("exp5", "exp6", "testbed")


def _tree_size(out: Path, subdirs: tuple[str, ...]) -> tuple[int, int]:
    files = [p for sub in subdirs for p in (out / sub).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _up_to_date(out: Path, subdirs: tuple[str, ...], fingerprint: str) -> bool:
    """Every output directory there and the stamp naming this fingerprint (written last)."""
    stamp = out / STAMP
    return (all((out / sub).is_dir() for sub in subdirs) and stamp.is_file()
            and stamp.read_text().strip() == fingerprint)


def _fingerprint() -> str:
    digest = hashlib.sha256(ARCHIVE.read_bytes())
    digest.update(json.dumps({"samples": NUM_SAMPLES, "seed": SEED, "split": SPLIT}).encode())
    digest.update((REPO_ROOT / "testbed" / "task.py").read_bytes())  # the image generator
    return digest.hexdigest()


def write_sample_data(out: Path, force: bool = False) -> str:
    if not ARCHIVE.is_file():
        msg = f"{ARCHIVE}: missing (it is committed with the repository; see data/README.md)"
        raise SystemExit(msg)
    stamp = out / STAMP
    fingerprint = _fingerprint()
    if not force and _up_to_date(out, SUBDIRS, fingerprint):
        return f"{out}: up to date ({fingerprint[:12]}); use --force to regenerate"
    stamp.unlink(missing_ok=True)  # a crash mid-way must not leave a valid-looking stamp
    start = time.perf_counter()
    generate_dataset(out / "testbed", NUM_SAMPLES, seed=SEED, split=SPLIT, overwrite=force)
    staging = out / ".unpack.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    report = unpack_profile(ARCHIVE, staging)
    for sub in ("exp5", "exp6"):  # exp5_accuracy_<name> -> exp5/, exp6_latency_<name> -> exp6/
        shutil.rmtree(out / sub, ignore_errors=True)
        (out / sub).mkdir()
        for tree in sorted(staging.glob(f"{sub}_*")):
            tree.rename(out / sub / tree.name)
    shutil.rmtree(staging)
    stamp.write_text(fingerprint + "\n")
    n_files, n_bytes = _tree_size(out, SUBDIRS)
    return (f"{out}: {NUM_SAMPLES} testbed samples and their profile ({report.records} measured generations) -> "
            f"{n_files} files, {n_bytes / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s")


def write_synthetic(out: Path, force: bool = False) -> str:
    spec = SyntheticSpec(num_samples=SYNTHETIC_SAMPLES_PER_DATASET)
    stamp = out / STAMP
    fingerprint = "synthetic-" + spec_fingerprint(spec)
    subdirs = ("exp5", "exp6", "images")
    if not force and _up_to_date(out, subdirs, fingerprint):
        return f"{out}: up to date (synthetic {fingerprint[10:22]}); use --force to regenerate"
    stamp.unlink(missing_ok=True)
    start = time.perf_counter()
    tree = generate_tree(spec, out, overwrite=True)
    stamp.write_text(fingerprint + "\n")
    n_files, n_bytes = _tree_size(out, subdirs)
    return (f"{out}: synthetic tree, {n_files} files, {n_bytes / 1e6:.1f} MB, {tree.num_records} per-sample records "
            f"in {time.perf_counter() - start:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory (default: the data/ folder)")
    parser.add_argument("--force", action="store_true", help="regenerate even if the stamp matches")
    parser.add_argument("--synthetic", action="store_true", help="write the synthetic MolmoE-like tree instead")
    parser.add_argument("--pack", type=Path, metavar="PROFILE_DIR",
                        help=f"pack a `ctrl profile --out PROFILE_DIR` tree into {ARCHIVE.name} (maintainers)")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    if args.pack is not None:
        rows = pack_profile(args.pack, ARCHIVE)
        print(f"{ARCHIVE}: {rows} per-sample rows, {ARCHIVE.stat().st_size / 1e3:.0f} kB")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    print(write_synthetic(out, args.force) if args.synthetic else write_sample_data(out, args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
