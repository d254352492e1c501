"""The violation constraint of offline training: E[latency > budget] <= target at every budget.

Reward shaping alone fixes one exchange rate between accuracy and violations for every budget
and world; a Lagrange multiplier per budget finds the rate that meets the constraint, only
where it is needed (dual ascent).
"""

from __future__ import annotations

import torch

#: the goal's violation ceiling: the share of decisions over budget a deployed controller may make
#: (the fallback's test, the evaluation's plot and table); training aims below it (``violation_target``)
VIOLATION_TARGET = 0.05


class ViolationConstraint:
    """Lagrange multipliers lambda(b) >= 0 on a budget grid for E[latency > b] <= target.

    ``penalty(budgets)`` interpolates lambda linearly between grid points (constant beyond
    the ends); ``update(budgets, violation)`` is one dual-ascent step: per grid point, the
    interpolation-weighted mean of the measured violation probabilities minus the target,
    times ``lr``, clipped to [0, max_value]. Off (``target`` None): lambda stays 0.
    """

    def __init__(self, grid_ms: list[float], target: float | None, lr: float = 1.0, max_value: float = 10.0) -> None:
        self.grid = torch.tensor(sorted(grid_ms), dtype=torch.float64)
        self.values = torch.zeros(len(grid_ms), dtype=torch.float64)
        self.target, self.lr, self.max_value = target, float(lr), float(max_value)

    def weights(self, budgets_ms: torch.Tensor) -> torch.Tensor:
        """(M, K) linear-interpolation weights of each budget on the grid (rows sum to 1)."""
        b = budgets_ms.double()
        k = len(self.grid)
        w = torch.zeros(len(b), k, dtype=torch.float64)
        if k == 1:
            return w + 1.0
        hi = torch.searchsorted(self.grid, b).clamp(1, k - 1)
        lo = hi - 1
        t = ((b - self.grid[lo]) / (self.grid[hi] - self.grid[lo])).clamp(0.0, 1.0)
        rows = torch.arange(len(b))
        w[rows, lo] = 1.0 - t
        w[rows, hi] += t
        return w

    def penalty(self, budgets_ms: torch.Tensor) -> torch.Tensor:
        """lambda at each budget, float32 (M,)."""
        return (self.weights(budgets_ms) @ self.values).float()

    def update(self, budgets_ms: torch.Tensor, violation: torch.Tensor) -> None:
        if self.target is None:
            return
        w = self.weights(budgets_ms)
        mass = w.sum(0)
        seen = mass > 0
        rate = (w * violation.double()[:, None]).sum(0) / mass.clamp_min(1e-12)
        step = self.lr * (rate - self.target)
        self.values = torch.where(seen, (self.values + step).clamp(0.0, self.max_value), self.values)
