"""What a simulation draws its requests from: the run's unseen samples with their recorded latency and
score at every configuration, their features (what the controller reads), the configurations' reference
latencies, and the profile's accuracy-latency front.

The unseen samples are those the deployed controller did not learn from: a run's held-out dataset
where it has one; else, for a cross-fitted run (whose deployed network also trains on the test split),
the validation split (its checkpoint and table fallback were chosen on it, nothing was fitted to it);
else the test split. Only samples recorded at every configuration of the action space are drawn, so
that any choice has an outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from pipeline.errors import CtrlError
from pipeline.knobs import Config
from pipeline.workspace import Workspace
from trainer.config import OfflineTrainConfig
from trainer.data import OfflineData, hold_out_dataset, load_offline_data
from trainer.runs import RunDir


@dataclass(frozen=True)
class SimProfile:
    """The unseen samples of a run (arrays of N rows) and its action space (A configurations)."""

    run_id: str
    split: str  # what the samples are: "dataset:<name>", "val" or "test"
    example_id: tuple[str | None, ...]  # per sample, its id in its dataset
    configs: tuple[Config, ...]
    latency_ms: np.ndarray  # (N, A) the recorded model latency of each sample at each configuration
    score: np.ndarray  # (N, A) the recorded score
    lang: torch.Tensor  # (N, Dl)
    tiling: torch.Tensor  # (N, C) crops at each max_crops choice (NaN without an image)
    image: torch.Tensor  # (N, Di) the global crop's feature
    image_present: np.ndarray  # (N,)
    prompt_tokens: np.ndarray  # (N,) NaN where unknown
    front: tuple[Config, ...]  # the profile's accuracy-latency front on the samples the run learned from
    train_accuracy: dict[Config, float]
    train_latency_ms: dict[Config, float]  # median

    def __len__(self) -> int:
        return int(self.latency_ms.shape[0])

    def median_latency_ms(self) -> dict[Config, float]:
        """Per configuration, the median recorded latency of these samples: what a served request log's
        model times are compared with to read the machine's latency scale."""
        medians = np.median(self.latency_ms, axis=0)
        return {c: float(m) for c, m in zip(self.configs, medians, strict=True)}

    def log_spread(self) -> dict[Config, float]:
        """Per configuration, the standard deviation of the log of these samples' recorded latency."""
        logs = np.log(np.maximum(self.latency_ms, 1e-9))
        return {c: float(sd) for c, sd in zip(self.configs, logs.std(axis=0), strict=True)}

    @cached_property
    def _row_of(self) -> dict[str, int]:
        """Each example id held by exactly one sample, and its row (an id two samples share names neither)."""
        rows: dict[str, int] = {}
        shared: set[str] = set()
        for row, example in enumerate(self.example_id):
            if example is None:
                continue
            if example in rows:
                shared.add(example)
            rows[example] = row
        return {k: v for k, v in rows.items() if k not in shared}

    def sample_latency_ms(self, example_id: str, config: Config) -> float | None:
        """The recorded latency of the sample ``example_id`` at ``config``; None where no one sample has that id
        or the profile lacks the configuration."""
        row = self._row_of.get(example_id)
        config = tuple(int(v) for v in config)
        if row is None or config not in self.configs:
            return None
        return float(self.latency_ms[row, self.configs.index(config)])

    def column(self, config: Config) -> int:
        """The column of ``config``; a one-line error where the profile lacks it."""
        try:
            return self.configs.index(tuple(int(v) for v in config))
        except ValueError:
            known = ", ".join("/".join(map(str, c)) for c in self.configs[:6])
            msg = (f"the profile has no configuration {'/'.join(map(str, config))} (crops/top-K/blocks): no latency or "
                   f"score to simulate it with\nHint: profiled configurations include {known}, ...")
            raise CtrlError(msg) from None


def pareto_front(accuracy: dict[Config, float], latency_ms: dict[Config, float]) -> tuple[Config, ...]:
    """The configurations no other beats on both (higher or equal accuracy at lower or equal latency, one
    of them strictly), by latency."""
    front = []
    for c in accuracy:
        dominated = any(accuracy[o] >= accuracy[c] and latency_ms[o] <= latency_ms[c]
                        and (accuracy[o] > accuracy[c] or latency_ms[o] < latency_ms[c]) for o in accuracy if o != c)
        if not dominated:
            front.append(c)
    return tuple(sorted(front, key=lambda c: (latency_ms[c], c)))


def unseen_rows(data: OfflineData, config: OfflineTrainConfig, samples: str | None = None
                ) -> tuple[list[int], str, list[int]]:
    """(the unseen samples' rows, what they are, the rows the run learned from). ``samples``: a dataset
    named by the caller as one the run never learned from (a request set profiled after training)."""
    if samples is not None:
        if samples not in set(data.dataset):
            known = ", ".join(sorted(set(data.dataset)))
            msg = f"--samples {samples!r}: no such dataset in the workspace's profile (it has: {known})"
            raise CtrlError(msg)
        unseen = [i for i, d in enumerate(data.dataset) if d == samples]
        learned = [i for i, d in enumerate(data.dataset) if d != samples and data.split[i] == "train"]
        return unseen, f"dataset:{samples} (given)", learned
    if config.holdout_dataset:
        unseen = [i for i, d in enumerate(data.dataset) if d == config.holdout_dataset]
        learned = [i for i, d in enumerate(data.dataset) if d != config.holdout_dataset
                   and data.split[i] == "train"]
        return unseen, f"dataset:{config.holdout_dataset}", learned
    split = "val" if config.cross_fit_folds else "test"
    unseen = [i for i, s in enumerate(data.split) if s == split]
    learned = [i for i, s in enumerate(data.split) if s == "train"]
    return unseen, split, learned


def load_profile(workspace: Workspace, run: RunDir, data: OfflineData | None = None,
                 samples: str | None = None) -> SimProfile:
    """The :class:`SimProfile` of an offline ``run`` (``samples``: :func:`unseen_rows`); a one-line error
    where it has no unseen sample recorded at every configuration."""
    config = OfflineTrainConfig.from_json(run.read_config())
    if data is None:
        data = load_offline_data(workspace, config.model_fingerprint)
    if config.holdout_dataset:
        hold_out_dataset(data, config.holdout_dataset)  # the dataset must exist (its own error otherwise)
    unseen, split, learned = unseen_rows(data, config, samples)
    if not unseen:
        msg = (f"run {run.run_id}: no unseen samples to draw requests from (its {split} split is empty)\n"
               "Hint: ingest more samples, or simulate a run trained with --holdout-dataset.")
        raise CtrlError(msg)
    mask = data.mask.numpy()
    complete = [i for i in unseen if mask[i].all()]
    if not complete:
        msg = (f"run {run.run_id}: none of its {len(unseen)} unseen ({split}) samples is recorded at every "
               f"configuration of the action space ({mask.shape[1]}), so a choice could have no outcome")
        raise CtrlError(msg)
    configs = tuple(tuple(int(v) for v in a) for a in data.action_space.actions)
    latency, score = data.latency_ms.numpy(), data.score.numpy()
    learned_mask = mask[learned] if learned else mask
    learned_rows = learned if learned else list(range(len(data)))
    accuracy, median = {}, {}
    for j, c in enumerate(configs):
        rows = [r for r, ok in zip(learned_rows, learned_mask[:, j], strict=True) if ok]
        if rows:
            accuracy[c] = float(np.mean(score[rows, j]))
            median[c] = float(np.median(latency[rows, j]))
    idx = torch.tensor(complete)
    tiling = data.tiling_crops[idx] if data.tiling_crops is not None else torch.full(
        (len(complete), len(data.action_space.max_crops_values)), float("nan"))
    prompt = (data.prompt_tokens[idx].numpy() if data.prompt_tokens is not None
              else np.full(len(complete), np.nan, dtype=np.float32))
    return SimProfile(run.run_id, split, tuple(data.example_id[i] for i in complete), configs,
                      latency[complete].astype(np.float64),
                      score[complete].astype(np.float64), data.lang_features[idx], tiling.float(),
                      data.image_features[idx], data.image_present[idx].numpy(), prompt.astype(np.float64),
                      pareto_front(accuracy, median), accuracy, median)
