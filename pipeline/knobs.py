"""The knob space: the one definition every stage imports.

MolmoE-1B exposes three inference knobs (``origin_formats.md`` §2):

* ``max_crops`` - how many image crops the vision tower sees (plus one global image);
  core_exp and the controllers group crop counts into *tiers*.
* ``top_k`` - how many of the 64 experts each MoE layer routes a token to (default 8).
* ``num_active_blocks`` - how many of the 16 decoder blocks run; which ones is a rule
  (the exp5/exp6 seeded random subset, or importance-based selection).

Nothing here imports torch: ``pipeline`` is the lowest layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

# -- model constants (MolmoE-1B, origin_formats.md §1.1)
NUM_TOTAL_BLOCKS = 16
NUM_EXPERTS = 64
DEFAULT_TOP_K = 8
TOKENS_PER_CROP = 144  # 24x24 patches pooled 2x2

# -- the recorded sweeps
#: exp5/exp6 "balanced" sweep as run by the multi-dataset scripts (§4.5, §4.6).
BALANCED_MAX_CROPS: tuple[int, ...] = (2, 6, 10)
BALANCED_TOP_K: tuple[int, ...] = (4, 8, 12)
BALANCED_NUM_ACTIVE_BLOCKS: tuple[int, ...] = (12, 14, 16)

Tier = Literal["low", "medium", "high"]


@dataclass(frozen=True)
class TierSpec:
    """One core_exp vision-token tier (§2.1)."""

    name: str
    min_crops: int
    max_crops: int
    preferred_crops: tuple[int, ...]
    #: the single max_crops value the controller code uses for this tier
    representative_max_crops: int


TIERS: dict[str, TierSpec] = {
    "low": TierSpec("low", 1, 3, (2, 3), 3),
    "medium": TierSpec("medium", 4, 8, (6, 4, 8), 6),
    "high": TierSpec("high", 9, 15, (12, 9, 15), 12),
}


def vision_tokens_for_crops(num_crops: int) -> int:
    """Theoretical vision-token count for ``num_crops`` crops plus the global image."""
    return (num_crops + 1) * TOKENS_PER_CROP


@lru_cache(maxsize=None)
def exp_active_blocks(num_active_blocks: int, num_total_blocks: int = NUM_TOTAL_BLOCKS) -> tuple[int, ...]:
    """Active block indices that exp5/exp6 used for ``num_active_blocks`` (§2.3).

    Blocks 0-3 are always kept; the rest are drawn from 4..n-1 with NumPy's legacy
    ``RandomState(42 + 1000 * n)``. The subsets are *not* nested across n.
    """
    if not 1 <= num_active_blocks <= num_total_blocks:
        msg = f"num_active_blocks must be in 1..{num_total_blocks}, got {num_active_blocks!r}"
        raise ValueError(msg)
    if num_active_blocks <= 4:
        return tuple(range(num_active_blocks))
    rng = np.random.RandomState(42 + 1000 * num_active_blocks)
    chosen = rng.choice(np.arange(4, num_total_blocks), num_active_blocks - 4, replace=False)
    return tuple(range(4)) + tuple(sorted(int(b) for b in chosen))


def tier_of_max_crops(max_crops: int) -> str:
    """The core_exp tier whose crop range contains ``max_crops``."""
    for spec in TIERS.values():
        if spec.min_crops <= max_crops <= spec.max_crops:
            return spec.name
    msg = f"max_crops {max_crops!r} is outside every tier (1..15)"
    raise ValueError(msg)
