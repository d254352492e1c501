"""MolmoE-1B at its real size on this machine: a random-weight checkpoint with the released config.

    python benchmarks/molmoe_full_size.py                 # every step below, ~20 min on 2 cores
    python benchmarks/molmoe_full_size.py --steps load,knobs --out /scratch/molmoe-random

Steps (``--steps``, comma-separated; results gathered in ``<out>/../full_size_results.json``):

* ``write``: the checkpoint: the reference's real ``config.json`` (7.22 B parameters), its
  tokenizer and processor configs, bfloat16 safetensors shards of at most 5 GB named as
  ``save_pretrained`` names them, seeded random weights written tensor by tensor
  (``synthetic.molmoe_checkpoint``; ~14.4 GB). Skipped when the same checkpoint is there.
* ``load``: a fresh process loads it with ``--dtype bfloat16``: load time, peak resident memory
  (the kernel's high-water mark, whole process) and the weights' bytes; then a float32 load,
  which must be refused before reading (27 GiB do not fit in 24 GiB) with its message.
* ``knobs``: in one process, one request per knob extreme after a warm-up: crops 1 vs 12,
  top-K 8 vs 2 vs 1, 16 blocks vs 8, each timed with the hooks ``ctrl profile`` uses (vision,
  prefill, decode steps), 8 generated tokens, one torch thread per core.
* ``cli``: through the ``ctrl`` command, each in its own process (time and peak memory):
  ``ctrl extract-features`` on 2 samples (a workspace ingested from an embedded-model profile of
  a 2-sample testbed set) and ``ctrl profile`` on 1 sample x 2 configurations.

The reference (``../shared/molmoe_reference`` or ``$CTRL_MOLMOE_REFERENCE``) supplies the config
and tokenizer. Needs ~15 GB of disk and ~16 GiB of free memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from molmoe_common import (  # noqa: E402  (beside this script)
    GIB,
    ChildFailed,
    child_env,
    ctrl_measured,
    last_json,
    run_child,
    stage_reference_files,
    write_checkpoint,
)

DEFAULT_OUT = ROOT / "benchmarks" / ".cache" / "molmoe-1b-random-bf16"
SEED = 0


def reference_files() -> Path:
    """A directory with the released config.json, generation config, tokenizer and processor configs."""
    from molmoe_origin import reference_dir

    ref = reference_dir()
    if ref is None:
        sys.exit("the MolmoE reference (../shared/molmoe_reference or $CTRL_MOLMOE_REFERENCE) is needed")
    return stage_reference_files(ref, ROOT / "benchmarks" / ".cache" / "molmoe-1b-config")


def step_write(out: Path, results: dict) -> None:
    source = reference_files()
    config = json.loads((source / "config.json").read_text())
    written = write_checkpoint(out, config, source, seed=SEED)
    if written["reused"]:
        print(f"write: {out} is there")
        return
    results["write"] = {k: written[k] for k in ("seconds", "files", "bytes")}
    print(f"write: {len(written['files'])} shards, {written['bytes'] / 1e9:.2f} GB in {written['seconds']:.0f}s")


def load_measured(out: Path, dtype: str) -> dict:
    try:
        done = run_child([sys.executable, ROOT / "benchmarks" / "molmoe_common.py", "load", out, dtype],
                         env=child_env(), what=f"load {dtype}")
    except ChildFailed as exc:
        sys.exit(f"failed:\n{exc}")
    return last_json(done.output)


def step_load(out: Path, results: dict) -> None:
    first = load_measured(out, "bfloat16")
    second = load_measured(out, "bfloat16")  # the fingerprint is known now, the pages cached
    refused = load_measured(out, "float32")
    results["load"] = {"bfloat16_first": first, "bfloat16_again": second, "float32": refused}
    for label, r in (("first load", first), ("second load", second)):
        print(f"load ({label}): {r['seconds']:.1f}s, peak RSS {r['peak_rss_bytes'] / GIB:.2f} GiB "
              f"({r['rss_before_bytes'] / GIB:.2f} before), weights {r['weights_bytes'] / GIB:.2f} GiB")
    print(f"load float32: {refused.get('refused', refused)}")


KNOB_REQUESTS = [  # (label, max_crops, top_k, active blocks)
    ("crops 12, top-K 8, 16 blocks", 12, 8, 16),
    ("crops 1, top-K 8, 16 blocks", 1, 8, 16),
    ("crops 4, top-K 8, 16 blocks", 4, 8, 16),
    ("crops 4, top-K 2, 16 blocks", 4, 2, 16),
    ("crops 4, top-K 1, 16 blocks", 4, 1, 16),
    ("crops 4, top-K 8, 8 blocks", 4, 8, 8),
]


def step_knobs(out: Path, results: dict, max_new_tokens: int) -> None:
    import torch
    from PIL import Image

    from runtime.molmoe import MolmoERuntime
    from runtime.timing import GenerateTimer

    torch.set_num_threads(os.cpu_count() or 1)
    runtime = MolmoERuntime(out, dtype="bfloat16")
    image = Image.fromarray((torch.rand(1008, 1344, 3, generator=torch.Generator().manual_seed(1)) * 255)
                            .to(torch.uint8).numpy())
    question = "What is the dominant color of the object in the center of the picture?"
    timer = GenerateTimer(runtime)
    rows = []
    with timer:
        warm = runtime.preprocess(image, question, 1)
        runtime.generate(warm, max_new_tokens=2)
        for label, crops, top_k, blocks in KNOB_REQUESTS:
            inputs = runtime.preprocess(image, question, crops)
            with runtime.knobs(top_k=top_k, num_active_blocks=blocks):
                with timer.request() as marks:
                    result = runtime.generate(inputs, max_new_tokens=max_new_tokens)
            t = timer.resolve(marks)
            steps = sorted(t.decode_steps_ms)
            row = {"label": label, "max_crops": crops, "top_k": top_k, "num_active_blocks": blocks,
                   "num_crops": inputs.num_crops, "prompt_tokens": int(inputs.input_ids.shape[1]),
                   "output_tokens": len(result.token_ids), "total_ms": t.total_ms, "vision_ms": t.vision_ms,
                   "prefill_ms": t.prefill_ms, "decode_step_median_ms": steps[len(steps) // 2] if steps else None}
            rows.append(row)
            print(f"knobs: {label}: {row['prompt_tokens']} tokens, vision {t.vision_ms or 0:.0f} ms, prefill "
                  f"{t.prefill_ms:.0f} ms, decode step {row['decode_step_median_ms'] or 0:.0f} ms "
                  f"({len(result.token_ids)} tokens), total {t.total_ms / 1000:.1f}s", flush=True)
    results["knobs"] = {"threads": torch.get_num_threads(), "max_new_tokens": max_new_tokens, "requests": rows}


def ctrl_run(*args: str) -> dict:
    """``ctrl ARGS`` measured (molmoe_common.ctrl_measured); a failure ends the benchmark with its output."""
    try:
        measured = ctrl_measured(*args)
    except ChildFailed as exc:
        sys.exit(str(exc))
    measured.pop("output")
    return measured


def step_cli(out: Path, results: dict) -> None:
    from testbed.task import generate_dataset

    work = out.parent / "full-size-cli"
    shutil.rmtree(work, ignore_errors=True)
    dataset, ws = work / "dataset", work / "ws"
    generate_dataset(dataset, num_samples=2, seed=11)
    # the workspace's two samples come from a quick profile of the embedded model
    ctrl_run("profile", "--model", "embedded", "--dataset", str(dataset), "--configs", "2/8/16",
             "--max-new-tokens", "2", "--out", str(work / "embedded-profile"))
    ctrl_run("ingest", str(work / "embedded-profile"), "-w", str(ws))
    features = ctrl_run("extract-features", "--model", str(out), "--dtype", "bfloat16", "--images",
                        str(dataset / "images"), "-w", str(ws), "--batch-size", "2")
    print(f"cli: extract-features (2 samples): {features['seconds']:.0f}s, peak RSS "
          f"{features['peak_rss_bytes'] / GIB:.2f} GiB: {features['stdout'][-1]}")
    profile = ctrl_run("profile", "--model", str(out), "--dtype", "bfloat16", "--dataset", str(dataset),
                       "--num-samples", "1", "--configs", "2/8/16,2/1/8", "--max-new-tokens", "8",
                       "--out", str(work / "profile"))
    print(f"cli: profile (1 sample x 2 configurations): {profile['seconds']:.0f}s, peak RSS "
          f"{profile['peak_rss_bytes'] / GIB:.2f} GiB: {profile['stdout'][-1]}")
    records = []
    for file in sorted((work / "profile").rglob("exp6_latency_crops*_rank0.json")):
        doc = json.loads(file.read_text())
        for r in doc["per_sample_latencies"]:
            records.append({k: r.get(k) for k in ("max_crops", "top_k", "num_active_blocks", "T_total_ms",
                                                   "T_vision_ms", "T_prefill_ms", "T_decode_ms", "num_output_tokens")})
        block = doc["config"]["ctrl_profile"]
    results["cli"] = {"extract_features": features, "profile": profile, "profile_records": records,
                      "profile_dtype": block["dtype"], "profile_device": block["device"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory")
    parser.add_argument("--steps", default="write,load,knobs,cli")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if len(steps) > 1:  # each step in its own process: a model held by one must not crowd the next out
        for step in steps:
            subprocess.run([sys.executable, __file__, "--steps", step, "--out", str(args.out), "--max-new-tokens",
                            str(args.max_new_tokens)], check=True)
        return
    results_file = args.out.parent / "full_size_results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results["machine"] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                          "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
                          "python": platform.python_version()}
    for step in steps:
        started = time.perf_counter()
        if step == "write":
            step_write(args.out, results)
        elif step == "load":
            step_load(args.out, results)
        elif step == "knobs":
            step_knobs(args.out, results, args.max_new_tokens)
        elif step == "cli":
            step_cli(args.out, results)
        else:
            sys.exit(f"unknown step {step!r}")
        results.setdefault("step_seconds", {})[step] = time.perf_counter() - started
        results_file.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {results_file}")


if __name__ == "__main__":
    main()
