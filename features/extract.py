"""``ctrl extract-features``: image and language features per sample, computed once.

Features live in ``workspace/features/<fingerprint>/chunk-NNNNN/`` (one directory per chunk
of samples, renamed into place when complete). A sample is computed at most once per model
fingerprint: later runs skip every sample already in a chunk, so an interrupted run resumes
where it stopped and a finished one does zero forward passes.

Under ``torchrun`` (one process per GPU) the pending samples are cut into the same chunks and
batches as in one process; each round of ``world_size`` chunks deals its batches out in turn
(batch i of the round to rank i % world_size), and rank 0 gathers them and writes the chunks in
order. So the cache is the one a single process writes, every sample's rows come from the same
forward batch, and rank 0 alone holds the workspace lock and writes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from features.config import FeatureConfig
from pipeline.catalog import build_catalog
from pipeline.errors import CacheMismatchError
from pipeline.execution import ExecutionOptions
from pipeline.health import feature_chunk_problem
from pipeline.schema import IMAGE_FEATURES, IMAGE_TILINGS, LANG_FEATURES, TableSchema
from pipeline.workspace import CHECKSUM_FILE, Workspace, file_sha256, os_error_naming
from runtime import REFERENCE_MAX_CROPS, ModelRuntime, load_runtime, model_fingerprint
from runtime.distributed import init_distributed_from_env, local_device
from runtime.images import ImageIndex, open_image

#: max_crops values whose tiling is stored per sample (covers every tier of docs/origin_format.md §2.1)
TILING_MAX_CROPS = tuple(range(1, 16))


@dataclass
class FeatureReport:
    """What :func:`extract_features` did: samples computed and found cached, forward batches,
    the samples whose image was missing or unreadable, and the time it took.

    Under torchrun rank 0's report covers the whole job; another rank's counts its own batches.
    """

    fingerprint: str
    num_samples: int = 0
    computed: int = 0
    cached: int = 0
    forward_batches: int = 0
    missing_images: list[str] = field(default_factory=list)
    unreadable_images: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def cached_keys(features_dir: Path) -> set[tuple[str, str]]:
    """(dataset, sample_key) of every sample in a complete chunk of this fingerprint."""
    keys: set[tuple[str, str]] = set()
    for chunk in sorted(features_dir.glob("chunk-*")):
        table = pq.read_table(chunk / "lang_features.parquet", columns=["dataset", "sample_key"])
        keys.update(zip(table.column("dataset").to_pylist(), table.column("sample_key").to_pylist()))
    return keys


def extract_features(config: FeatureConfig, runtime: ModelRuntime | None = None,
                     progress: Callable[[int], None] | None = None,
                     on_total: Callable[[int], None] | None = None) -> FeatureReport:
    """Compute and cache features for every sample of the workspace.

    ``runtime`` (a ``runtime.ModelRuntime``) is loaded from ``config.model`` when None.
    ``progress(n)`` is called after each batch with the number of samples it finished.
    Under torchrun every rank calls this (see the module docstring); only rank 0 calls
    ``progress`` and ``on_total``, and an error on any rank raises on all of them.
    """
    started = time.perf_counter()
    dist = init_distributed_from_env(config.device)
    lead = dist.rank == 0
    fingerprint = runtime.fingerprint if runtime is not None else model_fingerprint(config.model,
                                                                                    execution=_execution(config))
    if fingerprint is None:
        # a checkpoint loaded for the first time: its fingerprint comes from the load itself
        runtime = _load_model(config)
        fingerprint = runtime.fingerprint
    with ExitStack() as held:
        with dist.fail_together():
            plan = _plan(config, fingerprint, held) if lead else None
        plan = dist.broadcast(plan)
        report = FeatureReport(plan.fingerprint, num_samples=plan.num_samples,
                               cached=plan.num_samples - len(plan.todo))
        if on_total and lead:
            on_total(len(plan.todo))
        with dist.fail_together():
            if plan.todo and runtime is None:  # load the model only when something is left to compute
                runtime = _load_model(config)
                if runtime.fingerprint != plan.fingerprint:
                    msg = (f"model {config.model!r} loaded with fingerprint {runtime.fingerprint[:16]}, "
                           f"expected {plan.fingerprint[:16]}")
                    raise CacheMismatchError(msg)
            images = ImageIndex(config.images_dir, config.image_pattern)
        chunks = [plan.todo[s:s + config.chunk_size] for s in range(0, len(plan.todo), config.chunk_size)]
        for first in range(0, len(chunks), dist.world_size):  # a round: as many chunks as ranks
            batches = [(c, chunk[s:s + config.batch_size])
                       for c, chunk in enumerate(chunks[first:first + dist.world_size], first)
                       for s in range(0, len(chunk), config.batch_size)]
            mine: list[_Batch] = []
            with dist.fail_together():
                loaded: dict[tuple[str, str], tuple] = {}  # several questions share an image: decode it once
                for i in range(dist.rank, len(batches), dist.world_size):
                    mine.append(_compute_batch(runtime, i, *batches[i], images, loaded))
                    if progress and lead:
                        progress(mine[-1].num_samples)
            gathered = dist.gather(mine)
            with dist.fail_together():
                if lead:
                    done = sorted((b for rank_batches in gathered for b in rank_batches), key=lambda b: b.index)
                    if progress and dist.active:
                        progress(sum(b.num_samples for b in done) - sum(b.num_samples for b in mine))
                    for c in range(first, min(first + dist.world_size, len(chunks))):
                        _write_chunk(plan.out_dir, plan.next_chunk + c,
                                     _concat([b.tables for b in done if b.chunk == c]), image_lookup(config))
                    _tally(report, done)
            if not lead:
                _tally(report, mine)
    with dist.fail_together():
        if lead:
            build_catalog(Workspace(config.workspace))
    report.elapsed_s = time.perf_counter() - started
    return report


def _execution(config: FeatureConfig) -> ExecutionOptions:
    return ExecutionOptions(device=local_device(config.device), dtype=config.dtype,
                            float32_attention=config.float32_attention)


def _load_model(config: FeatureConfig) -> ModelRuntime:
    return load_runtime(config.model, _execution(config))


@dataclass
class _Plan:
    """What rank 0 found before computing: the cache directory and the samples not yet in it."""

    fingerprint: str
    out_dir: Path
    num_samples: int
    todo: list[dict]
    next_chunk: int


@dataclass
class _Batch:
    """One forward batch's rows: what a rank computes and rank 0 gathers."""

    index: int
    chunk: int
    num_samples: int
    tables: dict[str, pa.Table]
    forward_batches: int = 0
    missing_images: list[str] = field(default_factory=list)
    unreadable_images: list[str] = field(default_factory=list)


def _plan(config: FeatureConfig, fingerprint: str, held: ExitStack) -> _Plan:
    """Take the workspace lock (held until ``held`` closes), apply --force, drop unfinished chunks
    and list the samples without cached features."""
    workspace = Workspace(config.workspace)
    samples = workspace.read_table("samples")  # raises a clear error on an empty workspace
    held.enter_context(workspace.lock("ctrl extract-features"))
    out_dir = workspace.features_dir / fingerprint[:16]
    if config.force and out_dir.exists():
        trash = out_dir.with_name(f".trash-{uuid.uuid4().hex}")
        os.rename(out_dir, trash)  # atomic: the cache is either all there or gone
        shutil.rmtree(trash, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob(".tmp-chunk-*"), *out_dir.glob(".stale-chunk-*")]:  # left by an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    # a damaged chunk, or one written before a column of its tables existed (no global_feature),
    # leaves the cache: its samples are computed again
    for chunk in sorted(out_dir.glob("chunk-*")):
        if feature_chunk_problem(chunk) is not None:
            _drop_chunk(out_dir, chunk)
    if config.images_dir is not None:
        _drop_chunks_missing_images(out_dir, image_lookup(config))
    done = cached_keys(out_dir)
    rows = list(samples.select("dataset", "sample_key", "split", "image_id", "question").iter_rows(named=True))
    todo = [r for r in rows if (r["dataset"], r["sample_key"]) not in done]
    # questions on one image next to each other, so that they land in one forward batch and share its image forward
    todo.sort(key=lambda r: (r["dataset"], r["image_id"] or ""))
    # after the highest chunk, not after the count: a deleted chunk must not make a name collide
    indices = [int(c.name.removeprefix("chunk-")) for c in out_dir.glob("chunk-*") if c.name[6:].isdigit()]
    return _Plan(fingerprint, out_dir, len(rows), todo, next_chunk=max(indices, default=-1) + 1)


#: written into every chunk: where its images were looked up
LOOKUP_FILE = "lookup.json"


def image_lookup(config: FeatureConfig) -> dict[str, str | None]:
    """Where this run looks images up (resolved images directory and extra pattern)."""
    return {"images_dir": None if config.images_dir is None else str(Path(config.images_dir).resolve()),
            "image_pattern": config.image_pattern}


def _drop_chunks_missing_images(out_dir: Path, lookup: dict[str, str | None]) -> None:
    """Chunks whose images were looked up elsewhere (or in an unrecorded place) and that hold
    samples with a missing or unreadable image leave the cache, so that their samples are
    computed again with the current lookup; a chunk leaves by one rename (atomic)."""
    for chunk in sorted(out_dir.glob("chunk-*")):
        try:
            recorded = json.loads((chunk / LOOKUP_FILE).read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded == lookup:
            continue
        status = pq.read_table(chunk / "image_features.parquet", columns=["image_status"]).column("image_status")
        if any(s in ("missing", "unreadable") for s in status.to_pylist()):
            _drop_chunk(out_dir, chunk)


def _drop_chunk(out_dir: Path, chunk: Path) -> None:
    """Take a chunk out of the cache with one rename (atomic), then delete it."""
    stale = out_dir / f".stale-chunk-{uuid.uuid4().hex}"
    os.rename(chunk, stale)
    shutil.rmtree(stale, ignore_errors=True)


def _tally(report: FeatureReport, batches: list[_Batch]) -> None:
    for b in batches:
        report.computed += b.num_samples
        report.forward_batches += b.forward_batches
        report.missing_images.extend(b.missing_images)
        report.unreadable_images.extend(b.unreadable_images)


def _concat(batches: list[dict[str, pa.Table]]) -> dict[str, pa.Table]:
    # one contiguous table per file, as if the chunk's rows had been built at once
    return {name: pa.concat_tables([b[name] for b in batches]).combine_chunks() for name in batches[0]}


def _compute_batch(runtime: ModelRuntime, index: int, chunk: int, batch: list[dict], images: ImageIndex,
                   loaded: dict[tuple[str, str], tuple]) -> _Batch:
    fp = runtime.fingerprint
    out = _Batch(index, chunk, len(batch), {})
    image_rows: list[dict] = []
    tiling_rows: list[dict] = []
    lang_rows: list[dict] = []
    with torch.inference_mode():
        lang = runtime.lang_features([r["question"] or "" for r in batch]).float().cpu()
    out.forward_batches += 1
    pending: dict[tuple[str, str], tuple[list[int], object]] = {}  # one forward per distinct image
    for i, r in enumerate(batch):
        prompt_tokens = runtime.preprocess(None, r["question"] or "", 1).num_text_tokens
        lang_rows.append({"dataset": r["dataset"], "sample_key": r["sample_key"], "model_fingerprint": fp,
                          "num_prompt_tokens": prompt_tokens, "feature": lang[i].tolist()})
        row = {"dataset": r["dataset"], "sample_key": r["sample_key"], "model_fingerprint": fp,
               "image_id": r["image_id"], "image_path": None, "image_width": None, "image_height": None,
               "reference_max_crops": REFERENCE_MAX_CROPS, "num_crops": None, "feature": None,
               "global_feature": None}
        image, status = _load(images, loaded, r)
        row["image_status"] = status
        if status in ("missing", "unreadable"):
            lost = out.missing_images if status == "missing" else out.unreadable_images
            lost.append(f"{r['dataset']}:{r['image_id']}")
        if image is not None:
            path, img = image
            row.update(image_path=str(path), image_width=img.width, image_height=img.height)
            for max_crops in TILING_MAX_CROPS:
                rows_, cols = runtime.tiling(img.width, img.height, max_crops)
                tiling_rows.append({"dataset": r["dataset"], "sample_key": r["sample_key"], "model_fingerprint": fp,
                                    "max_crops": max_crops, "rows": rows_, "cols": cols, "num_crops": rows_ * cols})
            key = (r["dataset"], r["image_id"])
            if key not in pending:
                # the image feature does not depend on the question: preprocess with an empty one
                pending[key] = ([], runtime.preprocess(img, "", REFERENCE_MAX_CROPS))
            pending[key][0].append(len(image_rows))
            row["num_crops"] = pending[key][1].num_crops
        image_rows.append(row)
    if pending:
        with torch.inference_mode():  # one vision pass gives both features
            feats = runtime.encode_images([inputs for _, inputs in pending.values()])
        out.forward_batches += 1
        for (indices, _), feat, global_feat in zip(pending.values(), feats.all_tokens, feats.global_crop):
            vector, global_vector = feat.float().tolist(), global_feat.float().tolist()
            for index in indices:
                image_rows[index].update(feature=vector, global_feature=global_vector)
    out.tables = {
        "image_features": _table(IMAGE_FEATURES, image_rows, runtime.image_feature_dim),
        "lang_features": _table(LANG_FEATURES, lang_rows, runtime.lang_feature_dim),
        "image_tilings": _table(IMAGE_TILINGS, tiling_rows, None),
    }
    return out


def _load(images: ImageIndex, loaded: dict, r: dict):
    image_id = r["image_id"]
    if not image_id:
        return None, "no_image_id"
    key = (r["dataset"], image_id)
    if key not in loaded:
        path = images.find(image_id, r["dataset"], r["split"])
        img = open_image(path) if path is not None else None
        loaded[key] = (path, img)
    path, img = loaded[key]
    if path is None:
        return None, "missing"
    if img is None:
        return None, "unreadable"
    return (path, img), "ok"


#: the vector columns of the feature tables, stored as fixed-size lists of the model's width
_VECTOR_COLUMNS = ("feature", "global_feature")


def _table(schema: TableSchema, rows: list[dict], dim: int | None) -> pa.Table:
    arrow = schema.arrow_schema()
    if dim is not None:
        for name in _VECTOR_COLUMNS:
            i = arrow.get_field_index(name)
            if i >= 0:
                arrow = arrow.set(i, pa.field(name, pa.list_(pa.float32(), dim), nullable=arrow.field(i).nullable))
    return pa.Table.from_pylist(rows, schema=arrow)


def _write_chunk(out_dir: Path, index: int, tables: dict[str, pa.Table], lookup: dict[str, str | None]) -> None:
    tmp = out_dir / f".tmp-chunk-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        for name, table in tables.items():
            pq.write_table(table, tmp / f"{name}.parquet", compression="zstd")
        (tmp / LOOKUP_FILE).write_text(json.dumps(lookup) + "\n")
        # content hashes of the chunk's tables, which readers and `ctrl doctor` check
        hashes = {f.name: file_sha256(f) for f in sorted(tmp.glob("*.parquet"))}
        (tmp / CHECKSUM_FILE).write_text(json.dumps(hashes, indent=1) + "\n")
        os.rename(tmp, out_dir / f"chunk-{index:05d}")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise os_error_naming(e, out_dir / f"chunk-{index:05d}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
