"""Peak memory and time of loading a MolmoE checkpoint: this tree against an earlier revision, one run.

    python benchmarks/bench_loading.py                        # baseline: d91e8ee (before streaming loads)
    python benchmarks/bench_loading.py --baseline-rev HEAD~3 --d-model 384 --rounds 5

Writes (once, cached in benchmarks/.cache) a random-weight checkpoint with the real layout and
vocabulary at ``--d-model`` (256: 127 M parameters, 0.5 GB in float32) twice: one float32 file
and bfloat16 shards of 100 MB. Each load runs in a fresh process: imports first, then the
kernel's high-water mark is reset (``/proc/self/clear_refs``) and the load's peak resident memory
above the baseline is read back with its time. The baseline revision is checked out with
``git worktree`` beside the cache and loads the same files (it holds float32 weights only).
Reported per (revision, file, held dtype): median load seconds and peak / weight bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
CACHE = ROOT / "benchmarks" / ".cache"

def checkpoints(d_model: int) -> dict[str, Path]:
    import torch
    from molmoe_origin import build_tiny

    from synthetic.molmoe_checkpoint import write_random_checkpoint

    tiny = CACHE / "tiny-molmoe-d64"
    if not (tiny / "model.safetensors").is_file():
        build_tiny(tiny)
    config = {**json.loads((tiny / "config.json").read_text()), "d_model": d_model}
    out = {}
    for name, dtype, shard in (("float32", torch.float32, 5_000_000_000), ("bfloat16", torch.bfloat16, 100_000_000)):
        path = CACHE / f"loading-d{d_model}-{name}"
        if not (path / "config.json").is_file():
            write_random_checkpoint(path, config, tiny, dtype=dtype, max_shard_bytes=shard)
        out[name] = path
    return out


def baseline_tree(rev: str) -> Path:
    tree = CACHE / f"worktree-{rev.replace('/', '_')}"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
    return tree


def main() -> None:
    from load_memory import measure_load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default="d91e8ee")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    files = checkpoints(args.d_model)
    cases = [(f"baseline {args.baseline_rev}", baseline_tree(args.baseline_rev), stored, "-")
             for stored in ("float32", "bfloat16")]
    dtypes = ("float32", "bfloat16")
    cases += [("this tree", ROOT, stored, held) for stored in dtypes for held in dtypes]
    print(f"| revision | file | held | load s (median of {args.rounds}) | weights MB | peak / weights |")
    print("|---|---|---|---:|---:|---:|")
    for label, tree, stored, held in cases:
        env = {"CTRL_CACHE_DIR": str(CACHE / "loading-model-cache")}
        runs = [measure_load(files[stored], held, tree, env) for _ in range(args.rounds)]
        seconds = statistics.median(r["seconds"] for r in runs)
        ratio = statistics.median(r["peak"] / r["weights"] for r in runs)
        print(f"| {label} | {stored} | {'float32' if held == '-' else held} | {seconds:.2f} | "
              f"{runs[0]['weights'] / 1e6:.0f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
