"""Ingest throughput and peak memory against a parse-only floor, in one run.

    python benchmarks/bench_ingest.py                 # >= 500k per-sample records (cached tree)
    python benchmarks/bench_ingest.py --scale 0.1     # quick look

The tree is generated once (deterministically) under ``benchmarks/.cache/``. Every
measurement runs in a fresh child process so that its peak RSS is its own:

* ``floor``: read every JSON file and ``orjson.loads`` it (the fastest parser ingest uses);
* ``ingest Nw``: ``ctrl ingest`` into an empty workspace with N parser processes;
* ``re-ingest``: the same call again on the unchanged tree (the no-op path).

Medians over ``--repeats`` runs. Peak RSS: the ingest process's own maximum (getrusage), and
the summed RSS of it and all its parser workers, sampled from /proc every 20 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"


def build_tree(scale: float) -> tuple[Path, int]:
    from synthetic import SyntheticSpec, generate_tree

    spec = SyntheticSpec(
        datasets=("coco_2014_vqa", "text_vqa", "okvqa"),
        num_samples=int(2400 * scale),
        exp6_num_samples=int(1200 * scale),
        world_size=4,
        write_images=False,
    )
    out = CACHE / f"tree-{spec.num_samples}-{spec.exp6_num_samples}"
    stamp = out / "records.txt"
    if not stamp.exists():
        shutil.rmtree(out, ignore_errors=True)
        tree = generate_tree(spec, out)
        stamp.write_text(str(tree.num_records))
    return out, int(stamp.read_text())


def _child(mode: str, tree: Path, workspace: Path, workers: int) -> None:
    started = time.perf_counter()
    if mode == "floor":
        import orjson

        for path in sorted(tree.rglob("*.json")):
            try:
                orjson.loads(path.read_bytes())
            except orjson.JSONDecodeError:  # files with NaN: the stdlib parser, as ingest does
                json.loads(path.read_bytes())
    else:
        from pipeline import IngestConfig, ingest

        report = ingest(IngestConfig(paths=[tree], workspace=workspace, num_workers=workers))
        assert report.exit_code == 0, report.errors[:3]
    elapsed = time.perf_counter() - started
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"seconds": elapsed, "main_rss_mib": max(own, kids) / 1024}))


def _tree_rss_mib(root_pid: int) -> float:
    """Summed RSS of ``root_pid`` and all its descendants (parser workers included), from /proc."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/statm") as fh:
                rss[int(entry)] = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(rss.get(pid, 0) for pid in tree) / 2**20


def measure(mode: str, tree: Path, workspace: Path, workers: int = 1) -> dict:
    """Run one measurement in a child process, sampling the whole process tree's RSS."""
    cmd = [sys.executable, __file__, "--child", mode, "--tree", str(tree), "--workspace", str(workspace),
           "--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, _tree_rss_mib(proc.pid))
        time.sleep(0.02)
    stdout, stderr = proc.communicate()
    if proc.returncode:
        msg = f"{mode} failed:\n{stderr}"
        raise RuntimeError(msg)
    return {**json.loads(stdout.strip().splitlines()[-1]), "tree_rss_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="tree size relative to the default (>= 500k records)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["floor", "ingest"], help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.tree, args.workspace, args.workers)
        return

    t0 = time.perf_counter()
    tree, records = build_tree(args.scale)
    files = sorted(tree.rglob("*.json"))
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    print(f"tree: {len(files)} files, {records:,} per-sample records, {size_mb:.0f} MB "
          f"({time.perf_counter() - t0:.0f}s to build or load)", file=sys.stderr)
    ws_root = CACHE / "workspaces"
    rows = []
    cases = [("parse floor (orjson.loads, 1 process)", "floor", 1, False),
             ("ctrl ingest, 1 parser process", "ingest", 1, False),
             ("ctrl ingest, 2 parser processes", "ingest", 2, False),
             ("ctrl ingest again, unchanged tree", "ingest", 2, True)]
    floor_s = None
    for label, mode, workers, warm in cases:
        runs = []
        for _ in range(args.repeats):
            ws = ws_root / f"{mode}-{workers}"
            if not warm:
                shutil.rmtree(ws, ignore_errors=True)
            elif not ws.exists():
                measure(mode, tree, ws, workers)
            runs.append(measure(mode, tree, ws, workers))
        seconds = statistics.median(r["seconds"] for r in runs)
        main_rss = max(r["main_rss_mib"] for r in runs)
        worker_rss = max(r["tree_rss_mib"] for r in runs)
        floor_s = floor_s or seconds
        rows.append((label, seconds, records / seconds, size_mb / seconds, seconds / floor_s, main_rss, worker_rss))
        print(f"  {label}: {seconds:.2f}s", file=sys.stderr)
    print(f"\n{records:,} records in {len(files)} files ({size_mb:.0f} MB), median of {args.repeats}, "
          f"{os.cpu_count()} cores\n")
    print("| run | median s | records/s | MB/s | x floor | peak RSS MiB (main process) "
          "| peak RSS MiB (all processes, sampled) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, s, rps, mbs, ratio, main_rss, worker_rss in rows:
        worker = f"{worker_rss:.0f}"
        print(f"| {label} | {s:.2f} | {rps:,.0f} | {mbs:.0f} | {ratio:.2f} | {main_rss:.0f} | {worker} |")


if __name__ == "__main__":
    main()
