"""The files of a ``ctrl profile`` tree: rank files, merged per-configuration files and final
aggregates, in the origin's exp5 / exp6 format (``pipeline.origin_format``), with the
``ctrl_profile`` marker block that tells ingest the latencies were measured without the origin's
defects.

:class:`TreeWriter` renders them; the profiler and ``profiler.archive`` share it, so an unpacked
archive is the tree the profiler wrote.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import CtrlError
from pipeline.knobs import Config
from pipeline.origin_format import (
    EXP5_FINAL_NAME,
    EXP6_FINAL_NAME,
    MERGE_NOTE,
    accuracy_mean_std,
    dataset_dir_names,
    exp5_name,
    exp6_name,
    latency_statistics,
)
from pipeline.workspace import write_bytes_atomic

#: written as ``config.ctrl_profile_version``; ingest trusts the latencies of files carrying it
PROFILE_VERSION = 1
#: a run's identity (the start of every file's ``ctrl_profile`` block; the rest is per rank)
IDENTITY_KEYS = ("model", "model_kind", "model_fingerprint", "dataset_dir", "num_samples", "samples_sha256",
                 "max_new_tokens", "device", "dtype")


#: the execution path recorded in a file's ``ctrl_profile`` block (``ModelRuntime.execution`` less
#: ``cuda_graphs``); files written before it was recorded ran the eager reference path
EAGER_EXECUTION = {"compiled": False, "attention_dtype": "float32"}


def execution_of(block: dict) -> dict:
    """The execution path a ``ctrl_profile`` block records (:data:`EAGER_EXECUTION` where it records none)."""
    return block.get("execution", EAGER_EXECUTION)


#: how a run generated: exp5's batch size and exp6's latency subset (recorded only where not these)
BATCH_ONE = {"batch_size": 1, "latency_samples": None, "latency_seed": 0}


def sampling_of(block: dict) -> dict:
    """A ``ctrl_profile`` block's (or a run identity's) batch size and latency subset, the defaults
    where it records none (every file of a batch-1 run that times every sample)."""
    return {key: block.get(key, default) for key, default in BATCH_ONE.items()}


def sampling_identity(batch_size: int, latency_samples: int | None, latency_seed: int, num_samples: int) -> dict:
    """What a run's identity records of its sampling: nothing for the batch-1, every-sample run (its
    files are those of a run without batching), else all three values."""
    if latency_samples is not None and latency_samples >= num_samples:
        latency_samples = None  # every sample: the subset is the whole set, whatever the seed
    sampling = {"batch_size": int(batch_size), "latency_samples": latency_samples,
                "latency_seed": int(latency_seed) if latency_samples is not None else 0}
    return {} if sampling == BATCH_ONE else sampling


def latency_indices(num_samples: int, identity: dict) -> list[int]:
    """The dataset indices whose latency exp6 records: all, or the seeded subset of the identity's
    ``latency_samples`` (sorted)."""
    sampling = sampling_of(identity)
    m = sampling["latency_samples"]
    if m is None or m >= num_samples:
        return list(range(num_samples))
    return sorted(random.Random(sampling["latency_seed"]).sample(range(num_samples), m))


#: one-line JSON by the C encoder (the standard library encodes with indentation in Python, 3x slower)
_ONE_LINE = json.JSONEncoder(allow_nan=False)


def json_text(value: object, depth: int = 2, _level: int = 0) -> str:
    """JSON with the objects and arrays of the outer ``depth`` levels one member per line (indent 2)
    and everything deeper on one line: in a results file, one record per line."""
    if _level < depth and isinstance(value, (dict, list, tuple)) and value:
        pad = "\n" + "  " * (_level + 1)
        if isinstance(value, dict):
            members = [f"{_ONE_LINE.encode(str(k))}: {json_text(v, depth, _level + 1)}" for k, v in value.items()]
            return "{" + pad + ("," + pad).join(members) + "\n" + "  " * _level + "}"
        return "[" + pad + ("," + pad).join(json_text(v, depth, _level + 1) for v in value) + "\n" + "  " * _level + "]"
    return _ONE_LINE.encode(value)


def write_json(path: Path, doc: dict) -> None:
    write_bytes_atomic(path, (json_text(doc) + "\n").encode())


def read_json(path: Path) -> dict | None:
    """The file's object, or None when it is absent, truncated or not an object (-> redo)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def dataset_dirs(out_dir: Path, dataset_name: str) -> tuple[Path, Path]:
    """The exp5 and exp6 directories of one dataset under ``out_dir``."""
    exp5, exp6 = dataset_dir_names(dataset_name)
    return out_dir / exp5, out_dir / exp6


def is_complete(doc: dict | None, identity: dict, extra: dict) -> bool | None:
    """True: complete and same run; False: another run's file; None: absent/unreadable (redo)."""
    if doc is None:
        return None
    config = doc.get("config")
    block = config.get("ctrl_profile") if isinstance(config, dict) else None
    if not isinstance(block, dict) or config.get("ctrl_profile_version") != PROFILE_VERSION:
        return False
    keys = ("model_fingerprint", "num_samples", "samples_sha256", "max_new_tokens", "device", "dtype")
    same = all(block.get(k) == identity[k] for k in keys) and all(block.get(k) == v for k, v in extra.items())
    same = same and execution_of(block) == identity.get("execution", EAGER_EXECUTION)
    same = same and sampling_of(block) == sampling_of(identity)
    return same and block.get("complete") is True


@dataclass(frozen=True)
class TreeWriter:
    """One dataset's merged per-configuration files and final aggregates, computed from its rank
    files on disk. The profiler and ``profiler.archive.unpack_profile`` share it, so an
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
                   start_time: str, end_time: str, latency_predictions: list[dict] | None = None) -> None:
        """One rank's exp5 and exp6 files (``files`` = their paths) of one configuration: exp5's
        ``predictions``, exp6's ``latencies`` with their own ``latency_predictions`` (None: the
        same generations as exp5's)."""
        c, k, b = knob
        scores = [p["score"] for p in predictions]
        acc, std = accuracy_mean_std(scores)
        lat_preds = predictions if latency_predictions is None else latency_predictions
        lat_acc, _ = accuracy_mean_std([p["score"] for p in lat_preds])
        batch = sampling_of(block)["batch_size"]
        base = self.base_config(knob, active)
        exp5_file, exp6_file = files
        # exp6 first: a crash between the two leaves exp5 missing, and the rank is redone
        write_json(exp6_file, {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "num_total_blocks": self.num_layers,
                         "active_block_indices": active, "num_samples": len(latencies), "accuracy": lat_acc,
                         **latency_summary(latencies)}],
            "per_sample_latencies": latencies, "per_sample_predictions": lat_preds,
            "config": {**base, "batch_size": 1, "world_size": self.world_size, "rank": rank,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})
        write_json(exp5_file, {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "accuracy": acc,
                         "num_samples": len(scores),
                         "std": std, "duration_seconds": duration, "duration_minutes": duration / 60.0,
                         "duration_hours": duration / 3600.0, "start_time": start_time, "end_time": end_time}],
            "all_samples": predictions,
            "config": {**base, "batch_size": batch, "batch_size_used": batch, "world_size": self.world_size,
                       "rank": rank,
                       "config_index": config_index, "sampling_strategy": self.strategy,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})

    def merge(self, identity: dict, knob: Config, active: list[int]) -> None:
        """Merged per-config files from the rank files on disk (never from memory): records by dataset index."""
        c, k, b = knob
        W = self.world_size
        exp5_dir, exp6_dir = self.dirs
        lats, preds, samples = [], [], []
        for rank in range(W):
            d5 = read_json(exp5_dir / exp5_name(c, k, b, rank))
            d6 = read_json(exp6_dir / exp6_name(c, k, b, rank))
            for path, doc in ((exp5_dir / exp5_name(c, k, b, rank), d5), (exp6_dir / exp6_name(c, k, b, rank), d6)):
                if not is_complete(doc, identity, {"world_size": W, "rank": rank}):
                    msg = f"{path}: rank file missing or incomplete at merge time"
                    raise CtrlError(msg)
            samples += d5["all_samples"]
            lats += d6["per_sample_latencies"]
            preds += d6["per_sample_predictions"]
        order = sorted(range(len(lats)), key=lambda i: lats[i]["dataset_index"])
        lats, preds = [lats[i] for i in order], [preds[i] for i in order]
        samples.sort(key=lambda r: r["dataset_index"])
        every = list(range(identity["num_samples"]))
        timed = latency_indices(identity["num_samples"], identity)
        for name, records, expected in (("exp5", samples, every), ("exp6", lats, timed)):
            got = [r["dataset_index"] for r in records]
            if got != expected:
                which = (f"0..{identity['num_samples'] - 1}" if expected == every
                         else f"the {len(expected)} latency samples")
                msg = (f"{self.dataset_name} crops{c}_topk{k}_blocks{b}: the {name} rank files cover dataset "
                       f"indices {got[:8]}..., expected {which} exactly once")
                raise CtrlError(msg)
        block = {**identity, "world_size": W, "complete": True}
        base = self.base_config(knob, active)
        acc, _ = accuracy_mean_std([p["score"] for p in preds])
        write_json(exp6_dir / exp6_name(c, k, b), {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "num_samples": len(lats), "accuracy": acc,
                         **latency_summary(lats)}],
            "per_sample_latencies": lats, "per_sample_predictions": preds,
            "config": {**base, "batch_size": 1, "world_size": W, "note": MERGE_NOTE,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})
        acc5, std5 = accuracy_mean_std([s["score"] for s in samples])
        write_json(exp5_dir / exp5_name(c, k, b), {
            "summary": [{"max_crops": c, "top_k": k, "num_active_blocks": b, "accuracy": acc5,
                         "num_samples": len(samples),
                         "std": std5}],
            "all_samples": samples,
            "config": {**base, "batch_size": sampling_of(identity)["batch_size"], "world_size": W, "note": MERGE_NOTE,
                       "ctrl_profile_version": PROFILE_VERSION, "ctrl_profile": block}})

    def final(self, identity: dict) -> dict[Config, dict]:
        """Final aggregates over the sweep's configurations, from the merged files (in sweep order);
        returns each configuration's exp6 summary."""
        exp5_dir, exp6_dir = self.dirs
        s5, a5, s6, a6 = [], [], [], []
        summaries = {}
        for c, k, b in self.combinations:
            d5, d6 = read_json(exp5_dir / exp5_name(c, k, b)), read_json(exp6_dir / exp6_name(c, k, b))
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
        exp5_common = {**common, "batch_size": sampling_of(identity)["batch_size"]}
        write_json(exp5_dir / EXP5_FINAL_NAME, {"summary": s5, "all_samples": a5, "config": exp5_common})
        write_json(exp6_dir / EXP6_FINAL_NAME, {"summary": s6, "all_samples": a6, "config": common})
        return summaries


def latency_summary(latencies: list[dict]) -> dict:
    vision = [r["T_vision_ms"] for r in latencies if r["T_vision_ms"] is not None]
    return {"latency_total_ms": latency_statistics([r["T_total_ms"] for r in latencies]),
            "latency_prefill_ms": latency_statistics([r["T_prefill_ms"] for r in latencies]),
            "latency_decode_ms": latency_statistics([r["T_decode_ms"] for r in latencies]),
            "latency_vision_ms": latency_statistics(vision)}
