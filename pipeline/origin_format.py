"""The origin's exp5 / exp6 results-file format: names and summary statistics.

One definition for everything that reads or writes these trees: ingest matches file names
with the patterns below, ``ctrl profile`` and the synthetic generator build names with the
functions below (``docs/origin_format.md`` §4.2, §4.3).

Layout of one dataset (``<slug>`` = the dataset name with ``_`` replaced by ``-``)::

    exp5_accuracy_<slug>/exp5_accuracy_results_crops{C}_topk{K}_blocks{B}[_rank{r}].json
    exp5_accuracy_<slug>/exp5_accuracy_results.json
    exp6_latency_<slug>/exp6_latency_crops{C}_topk{K}_blocks{B}[_rank{r}].json
    exp6_latency_<slug>/exp6_latency_results.json
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

#: directory name prefixes: the origin appends the dataset name, ``_`` replaced by ``-``
EXP5_DIR_PREFIX = "exp5_accuracy_"
EXP6_DIR_PREFIX = "exp6_latency_"
EXP5_FINAL_NAME = "exp5_accuracy_results.json"
EXP6_FINAL_NAME = "exp6_latency_results.json"
#: ``config.note`` of a per-configuration file merged from all ranks
MERGE_NOTE = "Merged results from all ranks"

EXP5_CONFIG_RE = re.compile(r"^exp5_accuracy_results_crops(\d+)_topk(\d+)_blocks(\d+)(?:_rank(\d+))?\.json$")
EXP5_FINAL_RE = re.compile(r"^exp5_accuracy_results\.json$")
EXP6_CONFIG_RE = re.compile(r"^exp6_latency_crops(\d+)_topk(\d+)_blocks(\d+)(?:_rank(\d+))?\.json$")
EXP6_FINAL_RE = re.compile(r"^exp6_latency_results\.json$")
CORE_EXP_RE = re.compile(
    r"^(.+)_imgsizetier-(low|medium|high)_crops(\d+)_topk(\d+)_blocks(\d+)(?:_rank(\d+))?\.json$")
RANK_SUFFIX_RE = re.compile(r"_rank\d+\.json$")

RESULT_NAME_PATTERNS = (EXP5_CONFIG_RE, EXP5_FINAL_RE, EXP6_CONFIG_RE, EXP6_FINAL_RE, CORE_EXP_RE)


def looks_like_results_name(name: str) -> bool:
    """True when a file name follows one of the origin scripts' naming schemes."""
    return any(p.match(name) for p in RESULT_NAME_PATTERNS)


def exp5_name(max_crops: int, top_k: int, num_active_blocks: int, rank: int | None = None) -> str:
    """``exp5_accuracy_results_crops{C}_topk{K}_blocks{B}[_rank{r}].json`` (no rank: the merged file)."""
    suffix = "" if rank is None else f"_rank{rank}"
    return f"exp5_accuracy_results_crops{max_crops}_topk{top_k}_blocks{num_active_blocks}{suffix}.json"


def exp6_name(max_crops: int, top_k: int, num_active_blocks: int, rank: int | None = None) -> str:
    """``exp6_latency_crops{C}_topk{K}_blocks{B}[_rank{r}].json`` (no rank: the merged file)."""
    suffix = "" if rank is None else f"_rank{rank}"
    return f"exp6_latency_crops{max_crops}_topk{top_k}_blocks{num_active_blocks}{suffix}.json"


def dataset_dir_names(dataset: str) -> tuple[str, str]:
    """The exp5 and exp6 directory names of one dataset (the origin appends the dataset, ``_`` -> ``-``)."""
    slug = dataset.replace("_", "-")
    return EXP5_DIR_PREFIX + slug, EXP6_DIR_PREFIX + slug


def latency_statistics(values: Sequence[float]) -> dict[str, float]:
    """The origin's ``compute_statistics`` (§3.1): P50 / P95 / P99 (linear), mean, population std,
    min and max; ``{}`` for no values."""
    if len(values) == 0:
        return {}
    a = np.asarray(values, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"P50": float(p50), "P95": float(p95), "P99": float(p99), "mean": float(a.mean()),
            "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}


def accuracy_mean_std(scores: Sequence[float], empty: float | None = None) -> tuple[float | None, float | None]:
    """A summary's accuracy and (population) std; ``(empty, empty)`` for no scores.

    The origin writes NaN for a configuration that processed no samples (``empty=math.nan``);
    ``ctrl profile`` writes null.
    """
    if len(scores) == 0:
        return empty, empty
    a = np.asarray(scores, dtype=np.float64)
    return float(a.mean()), float(a.std())


__all__ = [
    "CORE_EXP_RE", "EXP5_CONFIG_RE", "EXP5_DIR_PREFIX", "EXP6_DIR_PREFIX", "EXP5_FINAL_NAME", "EXP5_FINAL_RE",
    "EXP6_CONFIG_RE", "EXP6_FINAL_NAME", "EXP6_FINAL_RE", "MERGE_NOTE", "RANK_SUFFIX_RE", "accuracy_mean_std",
    "dataset_dir_names", "exp5_name", "exp6_name", "latency_statistics", "looks_like_results_name",
]
