"""Safe deployment: the lookup table wherever the controller does not beat it on held-out data.

A learned policy should replace a simple baseline only where held-out data supports it (safe
policy improvement: Thomas et al. 2015, "High-confidence off-policy evaluation"; Laroche et al.
2019, SPIBB). After training, :func:`fit_table_fallback` compares, at every budget of the
validation grid, the controller's greedy decisions with the ``lut_p95`` table's on the
validation split — exactly, since every configuration's outcome is recorded — and keeps the
controller only where its mean reward is at least the table's. At the other budgets the
deployed controller answers with the table's configuration. A budget between grid points
follows the nearest grid point.

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
    use_controller: per grid point, True where the controller's mean validation reward is at
        least the table's.
    controller_reward, table_reward: those mean validation rewards (the evidence, kept for
        inspection).
    table: ``LookupTableDecider.state()`` of the ``lut_p95`` table of the train split.
    """

    grid_ms: list[float]
    use_controller: list[bool]
    controller_reward: list[float]
    table_reward: list[float]
    table: dict[str, Any]

    def __post_init__(self) -> None:
        n = len(self.grid_ms)
        if n == 0 or any(len(x) != n for x in (self.use_controller, self.controller_reward, self.table_reward)):
            raise ValueError(f"`grid_ms`, `use_controller`, `controller_reward` and `table_reward` must have the same "
                             f"non-zero length, got {n}, {len(self.use_controller)}, {len(self.controller_reward)}, "
                             f"{len(self.table_reward)}")
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
                       reward: RewardConfig) -> TableFallback:
    """Compare the controller's and the ``lut_p95`` table's greedy decisions on ``val`` at each budget.

    ``train`` builds the table (as in the evaluation); ``val`` carries the scores the rewards
    are computed from (the training targets, so the comparison sees the same, less noisy,
    scores as the model selection).
    """
    from trainer.baselines import LookupTableDecider
    from trainer.policy import PolicyDecider
    from trainer.reward import compute_reward

    if len(val) == 0:
        raise ValueError("`val` has no samples: the fallback needs held-out data")
    table = LookupTableDecider(train)
    network = PolicyDecider(policy)
    rows = torch.arange(len(val))
    knobs = val.action_space.knob_values().float()
    grid = sorted(float(b) for b in grid_ms)
    keep, ours, theirs = [], [], []
    for budget in grid:
        rewards = compute_reward(val.score, val.latency_ms, torch.full((len(val), 1), budget), knobs[None],
                                 reward)["reward"].double()
        r_ctrl = float(rewards[rows, network.decide(val, budget)].mean())
        r_table = float(rewards[rows, table.decide(val, budget)].mean())
        keep.append(r_ctrl >= r_table)
        ours.append(r_ctrl)
        theirs.append(r_table)
    return TableFallback(grid_ms=grid, use_controller=keep, controller_reward=ours, table_reward=theirs,
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
