"""What the online phase reads from a workspace: questions, reference answers, images and the
cached features of the model being run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipeline.catalog import connect, view_names
from pipeline.errors import CtrlError
from pipeline.workspace import Workspace
from runtime.base import ModelRuntime
from runtime.images import ImageIndex
from trainer.data import SampleFeatures, read_sample_features, resolve_feature_model, split_of

_HINT_FEATURES = "Hint: run `ctrl extract-features` with the same --model on this workspace first."


@dataclass
class OnlineSamples:
    """N samples (sorted by dataset, sample_key) with everything a rollout needs.

    lang (N, Dl) and image (N, Di) float32 are the cached features, image the global-crop one
    (``image_features.global_feature``, what stage 2 reads offline and what a request's own vision
    pass gives, ``PrefixState.image_feature``); image_present (N,) bool is False where the sample
    has no readable image (image_path None too); prompt_tokens (N,) float32 the text tokens of its
    formatted prompt (``lang_features.num_prompt_tokens``; NaN where unknown).
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
    prompt_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens is None:
            self.prompt_tokens = torch.full((len(self.sample_key),), float("nan"))

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
    """Samples of the workspace with their cached features of ``model_fingerprint``
    (``trainer.data.read_sample_features``: every sample must have them).

    Images: ``images_dir`` (looked up by image_id as ``ctrl extract-features`` does) when given,
    else the path recorded at feature extraction. Samples without reference answers or without
    a question cannot be scored and are skipped (counted in ``skipped``).
    """
    if images_dir is not None and not images_dir.is_dir():
        msg = f"--images {images_dir}: not a directory"
        raise CtrlError(msg)
    rows, feats = _read_samples(workspace, model_fingerprint)
    skipped = {"no_answers": 0, "no_question": 0}
    kept = []
    for i, r in enumerate(rows):
        if not r["question"]:
            skipped["no_question"] += 1
        elif not r["answers"]:
            skipped["no_answers"] += 1
        else:
            kept.append(i)
    if not kept:
        msg = (f"workspace {workspace.root}: no sample with a question, reference answers and features "
               f"of model {model_fingerprint[:16]}")
        raise CtrlError(msg)
    paths = _image_paths([rows[i] for i in kept], [feats.image_path[i] for i in kept], images_dir)
    present = np.array([bool(feats.image_present[i]) and path is not None for i, path in zip(kept, paths)],
                       dtype=bool)
    image = np.where(present[:, None], feats.image[kept], np.float32(0.0)).astype(np.float32)
    return OnlineSamples(
        dataset=[rows[i]["dataset"] for i in kept], sample_key=[rows[i]["sample_key"] for i in kept],
        split=[rows[i]["split"] for i in kept], question=[rows[i]["question"] for i in kept],
        answers=[list(rows[i]["answers"]) for i in kept],
        image_path=[p if present[j] else None for j, p in enumerate(paths)],
        lang=torch.from_numpy(np.ascontiguousarray(feats.lang[kept])), image=torch.from_numpy(image),
        image_present=torch.from_numpy(present), model_fingerprint=model_fingerprint,
        skipped={k: v for k, v in skipped.items() if v},
        image_size=[feats.image_size[i] if present[j] else None for j, i in enumerate(kept)],
        prompt_tokens=None if feats.prompt_tokens is None else torch.from_numpy(
            np.ascontiguousarray(feats.prompt_tokens[kept], dtype=np.float32)))


#: the workspace's samples, in (dataset, sample_key) order: the rows of the feature reader
_SAMPLES_SQL = """
CREATE TEMP TABLE _online AS
SELECT dataset, sample_key, split, question, answers, image_id,
       (row_number() OVER (ORDER BY dataset, sample_key) - 1)::BIGINT AS row
FROM samples
"""


def _read_samples(workspace: Workspace, model_fingerprint: str) -> tuple[list[dict], SampleFeatures]:
    """Every sample with its question, answers and image id, and its cached features (image path included)."""
    con = connect(workspace)
    try:
        if "samples" not in view_names(con):
            msg = f"workspace {workspace.root} has no samples\nHint: run `ctrl ingest` first."
            raise CtrlError(msg)
        fingerprint = resolve_feature_model(con, workspace.root, model_fingerprint,
                                            needed_by="the model being run needs", hint=_HINT_FEATURES)
        con.execute(_SAMPLES_SQL)
        rows = con.sql("SELECT dataset, sample_key, split, question, answers, image_id FROM _online "
                       "ORDER BY row").to_arrow_table().to_pylist()
        return rows, read_sample_features(con, "_online", fingerprint)
    finally:
        con.close()


def _image_paths(rows: list[dict], recorded: list[str | None], images_dir: Path | None) -> list[str | None]:
    """Each sample's image file: looked up in ``images_dir`` by image_id, else the path recorded at
    feature extraction (``recorded``: only where that extraction read the image)."""
    index = ImageIndex(images_dir) if images_dir is not None else None
    paths: list[str | None] = []
    for r, path in zip(rows, recorded):
        if index is not None and r["image_id"] is not None:
            found = index.find(str(r["image_id"]), r["dataset"], r["split"])
            paths.append(str(found) if found is not None else None)
        else:
            paths.append(path)
    return paths
