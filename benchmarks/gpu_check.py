"""MolmoE-1B on a GPU: one prepared check of every CUDA path of ctrl, every figure in one JSON.

    python benchmarks/gpu_check.py --prepare                    # here: stage .gpu_check/ (docs/gpu.md)
    python3 benchmarks/gpu_check.py --out "$OUT"                # on a CUDA machine (stops at 470 s)
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gpu-check   # the CPU dry run

Steps (``--steps``), each in processes of its own under a time limit; a step that fails (its
output's last lines go into the JSON) or is skipped (with the reason) does not stop the next, and
the exit code is 1 when any failed:

* ``install``: the staged wheels into a site directory the children import from; which modules
  import, and one line naming what is missing and which steps that skips;
* ``write``: the random-weight checkpoint with the released config (7.2 B parameters, 14.4 GB in
  bfloat16; drawn on the GPU) or, with ``--tiny``, the reference's tiny config;
* ``load``: a fresh process loads it in bfloat16 onto the device: time, the allocator's peak
  against the weights (target: at most 1.15x), the process's peak resident memory (target: at
  most 4 GiB), where the parameters are, the memory check's reading and refusal there, one
  generation;
* ``speed``: the fast path against the eager one on the checkpoint (``benchmarks/bench_speed.py``):
  per configuration of :data:`SPEED_CONFIGS`, vision, prefill, decode step, host time per step,
  the whole 8-token request, GPU memory: medians of :data:`SPEED_ROUNDS` fast-path rounds (the
  eager path's :data:`SPEED_EAGER_ROUNDS` for parity only); the knob table on the fast path (no
  higher setting faster beyond the rounds' spread, each knob's cost printed); the fast path's
  bfloat16 logits against the eager path's. It fails where a request generated fewer tokens than
  asked, a graph was captured during timed rounds, or a decode-step or ViT graph failed. Targets at
  the default knobs and 4 crops (about 600 prompt tokens), on a GPU at full size: :data:`SPEED_TARGETS`;
* ``parity``: bf16 on the device against the CPU path on the tiny real-layout checkpoint, by the
  rule of tests/test_molmoe_precision.py (logits of four requests, image features);
* ``profile``: ``ctrl profile`` of a generated testbed set, :data:`NUM_SAMPLES` samples x the
  four knob corners :data:`CONFIGS`, each request's hook-timed total compared with CUDA events
  (and the host clock) around the same request (disagreement above 10 % is flagged);
* ``ingest``, ``features``: ``ctrl ingest`` of that profile, ``ctrl extract-features`` on the device;
* ``train_offline``, ``train_online``: an offline run (the serving controller), then ``ctrl train
  --online`` from it for 2 steps with groups of 2 (hook-timed rollouts on the device);
* ``serve``: ``ctrl serve --device ...`` with the offline run, :data:`NUM_REQUESTS` requests through the
  openai client at two budgets; the latency scale it settles on; it must drain and exit 0 on SIGTERM;
* ``features_torchrun``: ``ctrl extract-features`` under torchrun with 2 ranks (nccl on CUDA, one
  GPU per rank: skipped with fewer than 2 GPUs; gloo on the CPU dry run).

``--out`` gets gpu_check.json (every figure, the machine, each step's status) and gpu_check.log
(every child's output). The working directory (``--work``) keeps the checkpoint and the installed
wheels between runs on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gpu_check_figures import AGREEMENT, EVENTS_PRELUDE, agreement, budget_summary, config_medians, median
from gpu_check_prepare import DEFAULT_STAGED, install_wheels, missing_line, prepare
from molmoe_common import (
    CTRL_SCRIPT,
    GIB,
    ROOT,
    ChildFailed,
    child_env,
    ctrl_measured,
    last_json,
    run_child,
    tail_lines,
)

#: the knob corners profiled (max_crops/top_k/num_active_blocks): the cheapest and the dearest at each crops end
CONFIGS = "2/4/12,2/8/16,10/4/12,10/8/16"
#: samples of the generated testbed set: enough for the offline run's train, validation and test splits
NUM_SAMPLES = 10
DATASET_SEED = 5
NUM_REQUESTS = 50
#: the load's targets: GPU memory at most this many times the weights, host memory at most this much
GPU_OVER_WEIGHTS_MAX = 1.15
HOST_PEAK_MAX_BYTES = 4 << 30
OFFLINE_RUN, ONLINE_RUN = "gpu-check-offline", "gpu-check-online"
#: the speed step's configurations (max_crops/top_k/blocks): the default knobs at 4 crops (the targets'),
#: each knob moved alone from there, and the profile's corners
SPEED_CONFIGS = "4/8/16,4/4/16,4/1/16,4/8/12,1/8/16,12/8/16,2/4/12,10/8/16"
SPEED_TARGET_CONFIG = (4, 8, 16)
#: the fast path's targets at SPEED_TARGET_CONFIG, full size, bfloat16, batch 1, 8 new tokens (ms)
SPEED_TARGETS = {"decode_step_ms": 3.0, "prefill_ms": 25.0, "vision_ms": 15.0, "total_ms": 80.0}
#: the speed step's timed rounds of the fast path (its medians) and of the eager one (parity only)
SPEED_ROUNDS, SPEED_EAGER_ROUNDS = 7, 1
SERVED_NAME = "gpu-check"


@dataclass(frozen=True)
class Step:
    name: str
    #: top-level modules the step's processes import beyond what every step needs (checked by running
    #: each command with one of them made unimportable)
    modules: tuple[str, ...]
    #: steps whose output it reads (it is skipped when one of them did not succeed)
    after: tuple[str, ...]
    #: time limits in seconds: on a GPU, and on the CPU dry run (a slow, shared 2-core machine)
    timeout_s: float
    timeout_cpu_s: float


SERVING = ("polars", "duckdb", "orjson", "fastapi", "uvicorn", "pydantic", "openai")
STEPS = (
    Step("install", (), (), 120, 120),
    Step("write", (), (), 240, 120),
    Step("load", (), ("write",), 150, 240),
    Step("speed", (), ("write",), 180, 400),
    Step("parity", (), (), 120, 300),
    Step("profile", (), ("write",), 180, 300),
    Step("ingest", ("duckdb", "orjson"), ("profile",), 60, 180),
    Step("features", ("polars", "duckdb", "orjson"), ("ingest",), 150, 240),
    Step("train_offline", ("polars", "duckdb", "orjson"), ("features",), 90, 240),
    Step("train_online", ("polars", "duckdb", "orjson"), ("train_offline",), 180, 300),
    Step("serve", SERVING, ("train_offline",), 240, 400),
    Step("features_torchrun", ("polars", "duckdb", "orjson"), ("features",), 180, 300),
)
#: modules every step imports (the GPU image has them; a missing one fails the steps that import it)
BASE_MODULES = ("torch", "transformers", "safetensors", "tokenizers", "PIL", "numpy", "pyarrow", "typer", "rich")


class Finding(Exception):
    """A step ran but what it measured misses a target or a rule; its figures are kept."""

    def __init__(self, message: str, figures: dict) -> None:
        super().__init__(message)
        self.figures = figures


class Skipped(Exception):
    pass


def speed_problems(figures: dict) -> list[str]:
    """What makes the speed step's figures not the fast path's speed, whatever the targets: fewer
    timed rounds than asked, a request that generated fewer tokens than asked, a CUDA graph captured
    during timed rounds, a decode-step, prefill or ViT graph capture that failed."""
    problems = []
    asked = figures["max_new_tokens"]
    for row in figures["rows"]:
        name = f"{row['max_crops']}/{row['top_k']}/{row['num_active_blocks']}"
        fast = row["fast"]
        if fast["rounds"] < SPEED_ROUNDS:
            problems.append(f"{name}: {fast['rounds']} timed rounds of the fast path, not {SPEED_ROUNDS}")
        short = [path for path in figures["paths"] if row[path]["tokens"] < asked]
        if short:
            problems.append(f"{name}: {', '.join(short)} generated fewer than {asked} tokens")
        if row.get("captures_in_timing"):
            problems.append(f"{name}: {row['captures_in_timing']} CUDA graph(s) captured during timed rounds")
    if figures.get("graph_error"):
        problems.append(f"CUDA graphs failed: {figures['graph_error']}")
    for what, key in (("the ViT's", "vision_graphs"), ("the prefill's", "prefill_graphs")):
        graphs = figures.get(key) or {}
        if graphs.get("error"):
            problems.append(f"{what} CUDA graphs failed: {graphs['error']}")
    return problems


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def result_line(output: str, prefix: str = "") -> str:
    """The last line of a command's output that starts with ``prefix`` (any non-blank line without one)."""
    return next((x for x in reversed(output.splitlines()) if x.strip() and x.startswith(prefix)), "")


def http_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.device, self.tiny = args.device, args.tiny
        self.staged, self.out = args.staged, args.out
        default_work = Path(tempfile.gettempdir()) / f"ctrl-gpu-check-{args.device}{'-tiny' if args.tiny else ''}"
        self.work = args.work or default_work
        self.site = self.work / "site"
        self.num_requests = args.num_requests
        self.draw_device = args.draw_device or ("cuda" if args.device == "cuda" else "cpu")
        self.model = self.work / ("tiny-bf16" if args.tiny else "molmoe-1b-random-bf16")
        self.dataset, self.ws = self.work / "dataset", self.work / "ws"
        self.started = time.monotonic()
        self.deadline_s = args.deadline_s or (470.0 if args.device == "cuda" else 1500.0)
        self.selected = [s for s in STEPS if args.steps is None or s.name in args.steps.split(",")]
        self.modules: dict[str, str | None] = {}
        self.fatal: str | None = None
        self.gpu_count = 0
        self.results: dict = {"check": "gpu_check", "device": self.device, "tiny": self.tiny,
                              "started": datetime.now(UTC).isoformat(timespec="seconds"),
                              "deadline_s": self.deadline_s, "work": str(self.work), "model": str(self.model),
                              "machine": self.machine(), "steps": {}}
        self.log_file = None  # opened by run()

    # -- plumbing
    def say(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.started:6.1f}s]"
        print(f"{stamp} {line}", flush=True)
        if self.log_file is not None:
            self.log_file.write(f"{stamp} {line}\n")
            self.log_file.flush()

    def record_output(self, what: str, output: str) -> None:
        if self.log_file is not None:
            self.log_file.write(f"----- {what} -----\n{output.rstrip()}\n----- end of {what} -----\n")
            self.log_file.flush()

    def env(self, **extra: str) -> dict[str, str]:
        sites = [self.site] if (self.site / ".stamp").is_file() else []
        return child_env(sites, CTRL_CACHE_DIR=str(self.work / "cache"), **extra)

    def child(self, name: str, args: dict, timeout: float) -> dict:
        try:
            done = run_child([sys.executable, ROOT / "benchmarks" / "gpu_check_child.py", name, json.dumps(args)],
                             env=self.env(), timeout=timeout, what=name)
        except ChildFailed as exc:
            self.record_output(name, exc.output)
            raise
        self.record_output(name, done.output)
        return last_json(done.output)

    def ctrl(self, *args: str, timeout: float, **extra_env: str) -> dict:
        try:
            measured = ctrl_measured(*args, env=self.env(**extra_env), timeout=timeout, peak_dir=self.work)
        except ChildFailed as exc:
            self.record_output(f"ctrl {args[0]}", exc.output)
            raise
        self.record_output(f"ctrl {' '.join(args[:2])}", measured["output"])
        return measured  # its "output" is dropped from the JSON (run_step)

    def left_s(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)

    def machine(self) -> dict:
        info = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "python": platform.python_version(),
                "platform": platform.platform(), "cpus": os.cpu_count(),
                "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)}
        if shutil.which("nvidia-smi"):
            query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            info["nvidia_smi"] = query.stdout.strip().splitlines()
        return info

    def write_json(self) -> Path:
        self.results["seconds"] = time.monotonic() - self.started
        path = self.out / "gpu_check.json"
        path.write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        return path

    # -- the run
    def run(self) -> int:
        if self.work.exists():  # the checkpoint, the wheels and the fingerprint cache are kept
            for name in ("dataset", "profile", "ws", "events.jsonl", "serve.log"):
                path = self.work / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = (self.out / "gpu_check.log").open("w")
        self.say(f"gpu_check on {self.device}{' (tiny checkpoint)' if self.tiny else ''}: work {self.work}, "
                 f"out {self.out}, deadline {self.deadline_s:.0f}s")
        for step in self.selected:
            self.run_step(step)
            self.write_json()
        steps = self.results["steps"]
        summary = {status: [n for n, r in steps.items() if r["status"] == status] for status in
                   ("ok", "failed", "skipped")}
        self.results["summary"] = summary
        self.results["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
        path = self.write_json()
        self.say(f"gpu_check: {len(summary['ok'])} ok, {len(summary['failed'])} failed "
                 f"({', '.join(summary['failed']) or '-'}), {len(summary['skipped'])} skipped "
                 f"({', '.join(summary['skipped']) or '-'}); {path}")
        self.log_file.close()
        return 1 if summary["failed"] else 0

    def blocked(self, step: Step) -> str | None:
        if self.fatal:
            return self.fatal
        for name in step.after:
            status = self.results["steps"].get(name, {}).get("status")
            if status not in (None, "ok"):
                return f"needs step {name}, which {'failed' if status == 'failed' else 'was skipped'}"
        if step.name != "install" and self.modules:
            missing = [m for m in (*BASE_MODULES, *step.modules) if self.modules.get(m)]
            if missing:
                return f"cannot import {', '.join(missing)} ({self.modules[missing[0]]})"
        return None

    def run_step(self, step: Step) -> None:
        started = time.monotonic()
        record: dict = {}
        reason = self.blocked(step)
        limit = min(step.timeout_s if self.device == "cuda" else step.timeout_cpu_s, self.left_s() - 5)
        if reason is None and limit < 15:
            reason = f"out of time: {max(0.0, self.left_s()):.0f}s of the {self.deadline_s:.0f}s deadline left"
        if reason is not None:
            record = {"status": "skipped", "reason": reason}
        else:
            try:
                record = {"status": "ok", **getattr(self, f"step_{step.name}")(limit)}
            except Skipped as exc:
                record = {"status": "skipped", "reason": str(exc)}
            except Finding as exc:
                record = {"status": "failed", "error": str(exc), **exc.figures}
            except ChildFailed as exc:
                record = {"status": "failed", "error": str(exc), "timed_out": exc.timed_out}
            except Exception as exc:  # a bug of this script or an unexpected output: the next step still runs
                record = {"status": "failed",
                          "error": f"{type(exc).__name__}: {exc}\n{tail_lines(traceback.format_exc())}"}
        record.pop("output", None)  # in the log already
        record["seconds"] = round(time.monotonic() - started, 2)
        record["timeout_s"] = round(limit, 1)
        self.results["steps"][step.name] = record
        detail = record.get("summary") or record.get("reason") or record.get("error", "").splitlines()[0:1]
        self.say(f"{step.name}: {record['status']} in {record['seconds']:.1f}s"
                 + (f": {detail if isinstance(detail, str) else ' '.join(detail)}" if detail else ""))

    # -- the steps: each returns its figures (a "summary" line among them)
    def step_install(self, limit: float) -> dict:
        deadline = time.monotonic() + limit
        try:
            installed, failure = install_wheels(self.staged, self.site, self.work, timeout=limit), None
        except (OSError, subprocess.SubprocessError, tarfile.TarError) as exc:  # the imports still tell what is there
            installed = {"installed": [], "reused": False}
            failure = f"the wheels did not install: {type(exc).__name__}: {exc}" + (
                f"\n{tail_lines(exc.stderr)}" if getattr(exc, "stderr", None) else "")
        needed_by: dict[str, list[str]] = {}
        for step in STEPS:
            for module in (*BASE_MODULES, *step.modules):
                needed_by.setdefault(module, []).append(step.name)
        imports = self.child("imports", {"modules": sorted(needed_by)}, timeout=max(5.0, deadline - time.monotonic()))
        self.modules = imports.pop("errors")
        self.gpu_count = imports.get("gpu_count", 0)
        self.results["machine"].update(imports)
        missing = {m: e for m, e in self.modules.items() if e}
        line = missing_line(missing, needed_by, self.staged, [s.name for s in STEPS])
        if line:
            self.say(line)
        wheels = installed["installed"]
        summary = (f"{len(wheels)} wheels {'already ' if installed['reused'] else ''}installed" if wheels
                   else "no wheels installed") + ("; " + line if line else "; every module imports")
        figures = {"summary": summary, "wheels": wheels, "wheels_reused": installed["reused"], "imports": self.modules,
                   "missing_line": line or None}
        if self.device == "cuda" and not imports["cuda_available"]:
            self.fatal = "CUDA is not available here"
            raise Finding(self.fatal, figures)
        if failure:
            raise Finding(failure, figures)
        return figures

    def step_write(self, limit: float) -> dict:
        config = self.staged / ("tiny" if self.tiny else "molmoe") / "config.json"
        figures = self.child("write", {"config": str(config), "source": str(self.staged / "molmoe"),
                                       "out": str(self.model), "draw_device": self.draw_device}, timeout=limit)
        figures["summary"] = (f"{len(figures['files'])} files, {figures['bytes'] / 1e9:.2f} GB "
                              + ("(there already)" if figures["reused"] else
                                 f"in {figures['seconds']:.0f}s, drawn on {self.draw_device}"))
        return figures

    def step_load(self, limit: float) -> dict:
        figures = self.child("load", {"checkpoint": str(self.model), "device": self.device}, timeout=limit)
        cuda = self.device == "cuda"
        weights = figures["weights_bytes"]
        gpu_ratio = figures["gpu_peak_allocated_bytes"] / weights if cuda else None
        applies = cuda and not self.tiny
        figures["targets"] = {
            "gpu_peak_over_weights": {"value": gpu_ratio, "max": GPU_OVER_WEIGHTS_MAX, "applies": applies},
            "host_peak_rss_bytes": {"value": figures["peak_rss_bytes"], "max": HOST_PEAK_MAX_BYTES, "applies": applies}}
        problems = []
        if figures["param_devices"] != [self.device] or figures["param_dtypes"] != ["bfloat16"]:
            problems.append(f"parameters on {figures['param_devices']} in {figures['param_dtypes']}")
        if applies and gpu_ratio > GPU_OVER_WEIGHTS_MAX:
            problems.append(f"GPU peak {gpu_ratio:.2f}x the weights (target {GPU_OVER_WEIGHTS_MAX}x)")
        if applies and figures["peak_rss_bytes"] > HOST_PEAK_MAX_BYTES:
            problems.append(f"host peak {figures['peak_rss_bytes'] / GIB:.2f} GiB (target 4 GiB)")
        if figures["memory_check_refusal"] is None:
            problems.append("the memory check did not refuse twice the free memory")
        figures["summary"] = (f"{figures['seconds']:.1f}s, weights {weights / GIB:.2f} GiB, "
                              + (f"GPU peak {gpu_ratio:.3f}x the weights, " if cuda else "")
                              + f"host peak {figures['peak_rss_bytes'] / GIB:.2f} GiB; generate "
                              f"{figures['generate']['total_ms']:.0f} ms for {figures['generate']['tokens']} tokens")
        if problems:
            raise Finding("; ".join(problems), figures)
        return figures

    def step_speed(self, limit: float) -> dict:
        figures = self.child("speed", {"checkpoint": str(self.model), "device": self.device,
                                       "configs": SPEED_CONFIGS, "rounds": SPEED_ROUNDS,
                                       "eager_rounds": SPEED_EAGER_ROUNDS}, timeout=limit)
        row = next(r for r in figures["rows"]
                   if (r["max_crops"], r["top_k"], r["num_active_blocks"]) == SPEED_TARGET_CONFIG)
        applies = self.device == "cuda" and not self.tiny
        figures["targets"] = {name: {"value": row["fast"][name], "max": limit_ms, "applies": applies}
                              for name, limit_ms in SPEED_TARGETS.items()}
        problems = [f"{name} {t['value']:.1f} ms (target {t['max']:g})" for name, t in figures["targets"].items()
                    if t["applies"] and (t["value"] is None or t["value"] > t["max"])]
        costs = figures["knob_costs"]["fast"]
        if applies and costs["violations"]:  # a tiny model's differences are within a shared CPU's noise
            problems.append("on the fast path a higher knob setting is faster: " + "; ".join(costs["violations"]))
        problems += speed_problems(figures)
        self.record_output("the fast path's knob table (median totals)", "\n".join(
            f"{e['knob']} {e['low']} -> {e['high']}: {e['low_ms']:.1f} -> {e['high_ms']:.1f} ms "
            f"({e['cost_ms']:+.1f}, tolerance {e['tolerance_ms']:.1f})" for e in costs["table"]))
        fast, eager = row["fast"], row["eager"]
        figures["summary"] = (f"{SPEED_TARGET_CONFIG[0]}/{SPEED_TARGET_CONFIG[1]}/{SPEED_TARGET_CONFIG[2]} "
                              f"({row['prompt_tokens']} tokens): preprocess {row['preprocess_ms']:.1f} ms, fast "
                              f"{fast['total_ms']:.1f} ms (eager "
                              f"{eager['total_ms']:.1f}), vision {fast['vision_ms'] or 0:.1f}, prefill "
                              f"{fast['prefill_ms']:.1f}, step {fast['decode_step_ms'] or 0:.2f} ms; "
                              f"{figures['graphs']} graphs; knob table "
                              + ("ok" if not costs["violations"] else f"{len(costs['violations'])} violations"))
        if problems:
            raise Finding("; ".join(problems), figures)
        return figures

    def step_parity(self, limit: float) -> dict:
        figures = self.child("parity", {"config": str(self.staged / "tiny" / "config.json"),
                                        "source": str(self.staged / "molmoe"), "device": self.device,
                                        "checkpoint": str(self.work / "parity-bf16")}, timeout=limit)
        worst = max(figures["cases"], key=lambda c: c["our_mean"] / max(c["their_mean"], 1e-30))
        figures["summary"] = (f"{len(figures['cases'])} comparisons, the rule "
                              f"{'holds' if figures['holds'] else 'BREAKS'}; worst mean error "
                              f"{worst['our_mean'] / max(worst['their_mean'], 1e-30):.2f}x the CPU's ({worst['case']})")
        if not figures["holds"]:
            raise Finding("; ".join(figures["broken"]), figures)
        return figures

    def step_profile(self, limit: float) -> dict:
        deadline = time.monotonic() + limit
        self.ctrl("testbed", "generate", str(self.dataset), "--num-samples", str(NUM_SAMPLES), "--seed",
                  str(DATASET_SEED), "--split", "train", "--overwrite", timeout=limit)
        events = self.work / "events.jsonl"
        events.unlink(missing_ok=True)
        run = self.ctrl("profile", "--model", str(self.model), "--dataset", str(self.dataset), "--configs", CONFIGS,
                        "--num-samples", str(NUM_SAMPLES), "--max-new-tokens", "8", "--device", self.device,
                        "--dtype", "bfloat16", "--out", str(self.work / "profile"),
                        timeout=deadline - time.monotonic(), CTRL_PRELUDE=EVENTS_PRELUDE,
                        GPU_CHECK_EVENTS=str(events))
        timed = [json.loads(line) for line in events.read_text().splitlines()]
        records, blocks = [], []
        for file in sorted((self.work / "profile").rglob("exp6_latency_crops*_rank0.json")):
            doc = json.loads(file.read_text())
            blocks.append(doc["config"]["ctrl_profile"])
            records += doc["per_sample_latencies"]
        files_totals = sorted(round(r["T_total_ms"], 6) for r in records)
        compared = agreement(timed)
        configs = config_medians(records)
        figures = {"seconds_ctrl": run["seconds"], "peak_rss_bytes": run["peak_rss_bytes"], "stdout": run["stdout"],
                   "configs": configs, "agreement": compared, "timed_requests": timed,
                   "events_match_files": sorted(round(t["hook_total_ms"], 6) for t in timed) == files_totals,
                   "recorded_device": sorted({b["device"] for b in blocks}),
                   "recorded_dtype": sorted({b["dtype"] for b in blocks})}
        self.results["budgets_ms"] = [round(1.5 * min(c["total_ms_median"] for c in configs.values()), 1),
                                      round(1.5 * max(c["total_ms_median"] for c in configs.values()), 1)]
        ratio = compared["hook_over_event_median"] or compared["hook_over_wall_median"]
        figures["summary"] = (f"{len(records)} requests ({NUM_SAMPLES} samples x {len(configs)} configurations); "
                              f"hook/{compared['compared_with']} median {ratio:.3f}, "
                              f"{len(compared['flagged'])} over {AGREEMENT:.0%}; totals "
                              f"{min(c['total_ms_median'] for c in configs.values()):.0f}-"
                              f"{max(c['total_ms_median'] for c in configs.values()):.0f} ms")
        problems = []
        if len(timed) != len(records) or not figures["events_match_files"]:
            problems.append(f"{len(timed)} timed requests, {len(records)} records in the files, totals "
                            f"{'equal' if figures['events_match_files'] else 'differ'}")
        if figures["recorded_device"] != [self.device] or figures["recorded_dtype"] != ["bfloat16"]:
            problems.append(f"recorded as {figures['recorded_device']} {figures['recorded_dtype']}")
        if self.device == "cuda" and not compared["agree"]:  # the host clock of a shared CPU is only reported
            problems.append(f"hook and CUDA-event totals disagree by more than {AGREEMENT:.0%} on "
                            f"{len(compared['flagged'])} of {len(timed)} requests")
        if problems:
            raise Finding("; ".join(problems), figures)
        return figures

    def step_ingest(self, limit: float) -> dict:
        run = self.ctrl("ingest", str(self.work / "profile"), "-w", str(self.ws), timeout=limit)
        return {**run, "summary": result_line(run["output"])}

    def features_args(self) -> list[str]:
        return ["--model", str(self.model), "--device", self.device, "--dtype", "bfloat16", "--images",
                str(self.dataset / "images"), "-w", str(self.ws), "--batch-size", "4"]

    def step_features(self, limit: float) -> dict:
        run = self.ctrl("extract-features", *self.features_args(), timeout=limit)
        return {**run, "summary": result_line(run["output"], "features for")}

    def step_features_torchrun(self, limit: float) -> dict:
        if self.device == "cuda" and self.gpu_count < 2:
            msg = f"nccl runs one rank per GPU and this machine has {self.gpu_count}: 2 ranks need 2 GPUs"
            raise Skipped(msg)
        done = run_child([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                          "--nproc-per-node", "2", "-m", "cli", "extract-features", *self.features_args(), "--force"],
                         env=self.env(OMP_NUM_THREADS="1"), timeout=limit, what="torchrun extract-features")
        self.record_output("torchrun extract-features", done.output)
        line = result_line(done.output, "features for")
        return {"seconds_ctrl": done.seconds, "ranks": 2, "backend": "nccl" if self.device == "cuda" else "gloo",
                "summary": line, "stdout": [line]}

    def step_train_offline(self, limit: float) -> dict:
        run = self.ctrl("train", "--offline", "-w", str(self.ws), "--num-epochs", "1", "--cross-fit-folds", "0",
                        "--run-id", OFFLINE_RUN, timeout=limit)
        config = json.loads((self.ws / "runs" / OFFLINE_RUN / "config.json").read_text())
        return {**run, "budget_range_ms": [config.get("budget_min_ms"), config.get("budget_max_ms")],
                "summary": result_line(run["output"], "run ")}

    def step_train_online(self, limit: float) -> dict:
        import pyarrow.parquet as pq

        run = self.ctrl("train", "--online", "--from", OFFLINE_RUN, "--model", str(self.model), "--images",
                        str(self.dataset / "images"), "-w", str(self.ws), "--steps", "2", "--samples-per-step", "1",
                        "--group-size", "2", "--max-new-tokens", "4", "--no-evaluate", "--calibration-samples", "2",
                        "--check-every", "2", "--check-samples", "2", "--check-budgets", "1", "--device", self.device,
                        "--dtype", "bfloat16", "--run-id", ONLINE_RUN, timeout=limit)
        run_dir = self.ws / "runs" / ONLINE_RUN
        config = json.loads((run_dir / "config.json").read_text())
        steps = pq.read_table(run_dir / "online_steps.parquet").to_pylist()
        rollouts = [row for f in sorted((run_dir / "rollouts").glob("step-*.parquet"))
                    for row in pq.read_table(f).to_pylist()]
        latency_columns = sorted({k for r in rollouts for k, v in r.items()
                                  if k.startswith("latency_") and isinstance(v, (int, float))})
        figures = {**run, "budget_range_ms": [config.get("budget_min_ms"), config.get("budget_max_ms")],
                   "device": config.get("device"), "dtype": config.get("dtype"), "steps": steps,
                   "rollouts": len(rollouts),
                   "rollout_latency_ms_median": {c: median([r[c] for r in rollouts]) for c in latency_columns}}
        total = figures["rollout_latency_ms_median"].get("latency_total_ms")
        figures["summary"] = (f"{len(steps)} steps, {len(rollouts)} rollouts, median rollout "
                              f"{total if total is None else round(total, 1)} ms, budget range "
                              f"{figures['budget_range_ms'][0]:.1f}-{figures['budget_range_ms'][1]:.1f} ms")
        if len(steps) != 2 or not rollouts or not total or total <= 0:
            msg = (f"{len(steps)} steps and {len(rollouts)} rollouts recorded (2 steps expected, rollouts with a "
                   "positive latency)")
            raise Finding(msg, figures)
        return figures

    def step_serve(self, limit: float) -> dict:
        deadline = time.monotonic() + limit
        port = free_port()
        peak_file = self.work / "serve.peak"
        log_path = self.work / "serve.log"
        args = ["serve", "--model", str(self.model), "--controller", OFFLINE_RUN, "-w", str(self.ws), "--device",
                self.device, "--dtype", "bfloat16", "--port", str(port), "--local-images", str(self.dataset / "images"),
                "--served-model-name", SERVED_NAME, "--default-max-tokens", "8"]
        with log_path.open("w") as log:
            server = subprocess.Popen([sys.executable, "-c", CTRL_SCRIPT, *args], stdout=log, stderr=subprocess.STDOUT,
                                      env=self.env(PEAK_FILE=str(peak_file)), cwd=ROOT, start_new_session=True)
        figures: dict = {"port": port}
        try:
            up = time.monotonic()
            while True:
                if server.poll() is not None:
                    msg = (f"ctrl serve exited with {server.returncode} before answering\n"
                           f"{tail_lines(log_path.read_text())}")
                    raise RuntimeError(msg)
                if time.monotonic() > deadline - 30:
                    raise RuntimeError("ctrl serve did not answer /health in time\n" + tail_lines(log_path.read_text()))
                try:
                    if http_json(f"http://127.0.0.1:{port}/health", timeout=5)["status"] == "ok":
                        break
                except OSError:
                    time.sleep(0.5)
            figures["startup_s"] = time.monotonic() - up
            before = http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["ctrl"]
            budgets = self.results.get("budgets_ms") or [before["default_budget_ms"] / 2, before["default_budget_ms"]]
            client = self.child("client", {"port": port, "model": SERVED_NAME, "dataset": str(self.dataset),
                                           "num_requests": self.num_requests, "budgets_ms": budgets},
                                timeout=max(5.0, deadline - time.monotonic() - 20))
            after = http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["ctrl"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                metrics = [x for x in reply.read().decode().splitlines() if x.startswith(("ctrl_latency_scale",
                                                                                             "ctrl_budget_total"))]
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                figures["exit_code_on_sigterm"] = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                figures["exit_code_on_sigterm"] = None
            self.record_output("ctrl serve", log_path.read_text())
        rows = client["requests"]
        scales = [r["latency_scale"] for r in rows]
        figures.update({"budgets_ms": budgets, "requests": len(rows), "per_budget": budget_summary(rows),
                        "latency_scale": {"settled": after.get("latency_scale"),
                                          "source": after.get("latency_scale_source"),
                                          "at_start": before.get("latency_scale"), "first_request": scales[0],
                                          "last_request": scales[-1]},
                        "controller": after.get("controller_run"), "default_budget_ms": after.get("default_budget_ms"),
                        "budget_margins": after.get("budget_margins"),
                        "overhead_reserve_ms": after.get("overhead_reserve_ms"),
                        "metrics": metrics, "warmup": [x for x in log_path.read_text().splitlines() if "warm-up" in x],
                        "peak_rss_bytes": int(peak_file.read_text()) if peak_file.is_file() else None,
                        "request_rows": rows})
        met = {b: s["met_share"] for b, s in figures["per_budget"].items()}
        figures["summary"] = (f"{len(rows)} requests at {', '.join(f'{b} ms (met {m:.0%})' for b, m in met.items())}"
                              f"; latency scale settled at {after.get('latency_scale') or 0:.3f} "
                              f"({after.get('latency_scale_source')}); exit code {figures['exit_code_on_sigterm']} on "
                              "SIGTERM")
        if len(rows) != self.num_requests or figures["exit_code_on_sigterm"] != 0:
            msg = (f"{len(rows)} of {self.num_requests} requests answered; exit code "
                   f"{figures['exit_code_on_sigterm']} on SIGTERM (0 expected)")
            raise Finding(msg, figures)
        return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", nargs="?", type=Path, const=DEFAULT_STAGED, metavar="DIR",
                        help="stage what the GPU machine lacks into DIR (default .gpu_check) and exit")
    parser.add_argument("--no-wheels", action="store_true", help="--prepare: stage no wheels")
    parser.add_argument("--exclude", default="", help="--prepare: wheels to leave out, comma-separated")
    parser.add_argument("--tiny-from", type=Path, help="--prepare: copy the tiny config of this tiny checkpoint "
                        "instead of building one with the reference's builder")
    parser.add_argument("--staged", type=Path, default=DEFAULT_STAGED, help="the prepared folder (default .gpu_check)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint instead of the full-size one")
    parser.add_argument("--out", type=Path, help="where gpu_check.json and gpu_check.log go")
    parser.add_argument("--work", type=Path, help="working directory (default: $TMPDIR/ctrl-gpu-check-DEVICE)")
    parser.add_argument("--steps", help=f"comma-separated subset of: {','.join(s.name for s in STEPS)}")
    parser.add_argument("--deadline-s", type=float, help="the whole check's time (default 470 on cuda, 1500 on cpu)")
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--draw-device", choices=("cuda", "cpu"), help="where the random weights are drawn "
                        "(default: the device)")
    args = parser.parse_args()
    if args.prepare is not None:
        sys.path.insert(0, str(ROOT / "tests"))
        from molmoe_origin import reference_dir

        manifest = prepare(args.prepare, reference=reference_dir(), tiny_from=args.tiny_from,
                           wheels=not args.no_wheels, exclude=[x for x in args.exclude.split(",") if x])
        print(f"staged {len(manifest['files'])} files in {args.prepare} ({len(manifest['wheels'])} wheels)")
        travel = manifest.get("travel")
        if travel:
            print(travel["line"])
            if not travel["fits"]:
                print("Hint: leave wheels out with --exclude NAME,... (the steps that import them are then skipped)")
                return 1
        return 0
    if args.out is None:
        parser.error("--out is required (or --prepare)")
    unknown = set((args.steps or "").split(",")) - {s.name for s in STEPS} - {""}
    if unknown:
        parser.error(f"unknown steps: {', '.join(sorted(unknown))}")
    if not (args.staged / "molmoe" / "config.json").is_file() or not (args.staged / "tiny" / "config.json").is_file():
        print(f"gpu_check: {args.staged} holds no staged configs: run `python benchmarks/gpu_check.py --prepare` "
              "where the MolmoE reference is, and carry the folder (docs/gpu.md)", file=sys.stderr)
        return 2
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
