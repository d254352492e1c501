"""What the online phase reads from a workspace: questions, reference answers, images and the
cached features of the model being run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pipeline.catalog import connect, view_names
from pipeline.errors import CacheMismatchError, CtrlError
from pipeline.workspace import Workspace
from runtime.base import ModelRuntime
from runtime.images import ImageIndex
from trainer.data import GLOBAL_IMAGE_FEATURE, check_image_feature_column, split_of

_HINT_FEATURES = "Hint: run `ctrl extract-features` with the same --model first."


@dataclass
class OnlineSamples:
    """N samples (sorted by dataset, sample_key) with everything a rollout needs.

    lang (N, Dl) and image (N, Di) float32 are the cached features, image the global-crop one
    (``image_features.global_feature``, what stage 2 reads offline and what a request's own vision
    pass gives, ``PrefixState.image_feature``); image_present (N,) bool is False where the sample
    has no readable image (image_path None too).
    """

    dataset: list[str]
    sample_key: list[str]
    split: list[str | None]
    question: list[str]
    answers: list[list[str]]
    image_path: list[str | None]
    lang: torch.Tensor
    image: torch.Tensor
    image_present: torch.Tensor
    model_fingerprint: str
    image_size: list[tuple[int, int] | None] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_key)

    def tiling_crops(self, runtime: ModelRuntime, max_crops_values: tuple[int, ...]) -> torch.Tensor:
        """(N, C) float: crops of each sample's image at each max_crops value (NaN without an image).

        From the image size alone (the runtime's tiling rule), as at feature extraction."""
        out = torch.full((len(self), len(max_crops_values)), float("nan"))
        for i, size in enumerate(self.image_size):
            if size is not None:
                for j, c in enumerate(max_crops_values):
                    rows, cols = runtime.tiling(size[0], size[1], c)
                    out[i, j] = rows * cols
        return out

    def rows(self, split: str) -> list[int]:
        """Indices of the samples in a controller split (``trainer.data.split_of``: by sample key)."""
        return [i for i in range(len(self)) if split_of(self.dataset[i], self.sample_key[i]) == split]


def load_online_samples(workspace: Workspace, model_fingerprint: str, images_dir: Path | None = None) -> OnlineSamples:
    """Samples of the workspace with language features of ``model_fingerprint``.

    Images: ``images_dir`` (looked up by image_id as ``ctrl extract-features`` does) when given,
    else the path recorded at feature extraction. Samples without reference answers or without
    a question cannot be scored and are skipped (counted in ``skipped``).
    """
    if images_dir is not None and not images_dir.is_dir():
        msg = f"--images {images_dir}: not a directory"
        raise CtrlError(msg)
    skipped = {"no_answers": 0, "no_question": 0}
    kept = []
    for r in _read_samples(workspace, model_fingerprint).to_pylist():
        if not r["question"]:
            skipped["no_question"] += 1
        elif not r["answers"]:
            skipped["no_answers"] += 1
        else:
            kept.append(r)
    if not kept:
        msg = (f"workspace {workspace.root}: no sample with a question, reference answers and features "
               f"of model {model_fingerprint[:16]}")
        raise CtrlError(msg)
    paths = _image_paths(kept, images_dir)
    lang = np.asarray([r["lang_feature"] for r in kept], dtype=np.float32)
    image_dim = next((len(r["image_feature"]) for r in kept if r["image_feature"] is not None), 0)
    image = np.zeros((len(kept), image_dim), dtype=np.float32)
    present = np.zeros(len(kept), dtype=bool)
    for i, r in enumerate(kept):
        if r["image_feature"] is not None and paths[i] is not None:
            image[i] = r["image_feature"]
            present[i] = True
    return OnlineSamples(
        dataset=[r["dataset"] for r in kept], sample_key=[r["sample_key"] for r in kept],
        split=[r["split"] for r in kept], question=[r["question"] for r in kept],
        answers=[list(r["answers"]) for r in kept], image_path=[p if present[i] else None for i, p in enumerate(paths)],
        lang=torch.from_numpy(lang), image=torch.from_numpy(image), image_present=torch.from_numpy(present),
        model_fingerprint=model_fingerprint, skipped={k: v for k, v in skipped.items() if v},
        image_size=[(int(r["image_width"]), int(r["image_height"])) if present[i] and r["image_width"] else None
                    for i, r in enumerate(kept)])


def _read_samples(workspace: Workspace, model_fingerprint: str) -> pa.Table:
    """Every sample with its question, answers, language feature and (where extracted) image feature and path."""
    con = connect(workspace)
    try:
        views = view_names(con)
        if "samples" not in views:
            msg = f"workspace {workspace.root} has no samples\nHint: run `ctrl ingest` first."
            raise CtrlError(msg)
        if "lang_features" not in views:
            msg = f"workspace {workspace.root} has no cached features\n{_HINT_FEATURES}"
            raise CtrlError(msg)
        cached = [r[0] for r in con.sql("SELECT DISTINCT model_fingerprint FROM lang_features").fetchall()]
        if model_fingerprint not in cached:
            listing = ", ".join(fp[:16] for fp in cached) or "none"
            msg = (f"no features of model {model_fingerprint[:16]} in {workspace.root} "
                   f"(cached: {listing})\n{_HINT_FEATURES}")
            raise CacheMismatchError(msg)
        if "image_features" in views:
            check_image_feature_column(con, model_fingerprint)
            image_cols = f"i.image_path, i.image_width, i.image_height, i.{GLOBAL_IMAGE_FEATURE} AS image_feature"
            image_join = ("LEFT JOIN image_features i ON i.dataset = s.dataset AND i.sample_key = s.sample_key "
                          "AND i.model_fingerprint = $fp")
        else:
            image_cols = ("NULL::VARCHAR AS image_path, NULL::INT AS image_width, NULL::INT AS image_height, "
                          "NULL::FLOAT[] AS image_feature")
            image_join = ""
        return con.sql(f"""
            SELECT s.dataset, s.sample_key, s.split, s.question, s.answers, s.image_id, l.feature AS lang_feature,
                   {image_cols}
            FROM samples s
            JOIN lang_features l ON l.dataset = s.dataset AND l.sample_key = s.sample_key AND l.model_fingerprint = $fp
            {image_join}
            ORDER BY s.dataset, s.sample_key""", params={"fp": model_fingerprint}).to_arrow_table()
    finally:
        con.close()


def _image_paths(rows: list[dict], images_dir: Path | None) -> list[str | None]:
    """Each sample's image file: looked up in ``images_dir`` by image_id, else the path recorded at
    feature extraction (only where that extraction read the image)."""
    index = ImageIndex(images_dir) if images_dir is not None else None
    paths: list[str | None] = []
    for r in rows:
        if index is not None and r["image_id"] is not None:
            found = index.find(str(r["image_id"]), r["dataset"], r["split"])
            paths.append(str(found) if found is not None else None)
        else:
            paths.append(r["image_path"] if r["image_feature"] is not None else None)
    return paths
