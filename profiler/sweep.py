"""``ctrl profile``: measure a model's knob sweep and write it as exp5 / exp6 result trees.

The origin's profiling scripts (``docs/origin_format.md`` §4.2, §4.3) are the format this writes,
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
  ``num_language_tokens`` = the prompt's text tokens only, ``num_total_tokens`` = the
  prompt length (their sum plus the model's own markers: MolmoE's BOS and image
  start/end/column tokens).
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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from pipeline.errors import CtrlError, KnobError
from pipeline.execution import ExecutionOptions
from pipeline.knobs import Config
from pipeline.origin_format import exp5_name, exp6_name
from profiler.config import ProfileConfig, parse_configs
from profiler.tree import (
    IDENTITY_KEYS,
    TreeWriter,
    dataset_dirs,
    is_complete,
    latency_indices,
    read_json,
    sampling_identity,
)
from runtime import GenerationResult, ModelRuntime, load_runtime
from runtime.base import BatchRequest
from runtime.distributed import init_distributed_from_env
from runtime.images import open_image
from runtime.precision import dtype_name
from runtime.scoring import score_answer
from runtime.timing import GenerateTimer, cpu_threads, uncaptured_run
from testbed.dataset import VqaDataset, read_dataset

__all__ = ["DatasetReport", "ProfileConfig", "ProfileReport", "format_report", "parse_configs", "profile_model",
           "rank_indices"]

# ----------------------------------------------------------------------------- configuration


def rank_indices(n: int, world_size: int, rank: int) -> list[int]:
    """Rank r's dataset indices: r, r+W, ... below n (no sampler padding, so no duplicates)."""
    return list(range(rank, n, world_size))


def _generations(config: ProfileConfig, n: int, indices: Sequence[int]) -> int:
    """The generations one configuration runs over ``indices`` of a dataset of ``n`` samples: one per
    sample, and in batches of more than one also one alone per latency sample among them."""
    if config.batch_size == 1:
        return len(indices)
    identity = sampling_identity(config.batch_size, config.latency_samples, config.latency_seed, n)
    return len(indices) + len(set(indices) & set(latency_indices(n, identity)))


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


# ----------------------------------------------------------------------------- the sweep


class _Profiler:
    def __init__(self, config: ProfileConfig, runtime: ModelRuntime, advance: Callable[[int, str], None]) -> None:
        self.config, self.runtime, self.advance = config, runtime, advance
        self.timer = GenerateTimer(runtime)
        self.measured = 0
        self.measure_s = 0.0

    # -- identity of a run: what makes an existing file reusable
    def identity(self, dataset: VqaDataset, n: int) -> dict:
        """What makes an existing file reusable (keys: ``IDENTITY_KEYS``, in that order, then the
        execution path: ``profiler.tree.execution_of``)."""
        ids = [s.example_id for s in dataset.samples[:n]]
        identity = {
            "model": self.config.model, "model_kind": self.runtime.kind, "model_fingerprint": self.runtime.fingerprint,
            "dataset_dir": str(dataset.root), "num_samples": n,
            "samples_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
            "max_new_tokens": self.config.max_new_tokens, "device": self.runtime.device.type,
            "dtype": dtype_name(self.runtime.dtype),
        }
        execution = {k: v for k, v in self.runtime.execution.items() if k != "cuda_graphs"}
        sampling = sampling_identity(self.config.batch_size, self.config.latency_samples, self.config.latency_seed, n)
        return {**{key: identity[key] for key in IDENTITY_KEYS}, "execution": execution, **sampling}

    def _foreign(self, path: Path, identity: dict) -> CtrlError:
        return CtrlError(f"{path}: written by a different profiling run (other model, samples, max_new_tokens, "
                         f"device, dtype, execution path, world size, batch size or latency samples than model "
                         f"{identity['model_fingerprint'][:12]}, "
                         f"{identity['num_samples']} samples); use another --out or delete that directory")

    # -- one dataset
    def run_dataset(self, dataset: VqaDataset, report: DatasetReport, ranks: Sequence[int] | None = None,
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
            states = [is_complete(read_json(p), identity, {}) for p in merged]
            for p, s in zip(merged, states):
                if s is False and p.exists():
                    raise self._foreign(p, identity)
            if all(states):
                report.skipped_configs.append((c, k, b))
                self.advance(sum(_generations(cfg, n, rank_indices(n, W, r)) for r in ranks), f"{label} (done earlier)")
                continue
            active = list(runtime.blocks_for(b))
            for rank in ranks:
                files = [exp5_dir / exp5_name(c, k, b, rank), exp6_dir / exp6_name(c, k, b, rank)]
                extra = {"world_size": W, "rank": rank}
                rstates = [is_complete(read_json(p), identity, extra) for p in files]
                for p, s in zip(files, rstates):
                    if s is False and p.exists():
                        raise self._foreign(p, identity)
                indices = rank_indices(n, W, rank)
                if all(rstates):
                    self.advance(_generations(cfg, n, indices), f"{label} rank {rank} (done earlier)")
                    continue
                self._run_rank(dataset, identity, (c, k, b), ci, active, rank, indices, files, label)
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

    def _sample_inputs(self, dataset: VqaDataset, index: int, max_crops: int):
        sample = dataset.samples[index]
        path = dataset.image_path(sample)
        image = open_image(path)
        if image is None:
            msg = f"{path}: image of sample {sample.example_id} is missing or unreadable"
            raise CtrlError(msg)
        return self.runtime.preprocess(image, sample.question, max_crops)

    def _run_rank(self, dataset: VqaDataset, identity: dict, knob: Config, config_index: int, active: list[int],
                  rank: int, indices: list[int], files: list[Path], label: str) -> None:
        cfg, runtime = self.config, self.runtime
        c, k, b = knob
        started = time.perf_counter()
        start_time = datetime.now()
        timed = set(latency_indices(identity["num_samples"], identity))
        latencies: list[dict] = []
        predictions: list[dict] = []
        latency_predictions: list[dict] | None = None
        with runtime.knobs(top_k=k, num_active_blocks=b):
            timed_here = [i for i in indices if i in timed]
            if timed_here and cfg.warmup:
                inputs = self._sample_inputs(dataset, timed_here[0], c)
                for _ in range(cfg.warmup):
                    runtime.generate(inputs, cfg.max_new_tokens)
            if cfg.batch_size == 1:
                for index in indices:
                    inputs = self._sample_inputs(dataset, index, c)
                    if index in timed:
                        result, latency = self._timed(dataset, index, inputs, knob, rank)
                        latencies.append(latency)
                    else:
                        result = runtime.generate(inputs, cfg.max_new_tokens)
                    predictions.append(self._prediction(dataset, index, result, knob, rank))
                    self.measured += 1
                    self.advance(1, f"{label} rank {rank}")
            else:
                for start in range(0, len(indices), cfg.batch_size):
                    chunk = indices[start:start + cfg.batch_size]
                    requests = [BatchRequest(self._sample_inputs(dataset, i, c), cfg.max_new_tokens) for i in chunk]
                    for index, result in zip(chunk, runtime.generate_batch(requests), strict=True):
                        if isinstance(result, CtrlError):
                            msg = f"sample {dataset.samples[index].example_id}: {result}"
                            raise CtrlError(msg)
                        predictions.append(self._prediction(dataset, index, result, knob, rank))
                    self.measured += len(chunk)
                    self.advance(len(chunk), f"{label} rank {rank} (batches of {cfg.batch_size})")
                latency_predictions = []
                for index in timed_here:
                    result, latency = self._timed(dataset, index, self._sample_inputs(dataset, index, c), knob, rank)
                    latencies.append(latency)
                    latency_predictions.append(self._prediction(dataset, index, result, knob, rank))
                    self.advance(1, f"{label} rank {rank} (latency alone)")
        duration = time.perf_counter() - started
        self.measure_s += duration
        fmt = "%Y-%m-%d %H:%M:%S"
        block = {**identity, "world_size": cfg.world_size, "rank": rank, "warmup": cfg.warmup,
                 "threads": torch.get_num_threads() if runtime.device.type == "cpu" else None,
                 "cuda_graphs": runtime.execution["cuda_graphs"],
                 "dataset_indices": indices, "torch": torch.__version__, "complete": True}
        self._writer(dataset).write_rank(files, knob, rank, active, config_index, block, latencies, predictions,
                                         duration, start_time.strftime(fmt), datetime.now().strftime(fmt),
                                         latency_predictions=latency_predictions)

    def _timed(self, dataset: VqaDataset, index: int, inputs, knob: Config, rank: int) -> tuple[GenerationResult, dict]:
        """One generation alone, hook-timed, and its exp6 latency record."""
        runtime, timer = self.runtime, self.timer
        c, k, b = knob

        def timed_generate() -> tuple[GenerationResult, object]:
            with timer.request() as marks:
                return runtime.generate(inputs, self.config.max_new_tokens), marks

        result, marks = uncaptured_run(runtime, timed_generate)
        t = timer.resolve(marks)
        tokens = list(result.token_ids)
        if t.num_passes != len(tokens):
            msg = f"{len(tokens)} tokens but {t.num_passes} forward passes were timed"
            raise RuntimeError(msg)
        sample = dataset.samples[index]
        score, _ = score_answer(dataset.name, result.text, list(sample.answers))
        num_vision = 0 if inputs.image_token_positions is None else int(inputs.image_token_positions.numel())
        return result, {
            "sample_id": index, "dataset_index": index, "rank": rank,
            "max_crops": c, "top_k": k, "num_active_blocks": b,
            "T_total_ms": t.total_ms, "T_vision_ms": t.vision_ms, "T_embed_ms": t.embed_ms,
            "T_prefill_ms": t.prefill_ms, "T_prefill_head_ms": t.prefill_head_ms, "T_decode_ms": t.decode_ms,
            "T_decode_steps_ms": t.decode_steps_ms,
            "num_crops": inputs.num_crops, "num_vision_tokens": num_vision,
            "num_language_tokens": inputs.num_text_tokens,
            "num_output_tokens": len(tokens), "num_total_tokens": int(inputs.input_ids.shape[1]),
            "ends_with_eos": bool(tokens) and tokens[-1] == runtime.eos_id,
            "accuracy": float(score), "metadata": sample.metadata(),
        }

    def _prediction(self, dataset: VqaDataset, index: int, result: GenerationResult, knob: Config,
                    rank: int) -> dict:
        """A generation's exp5 (and exp6) prediction record."""
        c, k, b = knob
        sample = dataset.samples[index]
        score, pred = score_answer(dataset.name, result.text, list(sample.answers))
        return {"sample_id": index, "score": float(score), "pred": pred, "answers": list(sample.answers),
                "metadata": sample.metadata(), "text": result.text, "dataset_index": index, "rank": rank,
                "max_crops": c, "top_k": k, "num_active_blocks": b}

    def _writer(self, dataset: VqaDataset) -> TreeWriter:
        cfg = self.config
        return TreeWriter(cfg.out_dir, dataset.name, dataset.split, cfg.world_size, cfg.max_new_tokens,
                          self.runtime.num_layers, cfg.strategy, tuple(cfg.combinations))

    def close(self) -> None:
        self.timer.close()


def _check_dataset(dataset: VqaDataset, n: int) -> None:
    """Every selected sample has answers and an image on disk (one line naming what is missing)."""
    missing = [dataset.image_path(s) for s in dataset.samples[:n] if not dataset.image_path(s).is_file()]
    if missing:
        msg = (f"{dataset.root}: {len(missing)} of {n} images missing under {dataset.images_dir}, "
               f"e.g. {missing[0].name}")
        raise CtrlError(msg)
    no_answers = [s.example_id for s in dataset.samples[:n] if not s.answers]
    if no_answers:
        msg = f"{dataset.root}: {len(no_answers)} samples have no reference answers, e.g. {no_answers[0]}"
        raise CtrlError(msg)


def _check_knobs(configs: list[Config], runtime: ModelRuntime) -> None:
    for c, k, b in configs:
        if not 1 <= k <= runtime.num_experts:
            msg = f"configuration {c}/{k}/{b}: top_k must be in 1..{runtime.num_experts}"
            raise KnobError(msg)
        if not 1 <= b <= runtime.num_layers:
            msg = f"configuration {c}/{k}/{b}: num_active_blocks must be in 1..{runtime.num_layers}"
            raise KnobError(msg)
        runtime.blocks_for(b)


def profile_model(config: ProfileConfig, runtime: ModelRuntime | None = None,
                  progress: Callable[[int, str], None] | None = None,
                  on_total: Callable[[int], None] | None = None) -> ProfileReport:
    """Run the sweep of ``config`` on every dataset and write the exp5 / exp6 trees (see the module docstring).

    ``runtime``: an already loaded ModelRuntime (tests); else ``config.model`` is loaded.
    ``progress(n, label)`` advances by n (sample, configuration) pairs; ``on_total(n)`` gives the total.
    """
    started = time.perf_counter()
    datasets = [read_dataset(d) for d in config.datasets]
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        msg = f"two --dataset directories have the same dataset name {min(n for n in names if names.count(n) > 1)!r}"
        raise CtrlError(msg)
    sizes = []
    for d in datasets:
        n = len(d.samples) if config.num_samples is None else min(config.num_samples, len(d.samples))
        if n == 0:
            msg = f"{d.root}: the dataset has no samples"
            raise CtrlError(msg)
        _check_dataset(d, n)
        sizes.append(n)
    dist = init_distributed_from_env(config.device)
    if dist.active:
        if config.world_size not in (1, dist.world_size):
            msg = (f"--world-size {config.world_size} differs from torchrun's {dist.world_size} processes "
                   f"(under torchrun, leave it out)")
            raise CtrlError(msg)
        config.world_size = dist.world_size
    if runtime is None:
        runtime = load_runtime(config.model, ExecutionOptions.of(config))
    _check_knobs(config.combinations, runtime)
    if on_total is not None:
        share = sum(_generations(config, n, rank_indices(n, config.world_size, dist.rank) if dist.active
                                 else range(n)) for n in sizes)
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
