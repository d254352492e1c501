"""``ctrl profile``: measure a model's knob sweep and write it as exp5 / exp6 result trees.

The origin's profiling scripts (``origin_formats.md`` §4.2, §4.3) are the format this writes,
so ``ctrl ingest <out>`` reads the result like any other run; the measurement is the fixed one
(§9, §10):

* **one generation per (sample, configuration)**, greedy, batch size 1, KV cache on,
  ``runtime.generate`` under ``runtime.knobs(top_k=K, num_active_blocks=B)``: top-K on every
  decoder layer, blocks by the runtime's importance rule (``runtime.blocks_for``), crops
  through the runtime's preprocessor. exp5 (accuracy) and exp6 (latency + accuracy) are
  written from the **same** generations: with batch size 1 a separate exp5 pass would only
  repeat them (the origin's exp5 differed by batch padding and a 16-token cap, §4.4).
* **hook timing inside that one generate call** (:class:`GenerateTimer`): the vision module's
  own interval; the prefill = block 0's entry to the last active block's exit on the *first*
  forward pass only (D1, D2); each of the N-1 decode steps = block 0's entry on that pass to
  block 0's entry on the next pass (the last one: to the end of generate), so a step covers
  its blocks, the final norm, the LM head, the token choice and the next token's embedding
  (D3); ``T_total_ms`` is measured around the whole generate call. Nothing is a difference of
  two other figures; ``T_embed_ms`` (request start -> block 0, vision included),
  ``T_prefill_ms``, ``T_prefill_head_ms`` (last block's exit -> first decode step) and
  ``T_decode_ms`` partition ``T_total_ms``. Image loading and preprocessing are outside, as in
  exp6. ``warmup`` unmeasured generations run before each configuration's first measured one
  (per rank). On CPU, ``threads`` (default 1) torch threads run each request: with more threads
  than free cores, spinning OpenMP threads made requests up to 10-20x slower and the
  latencies mostly noise on a shared 2-core machine.
* **stable sample identity**: every per-sample record of both experiments (exp6's
  ``per_sample_latencies`` included) carries the full metadata (example_id, image_id,
  question, answers, family), the global dataset index (``sample_id`` = ``dataset_index``),
  the rank and the configuration (D8).
* **token counts** (D10): ``num_vision_tokens`` = image feature positions,
  ``num_language_tokens`` = the rest of the prompt (text only), ``num_total_tokens`` = the
  prompt length (their sum).
* **ranks** (D5, D6): rank r of W takes dataset indices r, r+W, ... of the first
  ``num_samples`` (no padding) and writes its own ``..._rank{r}.json`` files. ``world_size``
  W ranks are simulated in this process, one after the other; under ``torchrun`` every
  process is one rank (W = its world size) and runs all configurations for its rank. Then a
  deterministic merge *from the files* (records sorted by dataset index; rank 0, after a
  barrier) writes the merged per-config files and the final aggregates.
* **resume**: a configuration whose merged exp5 and exp6 files are complete (same model,
  samples, max_new_tokens and device) is skipped; a complete rank file is not re-measured.
* **marker**: every file's ``config`` holds ``ctrl_profile_version`` and a ``ctrl_profile``
  block (model fingerprint, sample-set hash, ...). ``pipeline.parse`` reads files with the
  marker as measured correctly: ``T_prefill_ms`` is a prefill time (no D1 flag), the token
  counts are not re-derived (no D10 flag), ``T_vision_ms`` and ``num_crops`` are kept.

Layout under ``out_dir``, per dataset (``<name>`` = the dataset name with ``_`` -> ``-``, the
origin's directory naming)::

    exp5_accuracy_<name>/exp5_accuracy_results_crops{C}_topk{K}_blocks{B}_rank{r}.json  every rank
    exp5_accuracy_<name>/exp5_accuracy_results_crops{C}_topk{K}_blocks{B}.json          merged (config.note)
    exp5_accuracy_<name>/exp5_accuracy_results.json                                      final aggregate
    exp6_latency_<name>/exp6_latency_crops{C}_topk{K}_blocks{B}_rank{r}.json            every rank
    exp6_latency_<name>/exp6_latency_crops{C}_topk{K}_blocks{B}.json                    merged (config.note)
    exp6_latency_<name>/exp6_latency_results.json                                        final aggregate
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from online.distributed import init_distributed_from_env
from online.timing import HookTimer, cpu_threads
from pipeline.errors import CtrlError, KnobError
from pipeline.workspace import write_bytes_atomic

__all__ = [
    "EXP6_MAX_CROPS", "EXP6_NUM_ACTIVE_BLOCKS", "EXP6_TOP_K", "PROFILE_VERSION", "GenerateTimer", "ProfileConfig",
    "ProfileReport", "parse_configs", "profile_model", "rank_indices",
]

#: written as ``config.ctrl_profile_version``; pipeline.parse trusts the latencies of files carrying it
PROFILE_VERSION = 1
#: exp6 run() defaults (§4.3); ``balanced`` picks first / middle / last of each (27 configurations)
EXP6_MAX_CROPS: tuple[int, ...] = (2, 4, 6, 8, 10)
EXP6_TOP_K: tuple[int, ...] = (4, 8, 12)
EXP6_NUM_ACTIVE_BLOCKS: tuple[int, ...] = (12, 13, 14, 15, 16)
MERGE_NOTE = "Merged results from all ranks"
#: a run's identity (the start of every file's ``ctrl_profile`` block; the rest is per rank)
IDENTITY_KEYS = ("model", "model_kind", "model_fingerprint", "dataset_dir", "num_samples", "samples_sha256",
                 "max_new_tokens", "device")

Config = tuple[int, int, int]
_CONFIG_ITEM = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*$")


# ----------------------------------------------------------------------------- configuration


def parse_configs(spec: str | Sequence[Config]) -> tuple[list[Config], str]:
    """The configurations of ``--configs`` and the strategy name written into the files.

    ``balanced`` (default): the origin's balanced strategy over the exp6 defaults,
    {2,6,10} x {4,8,12} x {12,14,16}; ``full``: all 75 combinations of the defaults;
    otherwise an explicit list ``C/K/B,C/K/B`` (max_crops / top_k / num_active_blocks).
    """
    from pipeline.synthetic import balanced_combinations

    if not isinstance(spec, str):
        items = [tuple(int(v) for v in c) for c in spec]
        if not items or any(len(c) != 3 for c in items):
            raise CtrlError(f"configs must be (max_crops, top_k, num_active_blocks) triples, got {spec!r}")
        return list(dict.fromkeys(items)), "custom"  # type: ignore[arg-type]
    text = spec.strip()
    if text.lower() == "balanced":
        return balanced_combinations(EXP6_MAX_CROPS, EXP6_TOP_K, EXP6_NUM_ACTIVE_BLOCKS), "balanced"
    if text.lower() == "full":
        return [(c, k, b) for c in EXP6_MAX_CROPS for k in EXP6_TOP_K for b in EXP6_NUM_ACTIVE_BLOCKS], "full"
    configs: list[Config] = []
    for item in text.split(","):
        m = _CONFIG_ITEM.match(item)
        if m is None:
            raise CtrlError(f"--configs: bad entry {item.strip()!r} in {spec!r}: expected C/K/B "
                            "(max_crops/top_k/num_active_blocks), e.g. 2/4/12,6/8/16, or 'balanced' or 'full'")
        c, k, b = (int(g) for g in m.groups())
        if min(c, k, b) < 1:
            raise CtrlError(f"--configs: {item.strip()!r}: every value must be >= 1")
        configs.append((c, k, b))
    return list(dict.fromkeys(configs)), "custom"


@dataclass
class ProfileConfig:
    """What ``ctrl profile`` runs (see the module docstring)."""

    datasets: Sequence[Path]
    model: str = "embedded"
    configs: str | Sequence[Config] = "balanced"
    num_samples: int | None = None
    world_size: int = 1
    out_dir: Path = Path("results/profile")
    max_new_tokens: int = 16
    device: str = "cpu"
    warmup: int = 1
    #: torch intra-op threads while profiling on CPU (0 = leave torch's setting). 1 by default:
    #: on a shared CPU, several spinning threads per op make single requests up to 10x slower and noisy
    threads: int = 1
    #: filled by __post_init__ from ``configs``
    combinations: list[Config] = field(default_factory=list, init=False)
    strategy: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if not self.datasets:
            raise CtrlError("give at least one --dataset DIR (a directory with dataset.json and images/)")
        self.datasets = tuple(Path(d).expanduser() for d in self.datasets)
        for d in self.datasets:
            if not d.is_dir():
                raise CtrlError(f"--dataset {d}: no such directory (a dataset directory holds dataset.json and images/)")
        if self.num_samples is not None and self.num_samples < 1:
            raise CtrlError(f"--num-samples must be >= 1, got {self.num_samples}")
        if self.world_size < 1:
            raise CtrlError(f"--world-size must be >= 1, got {self.world_size}")
        if self.max_new_tokens < 1:
            raise CtrlError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.warmup < 0:
            raise CtrlError(f"--warmup must be >= 0, got {self.warmup}")
        if self.threads < 0:
            raise CtrlError(f"--threads must be >= 0, got {self.threads}")
        self.out_dir = Path(self.out_dir).expanduser()
        self.combinations, self.strategy = parse_configs(self.configs)


@dataclass
class DatasetReport:
    name: str
    num_samples: int
    exp5_dir: Path
    exp6_dir: Path
    measured_configs: list[Config] = field(default_factory=list)
    skipped_configs: list[Config] = field(default_factory=list)
    accuracy: dict[Config, float] = field(default_factory=dict)
    latency_total_ms_p50: dict[Config, float] = field(default_factory=dict)


@dataclass
class ProfileReport:
    out_dir: Path
    model_fingerprint: str
    datasets: list[DatasetReport]
    #: (sample, configuration) generations measured in this call (resumed ones not counted)
    measured: int = 0
    #: seconds spent in measured generations (warm-up, preprocessing and writing included)
    measure_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def per_minute(self) -> float:
        """Profiling throughput: configurations x samples per minute of this call."""
        return 60.0 * self.measured / self.measure_s if self.measure_s > 0 else 0.0


# ----------------------------------------------------------------------------- timing


@dataclass
class _Marks:
    start: object = None
    end: object = None
    vision_start: object = None
    vision_end: object = None
    pass_starts: list = field(default_factory=list)
    pass_ends: list = field(default_factory=list)


@dataclass
class GenerateTiming:
    """Milliseconds of one generate call (see the module docstring for the intervals)."""

    total_ms: float
    embed_ms: float
    vision_ms: float | None
    prefill_ms: float
    prefill_head_ms: float
    decode_ms: float
    decode_steps_ms: list[float]
    num_passes: int


class GenerateTimer(HookTimer):
    """Hooks on a runtime's vision module and decoder blocks that time the phases of one generate.

    Forward pass i starts at block 0's pre-hook (block 0 always runs, validated by the
    runtime) and its blocks end at the last post-hook before the next pass; pass 0 is the
    prefill. Outside :meth:`request` the hooks do nothing (warm-up runs are not timed).
    """

    def __init__(self, runtime: Any) -> None:
        super().__init__(runtime.device)
        self._marks: _Marks | None = None
        layers = list(runtime.decoder_layers)
        self._hook(runtime.vision_module, self._vision_pre, self._vision_post)
        self._hook(layers[0], pre=self._pass_pre)
        for layer in layers:
            self._hook(layer, post=self._block_post)

    def _vision_pre(self, module, args) -> None:
        if self._marks is not None and self._marks.vision_start is None:
            self._marks.vision_start = self.clock.mark()

    def _vision_post(self, module, args, output) -> None:
        if self._marks is not None:
            self._marks.vision_end = self.clock.mark()

    def _pass_pre(self, module, args) -> None:
        if self._marks is not None:
            self._marks.pass_starts.append(self.clock.mark())
            self._marks.pass_ends.append(None)

    def _block_post(self, module, args, output) -> None:
        if self._marks is not None and self._marks.pass_ends:
            self._marks.pass_ends[-1] = self.clock.mark()

    @contextmanager
    def request(self) -> Iterator[_Marks]:
        """Time the block as one request (the generate call goes inside)."""
        if self._marks is not None:
            raise RuntimeError("GenerateTimer.request is not re-entrant")
        marks = _Marks()
        self.clock.synchronize()
        marks.start = self.clock.mark()
        self._marks = marks
        try:
            yield marks
        finally:
            self._marks = None
            marks.end = self.clock.mark()

    def resolve(self, marks: _Marks) -> GenerateTiming:
        self.clock.synchronize()
        ms = self.clock.ms
        if not marks.pass_starts or marks.pass_ends[0] is None:
            raise RuntimeError("no decoder forward pass was observed inside the request (hooks not firing?)")
        starts = marks.pass_starts
        bounds = starts[1:] + [marks.end]
        steps = [ms(starts[i], bounds[i]) for i in range(1, len(starts))]
        vision = ms(marks.vision_start, marks.vision_end) if marks.vision_start is not None and marks.vision_end is not None else None
        return GenerateTiming(
            total_ms=ms(marks.start, marks.end), embed_ms=ms(marks.start, starts[0]), vision_ms=vision,
            prefill_ms=ms(starts[0], marks.pass_ends[0]), prefill_head_ms=ms(marks.pass_ends[0], bounds[0]),
            decode_ms=ms(starts[1], marks.end) if len(starts) > 1 else 0.0, decode_steps_ms=steps, num_passes=len(starts))


# ----------------------------------------------------------------------------- helpers


def rank_indices(n: int, world_size: int, rank: int) -> list[int]:
    """Rank r's dataset indices: r, r+W, ... below n (no sampler padding, so no duplicates)."""
    return list(range(rank, n, world_size))


def _stats(values: Sequence[float]) -> dict[str, float]:
    """compute_statistics (§3.1): P50/P95/P99 (linear), mean, population std, min, max; {} when empty."""
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"P50": float(p50), "P95": float(p95), "P99": float(p99), "mean": float(a.mean()),
            "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}


def _mean_std(scores: Sequence[float]) -> tuple[float | None, float | None]:
    if not scores:
        return None, None  # null, not NaN: a rank with an empty shard
    a = np.asarray(scores, dtype=np.float64)
    return float(a.mean()), float(a.std())


def _write_json(path: Path, doc: dict) -> None:
    write_bytes_atomic(path, (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode())


def _read_json(path: Path) -> dict | None:
    """The file's object, or None when it is absent, truncated or not an object (-> redo)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def exp5_name(c: int, k: int, b: int, rank: int | None = None) -> str:
    return f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}" + ("" if rank is None else f"_rank{rank}") + ".json"


def exp6_name(c: int, k: int, b: int, rank: int | None = None) -> str:
    return f"exp6_latency_crops{c}_topk{k}_blocks{b}" + ("" if rank is None else f"_rank{rank}") + ".json"


def load_profile_runtime(model: str, device: str = "cpu"):
    """The runtime ``--model`` names (``features.model.load_runtime``: embedded, testbed or a directory)."""
    from features.model import load_runtime

    return load_runtime(model, device=device)


# ----------------------------------------------------------------------------- the tree


def dataset_dirs(out_dir: Path, dataset_name: str) -> tuple[Path, Path]:
    """The exp5 and exp6 directories of one dataset (the origin's naming: ``_`` -> ``-``)."""
    slug = dataset_name.replace("_", "-")
    return out_dir / f"exp5_accuracy_{slug}", out_dir / f"exp6_latency_{slug}"


def _complete(doc: dict | None, identity: dict, extra: dict) -> bool | None:
    """True: complete and same run; False: another run's file; None: absent/unreadable (redo)."""
    if doc is None:
        return None
    config = doc.get("config")
    block = config.get("ctrl_profile") if isinstance(config, dict) else None
    if not isinstance(block, dict) or config.get("ctrl_profile_version") != PROFILE_VERSION:
        return False
    keys = ("model_fingerprint", "num_samples", "samples_sha256", "max_new_tokens", "device")
    same = all(block.get(k) == identity[k] for k in keys) and all(block.get(k) == v for k, v in extra.items())
    return same and block.get("complete") is True


@dataclass(frozen=True)
class TreeWriter:
    """One dataset's merged per-configuration files and final aggregates, computed from its rank
    files on disk. The profiler and ``online.profile_archive.unpack_profile`` share it, so an
    unpacked tree is the one profile wrote."""

    out_dir: Path
    dataset_name: str
    split: str
    world_size: int
    max_new_tokens: int
    num_layers: int
    strategy: str
    combinations: tuple[Config, ...]

    @property
    def dirs(self) -> tuple[Path, Path]:
        return dataset_dirs(self.out_dir, self.dataset_name)

    def base_config(self, knob: Config, active: list[int]) -> dict:
        c, k, b = knob
        return {"dataset_name": self.dataset_name, "split": self.split, "max_new_tokens": self.max_new_tokens,
                "max_crops": c, "top_k": k, "num_active_blocks": b, "num_total_blocks": self.num_layers,
                "active_block_indices": active}

    def write_rank(self, files: Sequence[Path], knob: Config, rank: int, active: list[int], config_index: int,
                   block: dict, latencies: list[dict], predictions: list[dict], duration: float,
                   start_time: str, end_time: str) -> None:
        """One rank's exp5 and exp6 files (``files`` = their paths) of one configuration."""
        c, k, b = knob
        scores = [p["score"] for p in predictions]
        acc, std = _mean_std(scores)
        base = self.base_config(knob, active)
        exp5_file, exp6_file = files
        # exp6 first: a crash between the two leaves exp5 missing, and the rank is redone
        _write_json(exp6_file, {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "num_total_blocks": self.num_layers,
                         "active_block_indices": active, "num_samples": len(latencies), "accuracy": acc,
                         **latency_stats(latencies)}],
            "per_sample_latencies": latencies, "per_sample_predictions": predictions,
            "config": {**base, "batch_size": 1, "world_size": self.world_size, "rank": rank,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})
        _write_json(exp5_file, {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "accuracy": acc, "num_samples": len(scores),
                         "std": std, "duration_seconds": duration, "duration_minutes": duration / 60.0,
                         "duration_hours": duration / 3600.0, "start_time": start_time, "end_time": end_time}],
            "all_samples": predictions,
            "config": {**base, "batch_size": 1, "batch_size_used": 1, "world_size": self.world_size, "rank": rank,
                       "config_index": config_index, "sampling_strategy": self.strategy,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})

    def merge(self, identity: dict, knob: Config, active: list[int]) -> None:
        """Merged per-config files from the rank files on disk (never from memory): records by dataset index."""
        c, k, b = knob
        W = self.world_size
        exp5_dir, exp6_dir = self.dirs
        lats, preds, samples = [], [], []
        for rank in range(W):
            d5 = _read_json(exp5_dir / exp5_name(c, k, b, rank))
            d6 = _read_json(exp6_dir / exp6_name(c, k, b, rank))
            for path, doc in ((exp5_dir / exp5_name(c, k, b, rank), d5), (exp6_dir / exp6_name(c, k, b, rank), d6)):
                if not _complete(doc, identity, {"world_size": W, "rank": rank}):
                    raise CtrlError(f"{path}: rank file missing or incomplete at merge time")
            samples += d5["all_samples"]
            lats += d6["per_sample_latencies"]
            preds += d6["per_sample_predictions"]
        order = sorted(range(len(lats)), key=lambda i: lats[i]["dataset_index"])
        lats, preds = [lats[i] for i in order], [preds[i] for i in order]
        samples.sort(key=lambda r: r["dataset_index"])
        expected = list(range(identity["num_samples"]))
        for name, records in (("exp5", samples), ("exp6", lats)):
            got = [r["dataset_index"] for r in records]
            if got != expected:
                raise CtrlError(f"{self.dataset_name} crops{c}_topk{k}_blocks{b}: the {name} rank files cover dataset "
                                f"indices {got[:8]}..., expected 0..{identity['num_samples'] - 1} exactly once")
        block = {**identity, "world_size": W, "complete": True}
        base = self.base_config(knob, active)
        acc, _ = _mean_std([p["score"] for p in preds])
        _write_json(exp6_dir / exp6_name(c, k, b), {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "num_samples": len(lats), "accuracy": acc,
                         **latency_stats(lats)}],
            "per_sample_latencies": lats, "per_sample_predictions": preds,
            "config": {**base, "batch_size": 1, "world_size": W, "note": MERGE_NOTE,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})
        acc5, std5 = _mean_std([s["score"] for s in samples])
        _write_json(exp5_dir / exp5_name(c, k, b), {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "accuracy": acc5, "num_samples": len(samples),
                         "std": std5}],
            "all_samples": samples,
            "config": {**base, "batch_size": 1, "world_size": W, "note": MERGE_NOTE,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})

    def final(self, identity: dict) -> dict[Config, dict]:
        """Final aggregates over the sweep's configurations, from the merged files (in sweep order);
        returns each configuration's exp6 summary."""
        exp5_dir, exp6_dir = self.dirs
        s5, a5, s6, a6 = [], [], [], []
        summaries = {}
        for c, k, b in self.combinations:
            d5, d6 = _read_json(exp5_dir / exp5_name(c, k, b)), _read_json(exp6_dir / exp6_name(c, k, b))
            s5.append(d5["summary"][0])
            a5 += d5["all_samples"]
            s6.append(d6["summary"][0])
            a6 += d6["per_sample_latencies"]
            summaries[(c, k, b)] = d6["summary"][0]
        lists = {"max_crops_list": sorted({c for c, _, _ in self.combinations}),
                 "top_k_list": sorted({k for _, k, _ in self.combinations}),
                 "num_active_blocks_list": sorted({b for _, _, b in self.combinations})}
        common = {"dataset_name": self.dataset_name, "split": self.split, "batch_size": 1,
                  "max_new_tokens": self.max_new_tokens, **lists, "sampling_strategy": self.strategy,
                  "num_combinations": len(self.combinations), "world_size": self.world_size,
                  "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": {**identity, "complete": True}}
        _write_json(exp5_dir / "exp5_accuracy_results.json", {"summary": s5, "all_samples": a5, "config": common})
        _write_json(exp6_dir / "exp6_latency_results.json", {"summary": s6, "all_samples": a6, "config": common})
        return summaries


def latency_stats(latencies: list[dict]) -> dict:
    vision = [r["T_vision_ms"] for r in latencies if r["T_vision_ms"] is not None]
    return {"latency_total_ms": _stats([r["T_total_ms"] for r in latencies]),
            "latency_prefill_ms": _stats([r["T_prefill_ms"] for r in latencies]),
            "latency_decode_ms": _stats([r["T_decode_ms"] for r in latencies]),
            "latency_vision_ms": _stats(vision)}


# ----------------------------------------------------------------------------- the sweep


class _Profiler:
    def __init__(self, config: ProfileConfig, runtime: Any, advance: Callable[[int, str], None]) -> None:
        self.config, self.runtime, self.advance = config, runtime, advance
        self.timer = GenerateTimer(runtime)
        self.measured = 0
        self.measure_s = 0.0

    # -- identity of a run: what makes an existing file reusable
    def identity(self, dataset: Any, n: int) -> dict:
        """What makes an existing file reusable (keys: ``IDENTITY_KEYS``, in that order)."""
        ids = [s.example_id for s in dataset.samples[:n]]
        identity = {
            "model": self.config.model, "model_kind": self.runtime.kind, "model_fingerprint": self.runtime.fingerprint,
            "dataset_dir": str(dataset.root), "num_samples": n,
            "samples_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
            "max_new_tokens": self.config.max_new_tokens, "device": self.runtime.device.type,
        }
        return {key: identity[key] for key in IDENTITY_KEYS}

    def _foreign(self, path: Path, identity: dict) -> CtrlError:
        return CtrlError(f"{path}: written by a different profiling run (other model, samples, max_new_tokens, "
                         f"device or world size than model {identity['model_fingerprint'][:12]}, "
                         f"{identity['num_samples']} samples); use another --out or delete that directory")

    # -- one dataset
    def run_dataset(self, dataset: Any, report: DatasetReport, ranks: Sequence[int] | None = None,
                    barrier: Callable[[], None] = lambda: None, merge: bool = True) -> None:
        """Measure ``ranks`` (default: every rank, one after the other) of every configuration
        still to do, then (``merge``) write the merged per-config files and the final aggregates.
        Under torchrun each process passes its own rank, and only rank 0 merges, after ``barrier``."""
        cfg, runtime = self.config, self.runtime
        n = report.num_samples
        identity = self.identity(dataset, n)
        W = cfg.world_size
        ranks = range(W) if ranks is None else ranks
        exp5_dir, exp6_dir = report.exp5_dir, report.exp6_dir
        to_merge = []
        for ci, (c, k, b) in enumerate(cfg.combinations):
            label = f"{dataset.name} crops{c}_topk{k}_blocks{b}"
            merged = [exp5_dir / exp5_name(c, k, b), exp6_dir / exp6_name(c, k, b)]
            states = [_complete(_read_json(p), identity, {}) for p in merged]
            for p, s in zip(merged, states):
                if s is False and p.exists():
                    raise self._foreign(p, identity)
            if all(states):
                report.skipped_configs.append((c, k, b))
                self.advance(sum(len(rank_indices(n, W, r)) for r in ranks), f"{label} (done earlier)")
                continue
            active = list(runtime.blocks_for(b))
            for rank in ranks:
                files = [exp5_dir / exp5_name(c, k, b, rank), exp6_dir / exp6_name(c, k, b, rank)]
                extra = {"world_size": W, "rank": rank}
                rstates = [_complete(_read_json(p), identity, extra) for p in files]
                for p, s in zip(files, rstates):
                    if s is False and p.exists():
                        raise self._foreign(p, identity)
                indices = rank_indices(n, W, rank)
                if all(rstates):
                    self.advance(len(indices), f"{label} rank {rank} (done earlier)")
                    continue
                self._run_rank(dataset, report, identity, (c, k, b), ci, active, rank, indices, files, label)
            to_merge.append(((c, k, b), active))
            report.measured_configs.append((c, k, b))
        barrier()
        if merge:
            writer = self._writer(dataset)
            for knob, active in to_merge:
                writer.merge(identity, knob, active)
            for knob, summary in writer.final(identity).items():
                report.accuracy[knob] = summary["accuracy"]
                report.latency_total_ms_p50[knob] = summary["latency_total_ms"]["P50"]
        barrier()

    def _sample_inputs(self, dataset: Any, index: int, max_crops: int):
        from features.images import open_image

        sample = dataset.samples[index]
        path = dataset.image_path(sample)
        image = open_image(path)
        if image is None:
            raise CtrlError(f"{path}: image of sample {sample.example_id} is missing or unreadable")
        return self.runtime.preprocess(image, sample.question, max_crops)

    def _run_rank(self, dataset: Any, report: DatasetReport, identity: dict, knob: Config, config_index: int,
                  active: list[int], rank: int, indices: list[int], files: list[Path], label: str) -> None:
        from online.metrics import score_answer

        cfg, runtime, timer = self.config, self.runtime, self.timer
        c, k, b = knob
        started = time.perf_counter()
        start_time = datetime.now()
        latencies: list[dict] = []
        predictions: list[dict] = []
        with runtime.knobs(top_k=k, num_active_blocks=b):
            if indices and cfg.warmup:
                inputs = self._sample_inputs(dataset, indices[0], c)
                for _ in range(cfg.warmup):
                    runtime.generate(inputs, cfg.max_new_tokens)
            for index in indices:
                sample = dataset.samples[index]
                inputs = self._sample_inputs(dataset, index, c)
                with timer.request() as marks:
                    result = runtime.generate(inputs, cfg.max_new_tokens)
                t = timer.resolve(marks)
                tokens = list(result.token_ids)
                if t.num_passes != len(tokens):
                    raise RuntimeError(f"{len(tokens)} tokens but {t.num_passes} forward passes were timed")
                score, pred = score_answer(dataset.name, result.text, list(sample.answers))
                meta = sample.metadata()
                num_vision = 0 if inputs.image_token_positions is None else int(inputs.image_token_positions.numel())
                seq = int(inputs.input_ids.shape[1])
                latencies.append({
                    "sample_id": index, "dataset_index": index, "rank": rank,
                    "max_crops": c, "top_k": k, "num_active_blocks": b,
                    "T_total_ms": t.total_ms, "T_vision_ms": t.vision_ms, "T_embed_ms": t.embed_ms,
                    "T_prefill_ms": t.prefill_ms, "T_prefill_head_ms": t.prefill_head_ms, "T_decode_ms": t.decode_ms,
                    "T_decode_steps_ms": t.decode_steps_ms,
                    "num_crops": inputs.num_crops, "num_vision_tokens": num_vision, "num_language_tokens": seq - num_vision,
                    "num_output_tokens": len(tokens), "num_total_tokens": seq,
                    "ends_with_eos": bool(tokens) and tokens[-1] == runtime.eos_id,
                    "accuracy": float(score), "metadata": meta,
                })
                predictions.append({"sample_id": index, "score": float(score), "pred": pred, "answers": list(sample.answers),
                                    "metadata": meta, "text": result.text, "dataset_index": index, "rank": rank,
                                    "max_crops": c, "top_k": k, "num_active_blocks": b})
                self.measured += 1
                self.advance(1, f"{label} rank {rank}")
        duration = time.perf_counter() - started
        self.measure_s += duration
        fmt = "%Y-%m-%d %H:%M:%S"
        block = {**identity, "world_size": cfg.world_size, "rank": rank, "warmup": cfg.warmup,
                 "threads": torch.get_num_threads() if runtime.device.type == "cpu" else None,
                 "dataset_indices": indices, "torch": torch.__version__, "complete": True}
        self._writer(dataset).write_rank(files, knob, rank, active, config_index, block, latencies, predictions,
                                         duration, start_time.strftime(fmt), datetime.now().strftime(fmt))

    def _writer(self, dataset: Any) -> TreeWriter:
        cfg = self.config
        return TreeWriter(cfg.out_dir, dataset.name, dataset.split, cfg.world_size, cfg.max_new_tokens,
                          self.runtime.num_layers, cfg.strategy, tuple(cfg.combinations))

    def close(self) -> None:
        self.timer.close()


def _check_dataset(dataset: Any, n: int) -> None:
    """Every selected sample has answers and an image on disk (one line naming what is missing)."""
    missing = [dataset.image_path(s) for s in dataset.samples[:n] if not dataset.image_path(s).is_file()]
    if missing:
        raise CtrlError(f"{dataset.root}: {len(missing)} of {n} images missing under {dataset.images_dir}, "
                        f"e.g. {missing[0].name}")
    no_answers = [s.example_id for s in dataset.samples[:n] if not s.answers]
    if no_answers:
        raise CtrlError(f"{dataset.root}: {len(no_answers)} samples have no reference answers, e.g. {no_answers[0]}")


def _check_knobs(configs: list[Config], runtime: Any) -> None:
    for c, k, b in configs:
        if not 1 <= k <= runtime.num_experts:
            raise KnobError(f"configuration {c}/{k}/{b}: top_k must be in 1..{runtime.num_experts}")
        if not 1 <= b <= runtime.num_layers:
            raise KnobError(f"configuration {c}/{k}/{b}: num_active_blocks must be in 1..{runtime.num_layers}")
        runtime.blocks_for(b)


def profile_model(config: ProfileConfig, runtime: Any = None, progress: Callable[[int, str], None] | None = None,
                  on_total: Callable[[int], None] | None = None) -> ProfileReport:
    """Run the sweep of ``config`` on every dataset and write the exp5 / exp6 trees (see the module docstring).

    ``runtime``: an already loaded ModelRuntime (tests); else ``config.model`` is loaded.
    ``progress(n, label)`` advances by n (sample, configuration) pairs; ``on_total(n)`` gives the total.
    """
    from testbed.dataset import read_dataset

    started = time.perf_counter()
    datasets = [read_dataset(d) for d in config.datasets]
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise CtrlError(f"two --dataset directories have the same dataset name {min(n for n in names if names.count(n) > 1)!r}")
    sizes = []
    for d in datasets:
        n = len(d.samples) if config.num_samples is None else min(config.num_samples, len(d.samples))
        if n == 0:
            raise CtrlError(f"{d.root}: the dataset has no samples")
        _check_dataset(d, n)
        sizes.append(n)
    dist = init_distributed_from_env(config.device)
    if dist.active:
        if config.world_size not in (1, dist.world_size):
            raise CtrlError(f"--world-size {config.world_size} differs from torchrun's {dist.world_size} processes "
                            f"(under torchrun, leave it out)")
        config.world_size = dist.world_size
    if runtime is None:
        runtime = load_profile_runtime(config.model, config.device)
    _check_knobs(config.combinations, runtime)
    if on_total is not None:
        share = sum(len(rank_indices(n, config.world_size, dist.rank)) for n in sizes) if dist.active else sum(sizes)
        on_total(share * len(config.combinations))
    profiler = _Profiler(config, runtime, progress or (lambda n, label: None))
    reports = []
    try:
        with cpu_threads(config.threads, runtime.device):
            for d, n in zip(datasets, sizes):
                exp5_dir, exp6_dir = dataset_dirs(config.out_dir, d.name)
                exp5_dir.mkdir(parents=True, exist_ok=True)
                exp6_dir.mkdir(parents=True, exist_ok=True)
                report = DatasetReport(d.name, n, exp5_dir, exp6_dir)
                if dist.active:  # this process measures its own rank; rank 0 merges from the files
                    profiler.run_dataset(d, report, ranks=[dist.rank], barrier=dist.barrier, merge=dist.rank == 0)
                else:
                    profiler.run_dataset(d, report)
                reports.append(report)
    finally:
        profiler.close()
    return ProfileReport(config.out_dir, runtime.fingerprint, reports, profiler.measured, profiler.measure_s,
                         time.perf_counter() - started)


def format_report(report: ProfileReport) -> list[str]:
    """Short lines for the CLI: per dataset the best accuracy and the latency range."""
    lines = []
    for d in report.datasets:
        if not d.accuracy:
            continue
        best = max(d.accuracy, key=lambda c: (d.accuracy[c] if d.accuracy[c] is not None else -math.inf))
        lat = list(d.latency_total_ms_p50.values())
        lines.append(f"{d.name}: {d.num_samples} samples x {len(d.accuracy)} configurations "
                     f"({len(d.measured_configs)} measured, {len(d.skipped_configs)} done earlier); "
                     f"best accuracy {d.accuracy[best]:.3f} at crops{best[0]}_topk{best[1]}_blocks{best[2]}; "
                     f"median total latency {min(lat):.1f}-{max(lat):.1f} ms; {d.exp5_dir.parent}")
    return lines
