"""A random sample of mutmut's mutants per core module, and its score with a 95 % interval.

A complete mutation run of the core modules takes many hours on 2 cores; a sample of 30 mutants
per module, run by name, gives each module's score within about +-15 points in an hour or two.
Run from the repository root, after ``mutmut run`` has generated ``mutants/`` (any run does, e.g.
one interrupted once it prints "Running mutation testing"):

    python tests/mutation_sample.py pick > sample.txt        # seed 20261124, 30 per module
    mutmut run --max-children 2 $(cat sample.txt)
    python tests/mutation_sample.py score                    # the table of docs/testing.md

``score`` counts, per module, the sampled mutants that mutmut killed (a test failed or timed
out) among those it decided, with the Wilson 95 % interval, and lists the survivors.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from mutmut.stats import status_by_exit_code

#: what counts as caught: a test failed, or the mutant made the tests run past mutmut's timeout
CAUGHT = ("killed", "timeout", "caught by type check")


def _metas(root: Path) -> list[Path]:
    return sorted((root / "mutants").glob("**/*.meta"))


def _module(meta: Path, root: Path) -> str:
    return str(meta.relative_to(root / "mutants"))[: -len(".py.meta")].replace("/", ".")


def sample(root: Path, seed: int, per_module: int) -> dict[str, list[str]]:
    """Per module, ``per_module`` mutant names drawn without replacement (one generator, modules in path order)."""
    rng = random.Random(seed)
    picked = {}
    for meta in _metas(root):
        keys = sorted(json.loads(meta.read_text())["exit_code_by_key"])
        picked[_module(meta, root)] = rng.sample(keys, min(per_module, len(keys)))
    return picked


def wilson(killed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The two-sided Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = killed / n, z * z
    centre, spread = p + z2 / (2 * n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (centre - spread) / (1 + z2 / n), (centre + spread) / (1 + z2 / n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["pick", "score"])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the directory holding mutants/")
    parser.add_argument("--seed", type=int, default=20261124)
    parser.add_argument("--per-module", type=int, default=30)
    args = parser.parse_args()
    picked = sample(args.root, args.seed, args.per_module)
    if args.command == "pick":
        print("\n".join(name for names in picked.values() for name in names))
        return
    print("| module | mutants | sampled | decided | killed | score | 95 % interval |")
    print("|---|---:|---:|---:|---:|---:|---|")
    survivors = []
    for meta in _metas(args.root):
        module = _module(meta, args.root)
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        results = {name: codes[name] for name in picked[module]}
        decided = {k: v for k, v in results.items() if v is not None}
        status = {k: status_by_exit_code[v] for k, v in decided.items()}
        killed = sum(v in CAUGHT for v in status.values())
        lo, hi = wilson(killed, len(decided))
        score = f"{100 * killed / len(decided):.0f} %" if decided else "-"
        print(f"| `{module}` | {len(codes)} | {len(results)} | {len(decided)} | {killed} | {score} | "
              f"{100 * lo:.0f}-{100 * hi:.0f} % |")
        survivors += [f"{k} ({v})" for k, v in status.items() if v not in CAUGHT]
    print("\nsurvivors (`mutmut show NAME`):\n" + "\n".join(survivors))


if __name__ == "__main__":
    main()
