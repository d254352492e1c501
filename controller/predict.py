"""``ctrl predict``: the trained controller's decision per (sample, budget) for a workspace's samples.

The checkpoint may come from another workspace: only the feature model must match (its
fingerprint is stored in the checkpoint and compared with the workspace's cached features).
Decisions range over the policy's whole action space (the configurations of its training
data), not only over what this workspace happens to have recorded: that is the decision the
deployed controller would make. The decisions come from :class:`controller.deploy.DeployedController`,
the module ``ctrl export`` writes, with each image's tiling from ``image_tilings``: its ``decide``,
stage 1 and then stage 2 at the chosen crops (:mod:`trainer.greedy`), as a server calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from controller.deploy import DeployedController, cost_basis
from pipeline.catalog import connect, view_names
from pipeline.errors import CtrlError
from pipeline.workspace import Workspace
from trainer.data import read_sample_features, resolve_feature_model
from trainer.fallback import answered_by, read_fallback
from trainer.policy import ControllerPolicy
from trainer.request_table import REQUEST_TABLE
from trainer.runs import resolve_checkpoint, write_frame_atomic

PREDICTION_COLUMNS = ("sample_key", "dataset", "example_id", "budget_ms", "max_crops", "top_k", "num_active_blocks",
                      "probability", "source", "answered_by", "question_group", "expected_latency_ms",
                      "latency_quantile_ms", "cost_basis")

#: every sample of the workspace, in (dataset, sample_key) order: the rows of the feature reader
_SAMPLES_SQL = """
CREATE TEMP TABLE _keys AS
SELECT dataset, sample_key, example_id, (row_number() OVER (ORDER BY dataset, sample_key) - 1)::BIGINT AS row
FROM samples
"""


def read_prediction_inputs(workspace: Workspace, policy: ControllerPolicy) -> dict[str, Any]:
    """Every sample of the workspace with the features the policy reads (its model's, its image
    feature; ``trainer.data.read_sample_features``) and its tiling per max_crops value of the
    policy's action space (NaN where unknown), as tensors."""
    con = connect(workspace)
    try:
        if "samples" not in view_names(con):
            msg = f"workspace {workspace.root} has no samples\nHint: run `ctrl ingest` first."
            raise CtrlError(msg)
        fingerprint = resolve_feature_model(
            con, workspace.root, policy.model_fingerprint, needed_by="the checkpoint was trained on",
            hint="Hint: run `ctrl extract-features` with the checkpoint's model on this workspace, "
                 "or use a checkpoint trained on this model's features.")
        con.execute(_SAMPLES_SQL)
        keys = con.sql("SELECT dataset, sample_key, example_id FROM _keys ORDER BY row").fetchall()
        feats = read_sample_features(con, "_keys", fingerprint, image_feature=policy.config.image_feature,
                                     max_crops_values=policy.action_space.max_crops_values)
    finally:
        con.close()
    dataset, sample_key, example_id = (list(column) for column in zip(*keys)) if keys else ([], [], [])
    image = feats.image if feats.image.shape[1] else np.zeros((len(keys), policy.config.image_feature_dim), np.float32)
    return {"dataset": dataset, "sample_key": sample_key, "example_id": example_id,
            "lang": torch.from_numpy(feats.lang), "image": torch.from_numpy(image),
            "image_present": torch.from_numpy(feats.image_present),
            "tiling_crops": torch.from_numpy(feats.tiling_crops),
            "prompt_tokens": torch.from_numpy(feats.prompt_tokens if feats.prompt_tokens is not None
                                              else np.full(len(keys), np.nan, np.float32))}


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
    the decision is deterministic). ``answered_by`` names who decided: ``controller``, or the table
    that answered (``lut_by_question``, ``lut_by_cluster`` or ``lut_p95``); ``question_group`` the
    question family or cluster the sample reads as under the fallback's table (a family's label, a
    cluster's leading words; null where the table has none). ``expected_latency_ms`` and
    ``latency_quantile_ms`` are what the deployed cost model predicts for this sample at the chosen
    configuration (in the profile's units), ``cost_basis`` what they rest on
    (:func:`controller.deploy.cost_basis`: ``request``, ``extrapolated`` or ``configuration``).

    Raises CacheMismatchError when the workspace's features come from another model than the
    checkpoint's, CtrlError when features are missing or the output suffix is unknown.
    """
    budgets = [float(b) for b in budgets_ms]
    if not budgets or min(budgets) <= 0 or not all(np.isfinite(budgets)):
        msg = (f"budgets must be a non-empty list of finite numbers of milliseconds > 0, got {budgets_ms!r}\n"
               "Hint: --budget-ms 250")
        raise CtrlError(msg)
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    if out is not None and ws.owns(out):
        msg = (f"{out}: refusing to write the predictions over the workspace's own files\n"
               f"Hint: write them outside the workspace's tables, features, fragments and runs ({ws.root}), "
               "e.g. ./decisions.parquet")
        raise CtrlError(msg)
    checkpoint = resolve_checkpoint(ws, run_or_checkpoint)
    policy = ControllerPolicy.load(checkpoint, offline_only=True)
    feats = read_prediction_inputs(ws, policy)
    fallback = read_fallback(checkpoint)
    deployed = DeployedController(policy, fallback)
    inputs = (feats["lang"], feats["image"], feats["image_present"])
    n = len(feats["dataset"])
    names = deployed.group_names()
    group_index = deployed.question_group(feats["lang"]).tolist()
    groups = [names[j] if j >= 0 else None for j in group_index]
    median, quantile, own_cost, far = deployed.expected_latency(feats["lang"], feats["tiling_crops"],
                                                                feats["prompt_tokens"])
    rows = torch.arange(n)
    parts = []
    for budget in budgets:
        budget_vec = torch.full((n,), budget, dtype=torch.float64)
        chosen, by_network = deployed.decide_actions(*inputs, budget_vec, feats["tiling_crops"], feats["prompt_tokens"])
        probability = torch.ones(n, dtype=torch.float64)
        if bool(by_network.any()):
            probs = deployed.probabilities(*inputs, budget_vec, feats["tiling_crops"])
            probability = torch.where(by_network, probs.gather(1, chosen[:, None])[:, 0].double(), probability)
        knobs = deployed.actions[chosen]
        by_table = answered_by(fallback, budget)
        parts.append(pl.DataFrame({
            "sample_key": feats["sample_key"], "dataset": feats["dataset"], "example_id": feats["example_id"],
            "budget_ms": [budget] * n, "max_crops": knobs[:, 0].tolist(), "top_k": knobs[:, 1].tolist(),
            "num_active_blocks": knobs[:, 2].tolist(), "probability": probability.tolist(),
            "source": ["controller" if b else "table" for b in by_network.tolist()],
            # a question unlike every cluster reads as no group: the global table answered it
            "answered_by": ["controller" if b else (by_table if g is not None or by_table == REQUEST_TABLE
                                                    else "lut_p95")
                            for b, g in zip(by_network.tolist(), groups)],
            "question_group": groups,
            "expected_latency_ms": median[rows, chosen].double().tolist(),
            "latency_quantile_ms": quantile[rows, chosen].double().tolist(),
            "cost_basis": [cost_basis(own, beyond) for own, beyond in
                           zip(own_cost[rows, chosen].tolist(), far[rows, chosen].tolist())],
        }, schema={"sample_key": pl.String, "dataset": pl.String, "example_id": pl.String, "budget_ms": pl.Float64,
                   "max_crops": pl.Int64, "top_k": pl.Int64, "num_active_blocks": pl.Int64, "probability": pl.Float64,
                   "source": pl.String, "answered_by": pl.String, "question_group": pl.String,
                   "expected_latency_ms": pl.Float64, "latency_quantile_ms": pl.Float64, "cost_basis": pl.String}))
    frame = pl.concat(parts).sort("dataset", "sample_key", "budget_ms", maintain_order=True)
    if out is not None:
        write_frame_atomic(frame, Path(out))
    return frame
