"""The budget range of an online run on this machine, measured.

Recorded budgets mean nothing for a model on another machine, and the online request itself
costs more than a profiled ``generate`` (two controller stages, the split prefill, the budget
token). :func:`calibrate_budget_range` runs the fastest and the slowest configuration on a few
training samples; continuing an offline run, each end of that run's range is scaled by its own
configuration's measured / recorded latency ratio in the tail (90th percentiles), the low end no
lower than what the fastest configuration measurably meets here; else the range is [p95 of the
fastest, p95 of the slowest].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from online.data import OnlineSamples
from online.rollout import RolloutExecutor
from pipeline.errors import CtrlError
from pipeline.knobs import Config
from pipeline.workspace import Workspace
from runtime import ModelRuntime
from trainer.data import load_offline_data
from trainer.two_stage import TwoStageController

#: the quantile at which measured and recorded latencies are compared: in the tail where the range's
#: ends live, and still estimated from the 32 samples x 2 runs of a default calibration
TAIL_QUANTILE = 0.9
#: the share of samples on which the fastest configuration must meet the low end: the offline range's
#: own definition of its low end (``trainer.data.default_budget_range``)
FLOOR_QUANTILE = 0.98
#: the headroom above that quantile: the range is served minutes after it is measured, and a shared
#: machine's speed moves by a tenth or more in between (docs/online.md#budget-range-on-this-machine)
FLOOR_MARGIN = 1.1


def calibration_rows(train_rows: list[int], samples: int, seed: int) -> list[int]:
    """``samples`` of ``train_rows`` drawn with ``seed`` (in their order), or all of them when fewer:
    a draw, not the first rows, because the low end reads the tail of the fastest configuration's
    latencies, which a block of neighbouring rows can miss."""
    if samples >= len(train_rows):
        return list(train_rows)
    chosen = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed))[:samples]
    return [train_rows[i] for i in sorted(chosen.tolist())]


def calibration_configs(controller: TwoStageController) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Knob indices (crops, insertion, top-K, blocks) of the fastest and the slowest configuration."""
    c_lo, c_hi = 0, len(controller.max_crops_values) - 1
    positions = controller.insertion_positions
    valid = controller.blocks_valid
    fastest_p = next(i for i in range(len(positions)) if bool(valid[i, 0])) if bool(valid[:, 0].any()) else 0
    b_lo = int(valid[fastest_p].float().argmax())
    fastest = (c_lo, fastest_p, 0, b_lo)
    slowest_p = next(i for i in range(len(positions)) if bool(valid[i, -1]))
    slowest = (c_hi, slowest_p, len(controller.top_k_values) - 1, valid.shape[1] - 1)
    return fastest, slowest


def calibrate_budget_range(executor: RolloutExecutor, controller: TwoStageController, rows: list[int],
                           reference: BudgetReference | None = None) -> tuple[float, float]:
    """The budget range on this machine, measured with the fastest and the slowest configuration on ``rows``.

    Each configuration runs twice per sample, the two configurations alternating so that they see
    the same machine. With a ``reference`` (the parent offline run's range and the recorded
    latencies of these samples), each end of that offline range is scaled by its own
    configuration's speed ratio here: the ratio of the ``TAIL_QUANTILE`` quantiles of measured
    and recorded latency over the same samples and configuration (the low end by the fastest
    configuration's, the high end by the slowest's: the offline ends are tail statistics of
    those two, a 98th and a 95th percentile). The tail, not the median, because a machine can
    stretch long requests more than short ones: where decoding is dearer, a long answer's
    latency grows by more than a one-word answer's, and a median ratio then sets budgets that
    even the fastest configuration misses on the long answers. Measuring the same samples keeps
    a few of them enough; a ratio per end, not one for both, because the two-stage request adds
    a roughly constant cost (controller, split prefill) that weighs more on fast configurations
    than on slow ones. The scaled low end is then raised, where needed, to the floor this machine
    measures: ``FLOOR_MARGIN`` times the ``FLOOR_QUANTILE`` quantile of the fastest configuration's
    latency over all its calibration runs. A ratio estimated in the tail can still put the low end
    below what the fastest configuration meets here, and a budget no configuration meets can only
    be missed. Every run counts, the slow moments of a shared machine too: a served request meets
    them as well, and on such a machine they, not the samples, make the tail. The margin because
    the range is used minutes and hours after it is measured, and a shared machine's speed moves
    by a tenth or more in between. Without a reference (fresh runs, nothing recorded): [p95 of the
    fastest, p95 of the slowest].
    """
    configs = dict(zip(("fastest", "slowest"), calibration_configs(controller)))
    # every run of both rounds counts, not the fastest of each: the range must hold for the requests
    # a shared machine serves, whose speed drifts within seconds
    runs: dict[str, list] = {name: [] for name in configs}
    for _ in range(2):
        for name, force in configs.items():
            runs[name].extend(executor.run_fixed(rows, force))
    lat, ratio = {}, {}
    for name, out in runs.items():
        lat[name] = np.array([r.latency_total_ms for r in out])
        if reference is not None:
            knobs = (out[0].max_crops, out[0].top_k, out[0].num_active_blocks)
            recorded = np.array([reference.recorded_ms(row, knobs) for row in rows] * 2)
            ok = np.isfinite(recorded) & (recorded > 0)
            if ok.any():
                here, there = np.quantile(lat[name][ok], TAIL_QUANTILE), np.quantile(recorded[ok], TAIL_QUANTILE)
                ratio[name] = float(here / there)
    if len(ratio) == 2:
        lo, hi = reference.range_ms[0] * ratio["fastest"], reference.range_ms[1] * ratio["slowest"]
        lo = max(lo, FLOOR_MARGIN * float(np.quantile(lat["fastest"], FLOOR_QUANTILE)))
    else:
        lo, hi = float(np.quantile(lat["fastest"], 0.95)), float(np.quantile(lat["slowest"], 0.95))
    if not hi > lo * 1.05:  # the knobs barely move latency here: still give the budget some range
        hi = lo * 1.5
    return round(lo, 1), round(hi, 1)


@dataclass
class BudgetReference:
    """What the calibration compares with: an offline run's budget range and the recorded latencies.

    range_ms: the offline run's training budget range (its config.json). ``recorded_ms(row,
    (max_crops, top_k, num_active_blocks))``: the ``groups`` view's latency of online sample
    ``row`` under that configuration (NaN where not recorded).
    """

    range_ms: tuple[float, float]
    latency_ms: dict[tuple[str, str, int, int, int], float]
    keys: list[tuple[str, str]]

    def recorded_ms(self, row: int, knobs: Config) -> float:
        return self.latency_ms.get((*self.keys[row], *knobs), float("nan"))


def budget_reference(workspace: Workspace, runtime: ModelRuntime, samples: OnlineSamples,
                     parent_config: dict) -> BudgetReference | None:
    """The reference for an offline parent run (None when the workspace recorded no latencies)."""
    try:
        data = load_offline_data(workspace, runtime.fingerprint)
    except CtrlError:
        return None
    actions = data.action_space.actions
    latency: dict[tuple[str, str, int, int, int], float] = {}
    wanted = set(zip(samples.dataset, samples.sample_key))
    for i, key in enumerate(zip(data.dataset, data.sample_key)):
        if key in wanted:
            row = data.latency_ms[i].tolist()
            for a, knobs in enumerate(actions):
                latency[(*key, *knobs)] = row[a]
    if not latency:
        return None
    return BudgetReference(range_ms=(float(parent_config["budget_min_ms"]), float(parent_config["budget_max_ms"])),
                           latency_ms=latency, keys=list(zip(samples.dataset, samples.sample_key)))
