"""The knob space: the one definition every stage imports.

MolmoE-1B exposes three inference knobs (``docs/origin_format.md`` §2):

* ``max_crops`` - how many image crops the vision tower sees (plus one global image);
  core_exp and the controllers group crop counts into *tiers*.
* ``top_k`` - how many of the 64 experts each MoE layer routes a token to (default 8).
* ``num_active_blocks`` - how many of the 16 decoder blocks run; which ones is a rule
  (the exp5/exp6 seeded random subset, or importance-based selection).

Nothing here imports torch: ``pipeline`` is the lowest layer.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np

# -- model constants (MolmoE-1B, docs/origin_format.md §1.1)
NUM_TOTAL_BLOCKS = 16
NUM_EXPERTS = 64
DEFAULT_TOP_K = 8
TOKENS_PER_CROP = 144  # 24x24 patches pooled 2x2
#: the largest max_crops the tiling rule's range covers (what a request's fixed knobs may ask for)
MAX_CROPS_LIMIT = 15

# -- the recorded sweeps
#: exp6 ``run()`` defaults (§4.3): the value lists the sparse strategies pick from
EXP6_MAX_CROPS: tuple[int, ...] = (2, 4, 6, 8, 10)
EXP6_TOP_K: tuple[int, ...] = (4, 8, 12)
EXP6_NUM_ACTIVE_BLOCKS: tuple[int, ...] = (12, 13, 14, 15, 16)
#: the "balanced" sweep of those lists, as run by the multi-dataset scripts (§4.5, §4.6)
BALANCED_MAX_CROPS: tuple[int, ...] = (2, 6, 10)
BALANCED_TOP_K: tuple[int, ...] = (4, 8, 12)
BALANCED_NUM_ACTIVE_BLOCKS: tuple[int, ...] = (12, 14, 16)

Config = tuple[int, int, int]  # (max_crops, top_k, num_active_blocks)


def balanced_combinations(max_crops: tuple[int, ...], top_k: tuple[int, ...], blocks: tuple[int, ...]) -> list[Config]:
    """The "balanced" sparse strategy (§4.5): first / middle / last of each list (all of a list
    with fewer than 3 values), all combinations. A single value per list is that one
    configuration (the origin skips the strategy then, to the same effect).
    """
    def pick(xs: tuple[int, ...]) -> list[int]:
        return list(dict.fromkeys((xs[0], xs[len(xs) // 2], xs[-1])))
    return list(itertools.product(pick(max_crops), pick(top_k), pick(blocks)))

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



# -- Knob1: crops. The Molmo tiling rule (docs/origin_format.md §2.1)
#: MolmoE-1B geometry: 336-px crops, 4-patch (56 px) margins on each side -> 224-px window
MOLMO_CROP_WINDOW_PX = 224
MOLMO_TOTAL_MARGIN_PX = 112


def tiling_candidates(max_crops: int) -> np.ndarray:
    """All (rows, cols) with rows * cols <= max_crops, fewest crops first (ties favour fewer crops)."""
    if max_crops < 1:
        msg = f"max_crops must be >= 1, got {max_crops!r}"
        raise ValueError(msg)
    tilings = [(i, j) for i in range(1, max_crops + 1) for j in range(1, max_crops + 1) if i * j <= max_crops]
    tilings.sort(key=lambda t: (t[0] * t[1], t[0]))
    return np.array(tilings, dtype=np.int32)


def select_tiling(height: int | np.ndarray, width: int | np.ndarray, max_crops: int, *,
                  window_px: int = MOLMO_CROP_WINDOW_PX,
                  total_margin_px: int = MOLMO_TOTAL_MARGIN_PX) -> tuple[np.ndarray, np.ndarray] | tuple[int, int]:
    """Molmo's tiling rule for image sizes (scalars or arrays); returns (rows, cols).

    If every candidate tiling needs downscaling, take the one with the largest scale;
    otherwise the least upscaling. The margin is subtracted first and scales are float32,
    as in Molmo. The image is then resized to (rows*window+margin, cols*window+margin).
    """
    cand = tiling_candidates(max_crops)
    res = (cand * window_px).astype(np.float32)
    # float64 first: unsigned sizes under the margin must go negative, not wrap around
    h = (np.atleast_1d(np.asarray(height, dtype=np.float64)) - total_margin_px).astype(np.float32)
    w = (np.atleast_1d(np.asarray(width, dtype=np.float64)) - total_margin_px).astype(np.float32)
    # Molmo does not clamp: a side equal to the margin gives an infinite scale (the other side decides),
    # a side under it a negative one (every tiling then counts as downscaling and (1, 1) wins)
    with np.errstate(divide="ignore"):
        scale = np.minimum(res[None, :, 0] / h[:, None], res[None, :, 1] / w[:, None])
    all_down = np.all(scale < 1, axis=1)
    ix = np.where(all_down, np.argmax(scale, axis=1), np.argmin(np.where(scale < 1.0, np.float32(1e10), scale), axis=1))
    rows, cols = cand[ix, 0], cand[ix, 1]
    if np.ndim(height) == 0 and np.ndim(width) == 0:
        return int(rows[0]), int(cols[0])
    return rows, cols


# -- Knob3: which blocks run. Importance-based selection (docs/origin_format.md §2.3, §6)


def load_importance_scores(path: str | Path) -> dict[int, float]:
    """Read a §6 importance file: a flat {block: score} object, or one wrapped in
    ``merged_scores`` / ``train_scores`` / ``importance_scores``. Non-integer keys are dropped."""
    data = json.loads(Path(path).read_text())
    for wrapper in ("merged_scores", "train_scores", "importance_scores"):
        if isinstance(data.get(wrapper), dict):
            data = data[wrapper]
            break
    scores: dict[int, float] = {}
    for key, value in data.items():
        try:
            block = int(key)
        except (TypeError, ValueError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scores[block] = float(value)
    if not scores:
        msg = f"{path}: no integer block keys with numeric scores"
        raise ValueError(msg)
    return scores


def select_active_blocks(num_active_blocks: int, num_total_blocks: int = NUM_TOTAL_BLOCKS,
                         scores: dict[int, float] | None = None, *, first_kept: int = 1) -> tuple[int, ...]:
    """Blocks that run when ``num_active_blocks`` of ``num_total_blocks`` are kept.

    Block 0 always runs (it embeds the image features and anchors the KV cache). With
    ``scores``, the other blocks are kept by descending score (ties: lower index; blocks
    absent from the file score -inf, i.e. go first). Without scores the documented default
    drops blocks from the second-to-last backwards (n-2, n-3, ...), keeping block 0 and the
    final block: deep-middle blocks are the most redundant in decoder LMs, and the final
    block feeds the output norm. Both rules are nested: fewer blocks is a subset of more.

    ``first_kept``: blocks 0..first_kept-1 always run (the two-stage controller's insertion
    position: those blocks ran before stage 2 chose the block count); the rule ranks only
    the blocks after them.
    """
    if not 1 <= first_kept <= num_total_blocks:
        msg = f"first_kept must be in 1..{num_total_blocks}, got {first_kept!r}"
        raise ValueError(msg)
    if not first_kept <= num_active_blocks <= num_total_blocks:
        msg = f"num_active_blocks must be in {first_kept}..{num_total_blocks}, got {num_active_blocks!r}"
        raise ValueError(msg)
    others = list(range(first_kept, num_total_blocks))
    if scores is None:
        # keep order: the final block first, then the others in order (so n-2, n-3, ... are dropped first)
        ranked = sorted(others, key=lambda b: (b != num_total_blocks - 1, b))
    else:
        ranked = sorted(others, key=lambda b: (-scores.get(b, -math.inf), b))
    return tuple(sorted(list(range(first_kept)) + ranked[: num_active_blocks - first_kept]))


# -- the two-stage controller's insertion position (docs/origin_format.md §2.3, §7.3)
#: stage 2 runs after the first p blocks, p in 1..5
INSERTION_POSITIONS: tuple[int, ...] = (1, 2, 3, 4, 5)


def insertion_block_options(insertion_position: int, num_total_blocks: int = NUM_TOTAL_BLOCKS) -> tuple[int, ...]:
    """Total active-block counts stage 2 may choose after insertion position p (§2.3).

    With R = num_total_blocks - p blocks after the insertion point, s of them are kept,
    s from max(num_total_blocks - 5, R - 4) to min(num_total_blocks - 1, R). For p >= 1 that
    is num_total_blocks - 5 .. R, so the totals p + s run from p + num_total_blocks - 5 to
    num_total_blocks: p = 1 -> 12..16, 2 -> 13..16, 3 -> 14..16, 4 -> 15..16, 5 -> 16, and
    none from p = 6 on.
    """
    if not 1 <= insertion_position < num_total_blocks:
        msg = f"insertion position must be in 1..{num_total_blocks - 1}, got {insertion_position!r}"
        raise ValueError(msg)
    return tuple(range(insertion_position + num_total_blocks - 5, num_total_blocks + 1))
