"""``ctrl extract-features``: image and language features per sample, computed once.

Features live in ``workspace/features/<fingerprint>/chunk-NNNNN/`` (one directory per chunk
of samples, renamed into place when complete). A sample is computed at most once per model
fingerprint: later runs skip every sample already in a chunk, so an interrupted run resumes
where it stopped and a finished one does zero forward passes.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.catalog import build_catalog
from pipeline.errors import CacheMismatchError, CtrlError
from pipeline.schema import IMAGE_FEATURES, IMAGE_TILINGS, LANG_FEATURES, TableSchema
from pipeline.workspace import Workspace
from runtime import REFERENCE_MAX_CROPS, ModelRuntime, load_runtime, model_fingerprint
from runtime.images import ImageIndex, open_image

#: max_crops values whose tiling is stored per sample (covers every tier of §2.1)
TILING_MAX_CROPS = tuple(range(1, 16))


@dataclass
class FeatureConfig:
    """Options of ``ctrl extract-features``.

    > Inputs
    workspace: workspace directory (default ``$CTRL_WORKSPACE`` or ``./workspace``).
    images_dir: where images are looked up by image_id (see ``ImageIndex``); None = no images.
    image_pattern: extra file-name pattern, e.g. ``"{dataset}/{image_id}.jpg"``.

    > Model
    model: ``"embedded"`` (built offline from a seed) or a local checkpoint directory.
    device: ``"cpu"`` or ``"cuda"``.

    > Work
    batch_size: requests per forward pass (default 16).
    chunk_size: samples per atomically written chunk (default 256): the resume granularity.
    force: recompute features cached for this model.
    """

    workspace: Path | None = None
    images_dir: Path | None = None
    image_pattern: str | None = None
    model: str = "embedded"
    device: str = "cpu"
    batch_size: int = 16
    chunk_size: int = 256
    force: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            msg = f"batch_size must be >= 1, got {self.batch_size!r}"
            raise CtrlError(msg)
        if self.chunk_size < self.batch_size:
            msg = f"chunk_size ({self.chunk_size}) must be >= batch_size ({self.batch_size})"
            raise CtrlError(msg)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            msg = f"device must be cpu or cuda, got {self.device!r}"
            raise CtrlError(msg)
        if self.images_dir is not None and not Path(self.images_dir).is_dir():
            msg = f"--images {self.images_dir} is not a directory"
            raise CtrlError(msg)


@dataclass
class FeatureReport:
    """What :func:`extract_features` did: samples computed and found cached, forward batches,
    the samples whose image was missing or unreadable, and the time it took."""

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
    """
    started = time.perf_counter()
    workspace = Workspace(config.workspace)
    samples = workspace.read_table("samples")  # raises a clear error on an empty workspace
    with workspace.lock("ctrl extract-features"):
        fingerprint = runtime.fingerprint if runtime is not None else model_fingerprint(config.model)
        out_dir = workspace.features_dir / fingerprint[:16]
        if config.force and out_dir.exists():
            trash = out_dir.with_name(f".trash-{uuid.uuid4().hex}")
            os.rename(out_dir, trash)  # atomic: the cache is either all there or gone
            shutil.rmtree(trash, ignore_errors=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(".tmp-chunk-*"):  # a chunk an interrupted run did not finish
            shutil.rmtree(stale, ignore_errors=True)
        done = cached_keys(out_dir)
        rows = list(samples.select("dataset", "sample_key", "split", "image_id", "question").iter_rows(named=True))
        todo = [r for r in rows if (r["dataset"], r["sample_key"]) not in done]
        report = FeatureReport(fingerprint, num_samples=len(rows), cached=len(rows) - len(todo))
        if on_total:
            on_total(len(todo))
        if todo and runtime is None:  # load the model only when something is left to compute
            runtime = load_runtime(config.model, device=config.device)
            if runtime.fingerprint != fingerprint:
                msg = (f"model {config.model!r} loaded with fingerprint {runtime.fingerprint[:16]}, "
                       f"expected {fingerprint[:16]}")
                raise CacheMismatchError(msg)
        images = ImageIndex(config.images_dir, config.image_pattern)
        next_chunk = len(list(out_dir.glob("chunk-*")))
        for start in range(0, len(todo), config.chunk_size):
            chunk = todo[start:start + config.chunk_size]
            tables = _compute_chunk(runtime, chunk, images, config.batch_size, report, progress)
            _write_chunk(out_dir, next_chunk, tables)
            next_chunk += 1
            report.computed += len(chunk)
    build_catalog(workspace)
    report.elapsed_s = time.perf_counter() - started
    return report


def _compute_chunk(runtime: ModelRuntime, chunk: list[dict], images: ImageIndex, batch_size: int, report: FeatureReport,
                   progress: Callable[[int], None] | None) -> dict[str, pa.Table]:
    fp = runtime.fingerprint
    image_rows: list[dict] = []
    tiling_rows: list[dict] = []
    lang_rows: list[dict] = []
    loaded: dict[tuple[str, str], tuple] = {}  # several questions share an image: decode it once
    for start in range(0, len(chunk), batch_size):
        batch = chunk[start:start + batch_size]
        with torch.inference_mode():
            lang = runtime.lang_features([r["question"] or "" for r in batch]).float().cpu()
        report.forward_batches += 1
        pending: dict[tuple[str, str], tuple[list[int], object]] = {}  # one forward per distinct image
        for i, r in enumerate(batch):
            prompt_tokens = int(runtime.preprocess(None, r["question"] or "", 1).attention_mask.sum())
            lang_rows.append({"dataset": r["dataset"], "sample_key": r["sample_key"], "model_fingerprint": fp,
                              "num_prompt_tokens": prompt_tokens, "feature": lang[i].tolist()})
            row = {"dataset": r["dataset"], "sample_key": r["sample_key"], "model_fingerprint": fp,
                   "image_id": r["image_id"], "image_path": None, "image_width": None, "image_height": None,
                   "reference_max_crops": REFERENCE_MAX_CROPS, "num_crops": None, "feature": None}
            image, status = _load(images, loaded, r, report)
            row["image_status"] = status
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
            with torch.inference_mode():
                feats = runtime.image_features([inputs for _, inputs in pending.values()]).float().cpu()
            report.forward_batches += 1
            for (indices, _), feat in zip(pending.values(), feats):
                vector = feat.tolist()
                for index in indices:
                    image_rows[index]["feature"] = vector
        if progress:
            progress(len(batch))
    return {
        "image_features": _table(IMAGE_FEATURES, image_rows, runtime.image_feature_dim),
        "lang_features": _table(LANG_FEATURES, lang_rows, runtime.lang_feature_dim),
        "image_tilings": _table(IMAGE_TILINGS, tiling_rows, None),
    }


def _load(images: ImageIndex, loaded: dict, r: dict, report: FeatureReport):
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
        report.missing_images.append(f"{r['dataset']}:{image_id}")
        return None, "missing"
    if img is None:
        report.unreadable_images.append(f"{r['dataset']}:{image_id}")
        return None, "unreadable"
    return (path, img), "ok"


def _table(schema: TableSchema, rows: list[dict], dim: int | None) -> pa.Table:
    arrow = schema.arrow_schema()
    if dim is not None:  # store vectors as fixed-size lists of the model's width
        i = arrow.get_field_index("feature")
        arrow = arrow.set(i, pa.field("feature", pa.list_(pa.float32(), dim), nullable=arrow.field(i).nullable))
    return pa.Table.from_pylist(rows, schema=arrow)


def _write_chunk(out_dir: Path, index: int, tables: dict[str, pa.Table]) -> None:
    tmp = out_dir / f".tmp-chunk-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        for name, table in tables.items():
            pq.write_table(table, tmp / f"{name}.parquet", compression="zstd")
        os.rename(tmp, out_dir / f"chunk-{index:05d}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
