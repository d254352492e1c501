"""Safe deployment: the lookup table wherever the controller does not beat it on held-out data.

A learned policy should replace a simple baseline only where held-out data supports it (safe
policy improvement: Thomas et al. 2015, "High-confidence off-policy evaluation"; Laroche et al.
2019, SPIBB). After training, :func:`fit_table_fallback` compares, at every budget of the
validation grid, the controller's greedy decisions with the ``lut_p95`` table's on the
validation split — exactly, since every configuration's outcome is recorded — and picks per
budget, as a constrained choice (violations first, then reward):

* both keep the violation rate within ``max_violation_rate`` (the 5 % goal): the controller
  only if its mean reward is strictly higher (a tie is no evidence of improvement);
* only one does: that one;
* neither does: the one with the lower violation rate (the controller on a tie).

At the other budgets the deployed controller answers with the table's configuration. A
budget between grid points follows the nearest grid point.

Where the cached features say little about a sample's outcome (the synthetic worlds), the
policy's per-sample deviations from the table mostly fit training noise and lose to the
table on new samples at some budgets; there the fallback gives the table's accuracy and
violations instead. The raw network stays available (``decider="policy"`` in evaluations)
and the online phase continues the network, not the fallback.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.evaluate import VIOLATION_TARGET

if TYPE_CHECKING:
    from trainer.baselines import LookupTableDecider
    from trainer.data import OfflineData
    from trainer.policy import ControllerPolicy
    from trainer.reward import RewardConfig

__all__ = ["TableFallback", "attach_fallback", "fit_table_fallback", "read_fallback"]


@dataclass
class TableFallback:
    """Which budgets the controller keeps, and the table that answers at the others.

    grid_ms: the validation grid, ascending (ms).
    use_controller: per grid point, True where the controller decides (the rule in the
        module docstring), False where the table answers.
    controller_reward, table_reward: those mean validation rewards;
    controller_violation_rate, table_violation_rate: the validation share of decisions over
        budget (the evidence, kept for inspection).
    max_violation_rate: the violation rate a decider must keep to be preferred on reward.
    table: ``LookupTableDecider.state()`` of the ``lut_p95`` table of the train split.
    """

    grid_ms: list[float]
    use_controller: list[bool]
    controller_reward: list[float]
    table_reward: list[float]
    controller_violation_rate: list[float]
    table_violation_rate: list[float]
    max_violation_rate: float
    table: dict[str, Any]

    def __post_init__(self) -> None:
        n = len(self.grid_ms)
        per_budget = (self.use_controller, self.controller_reward, self.table_reward, self.controller_violation_rate,
                      self.table_violation_rate)
        if n == 0 or any(len(x) != n for x in per_budget):
            raise ValueError(f"`grid_ms` and the per-budget lists (use_controller, rewards, violation rates) must have "
                             f"the same non-zero length, got {n} and {[len(x) for x in per_budget]}")
        if list(self.grid_ms) != sorted(self.grid_ms):
            raise ValueError(f"`grid_ms` must be ascending, got {self.grid_ms!r}")

    def controller_at(self, budget_ms: torch.Tensor) -> torch.Tensor:
        """bool, shape of ``budget_ms``: True where the controller decides (nearest grid point)."""
        grid = torch.tensor(self.grid_ms, dtype=torch.float64)
        b = torch.as_tensor(budget_ms, dtype=torch.float64)
        nearest = (b[..., None] - grid).abs().argmin(-1)
        return torch.tensor(self.use_controller, dtype=torch.bool)[nearest]

    def lookup_table(self) -> LookupTableDecider:
        from trainer.baselines import LookupTableDecider

        return LookupTableDecider.from_state(self.table)

    @property
    def fallback_budgets_ms(self) -> list[float]:
        """The grid budgets where the table answers."""
        return [b for b, keep in zip(self.grid_ms, self.use_controller) if not keep]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TableFallback:
        return cls(**d)


@torch.no_grad()
def fit_table_fallback(policy: ControllerPolicy, train: OfflineData, val: OfflineData, grid_ms: list[float],
                       reward: RewardConfig, max_violation_rate: float = VIOLATION_TARGET) -> TableFallback:
    """Choose, per budget of ``grid_ms``, between the controller and the ``lut_p95`` table on ``val``.

    ``train`` builds the table (as in the evaluation); ``val`` carries the scores the rewards
    are computed from (the training targets, so the comparison sees the same, less noisy,
    scores as the model selection). The rule is in the module docstring.
    """
    from trainer.baselines import LookupTableDecider
    from trainer.policy import PolicyDecider
    from trainer.reward import compute_reward

    if len(val) == 0:
        raise ValueError("`val` has no samples: the fallback needs held-out data")
    if not 0.0 <= max_violation_rate <= 1.0:
        raise ValueError(f"`max_violation_rate` must be in [0, 1], got {max_violation_rate!r}")
    table = LookupTableDecider(train)
    network = PolicyDecider(policy)
    rows = torch.arange(len(val))
    knobs = val.action_space.knob_values().float()
    grid = sorted(float(b) for b in grid_ms)
    out: dict[str, list] = {k: [] for k in ("keep", "r_ctrl", "r_table", "v_ctrl", "v_table")}
    for budget in grid:
        rewards = compute_reward(val.score, val.latency_ms, torch.full((len(val), 1), budget), knobs[None],
                                 reward)["reward"].double()
        ours, theirs = network.decide(val, budget), table.decide(val, budget)
        r_ctrl, r_table = float(rewards[rows, ours].mean()), float(rewards[rows, theirs].mean())
        v_ctrl = float((val.latency_ms[rows, ours] > budget).double().mean())
        v_table = float((val.latency_ms[rows, theirs] > budget).double().mean())
        ok_ctrl, ok_table = v_ctrl <= max_violation_rate, v_table <= max_violation_rate
        if ok_ctrl and ok_table:
            keep = r_ctrl > r_table
        elif ok_ctrl or ok_table:
            keep = ok_ctrl
        else:
            keep = v_ctrl <= v_table
        for key, value in zip(out, (keep, r_ctrl, r_table, v_ctrl, v_table)):
            out[key].append(value)
    return TableFallback(grid_ms=grid, use_controller=out["keep"], controller_reward=out["r_ctrl"],
                         table_reward=out["r_table"], controller_violation_rate=out["v_ctrl"],
                         table_violation_rate=out["v_table"], max_violation_rate=float(max_violation_rate),
                         table=table.state())


def read_fallback(checkpoint: Any) -> TableFallback | None:
    """The fallback stored in a controller checkpoint (None: trained without one)."""
    from trainer.policy import read_checkpoint

    stored = read_checkpoint(checkpoint).get("fallback")
    return None if stored is None else TableFallback.from_json(stored)


def attach_fallback(checkpoint: Any, fallback: TableFallback) -> None:
    """Store ``fallback`` in an existing checkpoint (atomically rewritten, everything else kept)."""
    from pathlib import Path

    from trainer.policy import atomic_torch_save, read_checkpoint

    payload = read_checkpoint(checkpoint)
    payload["fallback"] = fallback.to_json()
    atomic_torch_save(payload, Path(checkpoint))
