"""``ctrl predict``: the trained controller's decision per (sample, budget) for a workspace's samples.

The checkpoint may come from another workspace: only the feature model must match (its
fingerprint is stored in the checkpoint and compared with the workspace's cached features).
Decisions range over the policy's whole action space (the configurations of its training
data), not only over what this workspace happens to have recorded: that is the decision the
deployed controller would make. The decisions come from :class:`trainer.deploy.DeployedController`,
the module ``ctrl export`` writes, with each image's tiling from ``image_tilings``: its ``decide``,
stage 1 and then stage 2 at the chosen crops (:mod:`trainer.greedy`), as a server calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from pipeline.catalog import connect, view_names
from pipeline.errors import CacheMismatchError, CtrlError
from pipeline.workspace import Workspace
from trainer.deploy import DeployedController
from trainer.fallback import read_fallback
from trainer.policy import ControllerPolicy
from trainer.runs import resolve_checkpoint, write_frame_atomic

PREDICTION_COLUMNS = ("sample_key", "dataset", "example_id", "budget_ms", "max_crops", "top_k", "num_active_blocks",
                      "probability", "source")

_LANG_SQL = """
SELECT s.dataset, s.sample_key, s.example_id, l.feature AS lang, {image} AS image
FROM samples s
LEFT JOIN (FROM lang_features WHERE model_fingerprint = $fp
           QUALIFY row_number() OVER (PARTITION BY dataset, sample_key) = 1) l USING (dataset, sample_key)
{join}
ORDER BY s.dataset, s.sample_key
"""
_IMAGE_JOIN = """LEFT JOIN (FROM image_features WHERE model_fingerprint = $fp AND feature IS NOT NULL
           QUALIFY row_number() OVER (PARTITION BY dataset, sample_key) = 1) i USING (dataset, sample_key)"""


def _read_features(workspace: Workspace, fingerprint: str, image_dim: int,
                   max_crops_values: tuple[int, ...]) -> dict[str, Any]:
    """Every sample of the workspace with its features of model ``fingerprint`` and its tiling
    per ``max_crops_values`` entry (NaN where unknown)."""
    con = connect(workspace)
    try:
        views = view_names(con)
        if "lang_features" not in views:
            msg = (f"workspace {workspace.root} has no cached features\n"
                   "Hint: run `ctrl extract-features --images DIR` first.")
            raise CtrlError(msg)
        cached = [r[0] for r in con.sql("SELECT DISTINCT model_fingerprint FROM lang_features ORDER BY 1").fetchall()]
        if fingerprint not in cached:
            listing = ", ".join(fp[:16] for fp in cached)
            msg = (f"the checkpoint was trained on features of model {fingerprint[:16]}, but workspace "
                   f"{workspace.root} has features of model {listing} only\n"
                   "Hint: run `ctrl extract-features` with the checkpoint's model on this workspace, "
                   "or use a checkpoint trained on this model's features.")
            raise CacheMismatchError(msg)
        has_images = "image_features" in views
        sql = _LANG_SQL.format(image="i.feature" if has_images else "NULL::FLOAT[]",
                               join=_IMAGE_JOIN if has_images else "")
        table = con.sql(sql, params={"fp": fingerprint}).to_arrow_table()
        tilings = None
        if "image_tilings" in views:
            tilings = con.sql("SELECT dataset, sample_key, max_crops, any_value(num_crops) AS num_crops "
                              "FROM image_tilings WHERE model_fingerprint = $fp GROUP BY ALL",
                              params={"fp": fingerprint}).fetchall()
    finally:
        con.close()
    lang = table.column("lang").to_pylist()
    keys = zip(table.column("dataset").to_pylist(), table.column("sample_key").to_pylist(), lang)
    missing = [f"{d}/{k}" for d, k, f in keys if f is None]
    if missing:
        msg = (f"{len(missing)} of {len(lang)} samples have no language features for model {fingerprint[:16]} "
               f"(first: {', '.join(missing[:3])})\nHint: run `ctrl extract-features` on this workspace.")
        raise CtrlError(msg)
    image = table.column("image").to_pylist()
    present = np.array([f is not None for f in image], dtype=bool)
    image_mat = np.zeros((len(image), image_dim), dtype=np.float32)
    if present.any():
        image_mat[present] = np.asarray([f for f in image if f is not None], dtype=np.float32)
    dataset, sample_key = table.column("dataset").to_pylist(), table.column("sample_key").to_pylist()
    tiling_mat = np.full((len(lang), len(max_crops_values)), np.nan, dtype=np.float32)
    if tilings:
        row_of = {key: i for i, key in enumerate(zip(dataset, sample_key))}
        column_of = {value: j for j, value in enumerate(max_crops_values)}
        for d, k, max_crops, num_crops in tilings:
            i, j = row_of.get((d, k)), column_of.get(max_crops)
            if i is not None and j is not None and num_crops is not None:
                tiling_mat[i, j] = num_crops
    return {"dataset": dataset, "sample_key": sample_key, "example_id": table.column("example_id").to_pylist(),
            "lang": torch.from_numpy(np.asarray(lang, dtype=np.float32).reshape(len(lang), -1)),
            "image": torch.from_numpy(image_mat), "image_present": torch.from_numpy(present),
            "tiling_crops": torch.from_numpy(tiling_mat)}


@torch.inference_mode()
def predict(workspace: Workspace | str | Path | None, run_or_checkpoint: str | Path, budgets_ms: list[float],
            out: str | Path | None) -> pl.DataFrame:
    """One greedy decision per (sample, budget) for every sample of ``workspace``.

    ``run_or_checkpoint``: a run id of ``workspace``, a run directory (its best checkpoint) or a
    checkpoint file. Returns (and writes to ``out``, .parquet or .csv, unless None) a frame with
    ``PREDICTION_COLUMNS``, sorted by dataset, sample_key, budget_ms; ``source`` is
    ``"controller"`` (the network decided; ``probability`` = pi(decision | sample, budget) under the
    joint policy, in (0, 1]; the sequential decision need not be pi's mode) or ``"table"`` (the
    checkpoint's table fallback answers at this budget, ``trainer.fallback``; ``probability`` = 1:
    the decision is deterministic).

    Raises CacheMismatchError when the workspace's features come from another model than the
    checkpoint's, CtrlError when features are missing or the output suffix is unknown.
    """
    budgets = [float(b) for b in budgets_ms]
    if not budgets or min(budgets) <= 0 or not all(np.isfinite(budgets)):
        msg = f"budgets must be a non-empty list of positive numbers (ms), got {budgets_ms!r}\nHint: --budget-ms 250"
        raise CtrlError(msg)
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    if out is not None and ws.owns(out):
        msg = (f"{out}: refusing to write the predictions over the workspace's own files\n"
               f"Hint: write them outside the workspace's tables, features, fragments and runs ({ws.root}), "
               "e.g. ./decisions.parquet")
        raise CtrlError(msg)
    checkpoint = resolve_checkpoint(ws, run_or_checkpoint)
    policy = ControllerPolicy.load(checkpoint, offline_only=True)
    feats = _read_features(ws, policy.model_fingerprint, policy.config.image_feature_dim,
                           policy.action_space.max_crops_values)
    deployed = DeployedController(policy, read_fallback(checkpoint))
    inputs = (feats["lang"], feats["image"], feats["image_present"])
    n = len(feats["dataset"])
    parts = []
    for budget in budgets:
        budget_vec = torch.full((n,), budget, dtype=torch.float64)
        chosen, by_network = deployed.decide_actions(*inputs, budget_vec, feats["tiling_crops"])
        probability = torch.ones(n, dtype=torch.float64)
        if bool(by_network.any()):
            probs = deployed.probabilities(*inputs, budget_vec, feats["tiling_crops"])
            probability = torch.where(by_network, probs.gather(1, chosen[:, None])[:, 0].double(), probability)
        knobs = deployed.actions[chosen]
        parts.append(pl.DataFrame({
            "sample_key": feats["sample_key"], "dataset": feats["dataset"], "example_id": feats["example_id"],
            "budget_ms": [budget] * n, "max_crops": knobs[:, 0].tolist(), "top_k": knobs[:, 1].tolist(),
            "num_active_blocks": knobs[:, 2].tolist(), "probability": probability.tolist(),
            "source": ["controller" if b else "table" for b in by_network.tolist()],
        }, schema={"sample_key": pl.String, "dataset": pl.String, "example_id": pl.String, "budget_ms": pl.Float64,
                   "max_crops": pl.Int64, "top_k": pl.Int64, "num_active_blocks": pl.Int64, "probability": pl.Float64,
                   "source": pl.String}))
    frame = pl.concat(parts).sort("dataset", "sample_key", "budget_ms", maintain_order=True)
    if out is not None:
        write_frame_atomic(frame, Path(out))
    return frame
