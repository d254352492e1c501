"""Offline training data: the recorded configuration groups plus cached features, as tensors.

One row per sample, one column per action (a recorded configuration). Everything a later
stage needs (policy, GRPO, baselines, evaluation) is in :class:`OfflineData`; it is read
from the workspace views by :func:`load_offline_data` and split by sample with
:func:`split_of`, so a sample's configurations never cross splits.

The one latency definition is the ``groups`` view's ``latency_total_ms``: the exp6
per-sample total (whole generate call); where exp6 lacks the sample, the configuration's
exp6 median (``latency_is_sample`` is False there, so the substitution stays visible).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import torch

from pipeline.catalog import connect, view_names
from pipeline.errors import CacheMismatchError, CtrlError
from pipeline.knobs import Config
from pipeline.workspace import Workspace

if TYPE_CHECKING:
    import duckdb

Action = Config  # (max_crops, top_k, num_active_blocks)

SPLITS = ("train", "val", "test")
DEFAULT_SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
KNOB_NAMES = ("max_crops", "top_k", "num_active_blocks")
#: metadata keys that name a sample's question family, first recorded wins: ``family`` (the
#: testbed task and the synthetic generator), then VQA v2's ``question_type`` and ``answer_type``
FAMILY_KEYS = ("family", "question_type", "answer_type")

#: the image feature the controller's stage 2 reads (``image_features.global_feature``): the
#: global crop's tokens, which a server's own vision pass yields at whatever crops stage 1 chose
GLOBAL_IMAGE_FEATURE = "global_feature"
#: the reference feature (``image_features.feature``): all tokens at the reference crop count,
#: which a server never computes; read only to measure what the global one costs
REFERENCE_IMAGE_FEATURE = "feature"
IMAGE_FEATURE_COLUMNS = (GLOBAL_IMAGE_FEATURE, REFERENCE_IMAGE_FEATURE)

__all__ = ["FAMILY_KEYS", "GLOBAL_IMAGE_FEATURE", "IMAGE_FEATURE_COLUMNS", "REFERENCE_IMAGE_FEATURE", "SPLITS",
           "Action", "ActionSpace", "OfflineData", "budget_grid", "check_image_feature_column", "default_budget_range",
           "SampleFeatures", "family_of", "hold_out_dataset", "load_offline_data", "nonempty_split",
           "read_sample_features", "resolve_feature_model", "split_of", "training_targets"]


# -- the action space ---------------------------------------------------------------------

@dataclass(frozen=True)
class ActionSpace:
    """The configurations recorded in the data, sorted; an action is an index into ``actions``.

    The joint space is kept explicit (not a full product of the knob values) because a
    sweep need not be a product; ``knob_indices`` maps each action onto per-knob value
    lists so that factorized heads (crops first, then top_k and blocks) can be built.
    """

    actions: tuple[Action, ...]

    def __post_init__(self) -> None:
        actions = tuple(tuple(int(v) for v in a) for a in self.actions)
        if not actions:
            msg = "`actions` must not be empty"
            raise ValueError(msg)
        if any(len(a) != 3 for a in actions):
            msg = f"`actions` must be (max_crops, top_k, num_active_blocks) triples, got {self.actions!r}"
            raise ValueError(msg)
        if list(actions) != sorted(set(actions)):
            msg = f"`actions` must be sorted and unique, got {self.actions!r}"
            raise ValueError(msg)
        object.__setattr__(self, "actions", actions)  # normalised (from_json gives lists)

    def __len__(self) -> int:
        return len(self.actions)

    def _values(self, knob: int) -> tuple[int, ...]:
        return tuple(sorted({a[knob] for a in self.actions}))

    @property
    def max_crops_values(self) -> tuple[int, ...]:
        return self._values(0)

    @property
    def top_k_values(self) -> tuple[int, ...]:
        return self._values(1)

    @property
    def num_active_blocks_values(self) -> tuple[int, ...]:
        return self._values(2)

    @cached_property
    def _index(self) -> dict[Action, int]:
        return {a: i for i, a in enumerate(self.actions)}

    def index(self, action: Action) -> int:
        """Position of ``action``; KeyError naming it when it is not in the space."""
        key = tuple(int(v) for v in action)
        try:
            return self._index[key]
        except KeyError:
            msg = f"configuration {key!r} is not in the action space ({len(self)} recorded configurations)"
            raise KeyError(msg) from None

    def knob_indices(self) -> torch.Tensor:
        """LongTensor (A, 3): per action, the index of each knob value in ``*_values``."""
        lists = (self.max_crops_values, self.top_k_values, self.num_active_blocks_values)
        return torch.tensor([[lists[j].index(a[j]) for j in range(3)] for a in self.actions], dtype=torch.long)

    def knob_values(self) -> torch.Tensor:
        """FloatTensor (A, 3): the raw (max_crops, top_k, num_active_blocks) of each action."""
        return torch.tensor(self.actions, dtype=torch.float32)

    def label(self, index: int) -> str:
        """``"C/K/B"``, the key of configuration histograms."""
        return "/".join(str(v) for v in self.actions[index])

    def to_json(self) -> dict[str, Any]:
        return {"knobs": list(KNOB_NAMES), "actions": [list(a) for a in self.actions]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ActionSpace:
        knobs = d.get("knobs", list(KNOB_NAMES))
        if list(knobs) != list(KNOB_NAMES):
            msg = f"action space knobs must be {list(KNOB_NAMES)}, got {knobs!r}"
            raise ValueError(msg)
        return cls(tuple(tuple(a) for a in d["actions"]))


# -- the data -----------------------------------------------------------------------------

@dataclass
class OfflineData:
    """Features and recorded outcomes of N samples over the A actions of ``action_space``.

    Shapes and dtypes (checked on construction):
    image_features float32 (N, Di), zeros where the image is missing; image_present bool (N,);
    lang_features float32 (N, Dl); score float32 (N, A), NaN where not recorded;
    latency_ms float32 (N, A), NaN where no latency; latency_is_sample bool (N, A), True for
    the exp6 per-sample latency, False for the configuration-level p50 substitute (and
    where there is no latency); mask bool (N, A): recorded with a score AND a latency, the
    only actions allowed for the sample (every row has at least one).
    mean_score float32 (N, A) or None: the mean of the exp5 and exp6 scores where both were
    recorded for the (sample, configuration), else ``score``: two independent runs of the same
    configuration, so half the outcome noise of one (None = the same as ``score``).
    tiling_crops float32 (N, C) or None: per sample and per ``action_space.max_crops_values``
    entry, the crops (rows * cols) the feature model's preprocessor tiles the image into
    (``image_tilings``); NaN where unknown (no readable image). It depends on the image size
    only, so even stage 1 (before the vision tower) may read it: a direct latency predictor.
    family: per sample, its question family (the first of ``FAMILY_KEYS`` recorded in the sample's
    metadata, see :func:`family_of`), None where none is; None when no sample has one.
    image_feature: the ``image_features`` column ``image_features`` holds (``GLOBAL_IMAGE_FEATURE``,
        what stage 2 reads in deployment; ``REFERENCE_IMAGE_FEATURE`` only for comparisons). A
        policy records it and is applied only to data of the same feature.
    question: per sample, its question text (``samples.question``), None where none is; None when
        the data carries no text (in-memory data). Only names question clusters for people.
    prompt_tokens float32 (N,) or None: the text tokens of the sample's formatted prompt
        (``lang_features.num_prompt_tokens``), NaN where unknown; known before any decision.
    output_tokens float32 (N, A) or None: the tokens the recorded run generated (exp6
        ``num_output_tokens``, EOS included), NaN where not recorded; an outcome, like the latency.
    request_latency_ms float32 (N, A) or None: each request's predicted median latency at every
        configuration from a per-request cost model that did not see the request (out of fold): what a
        policy that reads the cost model (``PolicyConfig.use_request_cost``) reads in place of its own
        model's prediction. The trainer sets it on its training rows; None = the policy predicts.
    """

    action_space: ActionSpace
    model_fingerprint: str
    dataset: list[str]
    sample_key: list[str]
    example_id: list[str | None]
    split: list[str]
    image_features: torch.Tensor
    image_present: torch.Tensor
    lang_features: torch.Tensor
    score: torch.Tensor
    latency_ms: torch.Tensor
    latency_is_sample: torch.Tensor
    mask: torch.Tensor
    tiling_crops: torch.Tensor | None = None
    mean_score: torch.Tensor | None = None
    family: list[str | None] | None = None
    image_feature: str = GLOBAL_IMAGE_FEATURE
    question: list[str | None] | None = None
    prompt_tokens: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None
    request_latency_ms: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, a = len(self.dataset), len(self.action_space)
        if self.image_feature not in IMAGE_FEATURE_COLUMNS:
            msg = f"`image_feature` must be one of {IMAGE_FEATURE_COLUMNS}, got {self.image_feature!r}"
            raise ValueError(msg)
        for name in ("sample_key", "example_id", "split"):
            if len(getattr(self, name)) != n:
                msg = f"`{name}` has {len(getattr(self, name))} entries, `dataset` has {n}"
                raise ValueError(msg)
        bad_split = set(self.split) - set(SPLITS)
        if bad_split:
            msg = f"`split` values must be in {SPLITS}, got {sorted(bad_split)!r}"
            raise ValueError(msg)
        _check("image_features", self.image_features, torch.float32, (n, None))
        _check("image_present", self.image_present, torch.bool, (n,))
        _check("lang_features", self.lang_features, torch.float32, (n, None))
        for name in ("score", "latency_ms"):
            _check(name, getattr(self, name), torch.float32, (n, a))
        for name in ("latency_is_sample", "mask"):
            _check(name, getattr(self, name), torch.bool, (n, a))
        if self.tiling_crops is not None:
            _check("tiling_crops", self.tiling_crops, torch.float32, (n, len(self.action_space.max_crops_values)))
        if self.mean_score is not None:
            _check("mean_score", self.mean_score, torch.float32, (n, a))
        if self.prompt_tokens is not None:
            _check("prompt_tokens", self.prompt_tokens, torch.float32, (n,))
        for name in ("output_tokens", "request_latency_ms"):
            if getattr(self, name) is not None:
                _check(name, getattr(self, name), torch.float32, (n, a))
        if self.question is not None and len(self.question) != n:
            msg = f"`question` has {len(self.question)} entries, `dataset` has {n}"
            raise ValueError(msg)
        if self.family is not None:
            if len(self.family) != n:
                msg = f"`family` has {len(self.family)} entries, `dataset` has {n}"
                raise ValueError(msg)
            bad = next((f for f in self.family if f is not None and not isinstance(f, str)), None)
            if bad is not None:
                msg = f"`family` entries must be str or None, got {type(bad).__name__}"
                raise TypeError(msg)

    def scores(self, kind: str = "recorded") -> torch.Tensor:
        """The (N, A) scores of one definition: ``"recorded"`` (``score``, the groups view's
        score) or ``"mean"`` (``mean_score``; ``score`` where the data has no mean_score)."""
        if kind == "recorded":
            return self.score
        if kind == "mean":
            return self.score if self.mean_score is None else self.mean_score
        msg = f"score kind must be 'recorded' or 'mean', got {kind!r}"
        raise ValueError(msg)

    def __len__(self) -> int:
        return len(self.dataset)

    def select(self, rows: torch.Tensor | Sequence[int]) -> OfflineData:
        """The samples at ``rows`` (indices or a bool mask of length N), same action space."""
        index = torch.as_tensor(rows)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        elif index.numel() == 0:
            index = index.long()  # torch.as_tensor([]) is float, which cannot index
        idx = index.tolist()
        return OfflineData(
            action_space=self.action_space, model_fingerprint=self.model_fingerprint,
            dataset=[self.dataset[i] for i in idx], sample_key=[self.sample_key[i] for i in idx],
            example_id=[self.example_id[i] for i in idx], split=[self.split[i] for i in idx],
            image_features=self.image_features[index], image_present=self.image_present[index],
            lang_features=self.lang_features[index], score=self.score[index], latency_ms=self.latency_ms[index],
            latency_is_sample=self.latency_is_sample[index], mask=self.mask[index],
            tiling_crops=None if self.tiling_crops is None else self.tiling_crops[index],
            mean_score=None if self.mean_score is None else self.mean_score[index],
            family=None if self.family is None else [self.family[i] for i in idx],
            image_feature=self.image_feature,
            question=None if self.question is None else [self.question[i] for i in idx],
            prompt_tokens=None if self.prompt_tokens is None else self.prompt_tokens[index],
            output_tokens=None if self.output_tokens is None else self.output_tokens[index],
            request_latency_ms=None if self.request_latency_ms is None else self.request_latency_ms[index],
        )

    def without_family_labels(self) -> OfflineData:
        """The same samples with no question family recorded: how real profiles without labels look."""
        return replace(self, family=None)

    def subset(self, split: str) -> OfflineData:
        """The samples of one split (``"train"``, ``"val"`` or ``"test"``)."""
        if split not in SPLITS:
            msg = f"`split` must be one of {SPLITS}, got {split!r}"
            raise ValueError(msg)
        return self.select([i for i, s in enumerate(self.split) if s == split])

    def clone(self) -> OfflineData:
        """A deep copy (tensors and lists), e.g. to perturb outcomes in a test."""
        return self.select(torch.arange(len(self)))


def _check(name: str, tensor: Any, dtype: torch.dtype, shape: tuple[int | None, ...]) -> None:
    """The one shape/dtype check of the public containers (None = any size)."""
    if not isinstance(tensor, torch.Tensor):
        msg = f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}"
        raise TypeError(msg)
    wrong_size = any(s is not None and s != t for s, t in zip(shape, tensor.shape))
    if tensor.dtype != dtype or tensor.dim() != len(shape) or wrong_size:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        msg = f"`{name}` must be {dtype} of shape {want}, got {tensor.dtype} of shape {tuple(tensor.shape)}"
        raise ValueError(msg)


def family_of(metadata_json: str | None) -> str | None:
    """The question family in a ``samples.metadata_json`` object: the value of the first of
    ``FAMILY_KEYS`` that holds a non-blank string (stripped); None when none does."""
    if not metadata_json:
        return None
    meta = orjson.loads(metadata_json)
    if not isinstance(meta, dict):
        return None
    for key in FAMILY_KEYS:
        value = meta.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


# -- the split ----------------------------------------------------------------------------

def split_of(dataset: str, sample_key: str, fractions: tuple[float, float, float] = DEFAULT_SPLIT_FRACTIONS) -> str:
    """``"train"``, ``"val"`` or ``"test"``, from SHA-1 of ``"<dataset>/<sample_key>"``.

    The first 8 bytes of the digest give a uniform u in [0, 1); u < train -> train,
    u < train + val -> val, else test. Depends on nothing but the sample's identity, so it
    is stable across workspaces, re-ingests and added samples, and all configurations of
    a sample land in the same split.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        msg = f"`fractions` must be three non-negative numbers summing to 1, got {fractions!r}"
        raise ValueError(msg)
    digest = hashlib.sha1(f"{dataset}/{sample_key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < fractions[0]:
        return "train"
    return "val" if u < fractions[0] + fractions[1] else "test"


def nonempty_split(data: OfflineData, name: str) -> OfflineData:
    """The samples of split ``name``; a CtrlError when it has none (training and evaluation need each)."""
    part = data.subset(name)
    if len(part) == 0:
        msg = (f"the {name} split is empty ({len(data)} samples in total)\n"
               "Hint: the split is 80/10/10 by sample; ingest more samples.")
        raise CtrlError(msg)
    return part


def hold_out_dataset(data: OfflineData, dataset: str) -> tuple[OfflineData, OfflineData]:
    """(the samples of ``dataset``, every other sample); a CtrlError naming the datasets there are
    when ``dataset`` has no samples, or when it is the only one (nothing would be left to train on)."""
    held = [i for i, d in enumerate(data.dataset) if d == dataset]
    if not held or len(held) == len(data):
        names = ", ".join(sorted(set(data.dataset)))
        reason = "has no samples" if not held else "is the only dataset: nothing would be left to train on"
        msg = f"--holdout-dataset {dataset}: the dataset {reason} (datasets: {names})"
        raise CtrlError(msg)
    return data.select(held), data.select([i for i, d in enumerate(data.dataset) if d != dataset])


def training_targets(data: OfflineData, score_target: str = "mean") -> OfflineData:
    """A copy of ``data`` whose ``score`` is what the rewards of training are computed from:
    ``"mean"``, the mean of the exp5 and exp6 scores where both were recorded
    (``OfflineData.mean_score``, two independent runs: half the outcome noise), else the
    recorded score; ``"recorded"``, the groups view's ``score`` (exp6 where present)."""
    out = data.clone()
    out.score = data.scores(score_target).clone()
    return out


# -- loading ------------------------------------------------------------------------------

#: the hint of every reader of the cached features when they are missing
_HINT_EXTRACT = "Hint: run `ctrl extract-features --images DIR` on this workspace first."


def check_image_feature_column(con: duckdb.DuckDBPyConnection, fingerprint: str,
                               column: str = GLOBAL_IMAGE_FEATURE) -> None:
    """Raise a CtrlError (with the hint to run ``ctrl extract-features``) when image features of
    ``fingerprint`` were cached by an older ctrl without ``column``: the view has no such column,
    or a row with a readable image has it null. ``con`` has the workspace's views and an
    ``image_features`` view."""
    if column not in IMAGE_FEATURE_COLUMNS:
        msg = f"image feature column must be one of {IMAGE_FEATURE_COLUMNS}, got {column!r}"
        raise ValueError(msg)
    names = {r[0] for r in con.sql("DESCRIBE image_features").fetchall()}
    # without the column in any chunk, the view has none: every readable image lacks it
    lacking = f"AND {column} IS NULL" if column in names else ""
    ((stale,),) = con.sql(f"SELECT count(*) FROM image_features WHERE model_fingerprint = $fp "
                          f"AND image_status = 'ok' {lacking}", params={"fp": fingerprint}).fetchall()
    if stale:
        msg = (f"{stale} cached image features of model {fingerprint[:16]} have no {column} (written by an older "
               "ctrl)\nHint: run `ctrl extract-features` with the same --model and --images: it recomputes them.")
        raise CtrlError(msg)


def resolve_feature_model(con: duckdb.DuckDBPyConnection, root: Path, requested: str | None, *,
                          needed_by: str | None = None, hint: str = "") -> str:
    """The one model whose cached features are read (``con``: a workspace connection, ``root`` its directory).

    Without ``needed_by``: ``requested`` as a full fingerprint or a unique prefix, or the only
    model cached when None. With ``needed_by`` (what needs that model: a checkpoint, the model
    being run), ``requested`` is a full fingerprint that must be cached; else a
    CacheMismatchError ``"<needed_by> features of model X, but workspace W has features of model
    Y only"`` with ``hint``. A workspace without cached features is a CtrlError with the hint to
    run ``ctrl extract-features``.
    """
    counts = []
    if "lang_features" in view_names(con):
        counts = con.sql("SELECT model_fingerprint, count(*) FROM lang_features GROUP BY 1 ORDER BY 1").fetchall()
    available = [fp for fp, _ in counts]
    if not available:
        msg = f"workspace {root} has no cached features\n{_HINT_EXTRACT}"
        raise CtrlError(msg)
    if needed_by is not None:
        if requested not in available:
            listing = ", ".join(fp[:16] for fp in available)
            msg = (f"{needed_by} features of model {str(requested)[:16]}, but workspace {root} has features of model "
                   f"{listing} only\n{hint}")
            raise CacheMismatchError(msg)
        return requested
    listing = ", ".join(f"{fp} ({n} samples)" for fp, n in counts)
    if requested is not None:
        matches = [fp for fp in available if fp == requested] or [fp for fp in available if fp.startswith(requested)]
        if len(matches) != 1:
            what = "matches several" if matches else "matches none"
            msg = (f"model fingerprint {requested!r} {what} of the cached feature models: {listing}\n"
                   "Hint: pass one of these fingerprints, or run `ctrl extract-features` "
                   "with that model.")
            raise CacheMismatchError(msg)
        return matches[0]
    if len(available) > 1:
        msg = (f"features of {len(available)} models are cached: {listing}\n"
               "Hint: choose one with model_fingerprint (e.g. `--model-fingerprint "
               f"{available[0][:16]}`).")
        raise CtrlError(msg)
    return available[0]


@dataclass
class SampleFeatures:
    """The cached features of one model for N samples, in the order asked for (:func:`read_sample_features`)."""

    fingerprint: str
    lang: np.ndarray  # (N, Dl) float32
    image: np.ndarray  # (N, Di) float32; zero where image_present is False
    image_present: np.ndarray  # (N,) bool: the sample's image was read at extraction
    tiling_crops: np.ndarray  # (N, C) float32: crops per max_crops value asked for; NaN where unknown
    image_path: list[str | None]  # the file extraction read the image from (None without a read image)
    image_size: list[tuple[int, int] | None]  # its (width, height)
    prompt_tokens: np.ndarray | None = None  # (N,) float32: text tokens of the formatted prompt; NaN where unknown


#: one row per (sample, model): a cache that holds a sample twice gives one of them
_FEATURE_SQL = ("SELECT k.row, {columns} FROM {table} f JOIN {keys} k USING (dataset, sample_key) "
                "WHERE f.model_fingerprint = $fp {extra} QUALIFY row_number() OVER (PARTITION BY k.row) = 1")


def read_sample_features(con: duckdb.DuckDBPyConnection, keys: str, fingerprint: str, *,
                         image_feature: str = GLOBAL_IMAGE_FEATURE,
                         max_crops_values: Sequence[int] = ()) -> SampleFeatures:
    """The cached features of model ``fingerprint`` (see :func:`resolve_feature_model`) for the
    samples of table ``keys`` of ``con`` (columns ``dataset``, ``sample_key`` and ``row``, 0..N-1,
    one row per sample): the one reader of training, prediction and the online phase.

    * language features: every sample must have them, else a CtrlError naming the first ones
      with the hint to run ``ctrl extract-features``;
    * image features: column ``image_feature`` of ``image_features`` where the image was read
      (zero and ``image_present`` False elsewhere); a cache written without that column is
      refused (:func:`check_image_feature_column`);
    * tilings (``image_tilings``): crops per entry of ``max_crops_values`` (NaN where unknown).

    Where a cache holds a sample more than once, one of its rows is read.
    """
    views = view_names(con)
    ((n,),) = con.sql(f"SELECT count(*) FROM {keys}").fetchall()
    params = {"fp": fingerprint}
    lang = con.sql(_FEATURE_SQL.format(columns="f.feature, f.num_prompt_tokens", table="lang_features", keys=keys,
                                       extra=""), params=params).to_arrow_table()
    lang_rows, lang_mat = _feature_matrix(lang)
    if len(lang_rows) < n:
        missing = ", ".join(str(row) for row in np.setdiff1d(np.arange(n), lang_rows)[:3])
        first = con.sql(f"SELECT dataset || '/' || sample_key FROM {keys} WHERE row IN ({missing}) ORDER BY row")
        msg = (f"{n - len(lang_rows)} of {n} samples have no language features for model {fingerprint[:16]} "
               f"(first: {', '.join(f for (f,) in first.fetchall())})\n{_HINT_EXTRACT}")
        raise CtrlError(msg)
    out = SampleFeatures(fingerprint, np.zeros((n, lang_mat.shape[1]), dtype=np.float32),
                         np.zeros((n, 0), dtype=np.float32), np.zeros(n, dtype=bool),
                         np.full((n, len(max_crops_values)), np.nan, dtype=np.float32), [None] * n, [None] * n)
    out.lang[lang_rows] = lang_mat
    out.prompt_tokens = np.full(n, np.nan, dtype=np.float32)
    out.prompt_tokens[lang_rows] = lang.column("num_prompt_tokens").to_numpy(zero_copy_only=False)
    if "image_features" in views:
        check_image_feature_column(con, fingerprint, image_feature)
        image_sql = _FEATURE_SQL.format(columns=f"f.{image_feature} AS feature, f.image_path, f.image_width, "
                                                "f.image_height", table="image_features", keys=keys,
                                        extra=f"AND f.{image_feature} IS NOT NULL")
        image = con.sql(image_sql, params=params).to_arrow_table()
        rows, mat = _feature_matrix(image)
        out.image = np.zeros((n, mat.shape[1]), dtype=np.float32)
        out.image[rows] = mat
        out.image_present[rows] = True
        for row, path, width, height in zip(rows.tolist(), *(image.column(c).to_pylist() for c in
                                                             ("image_path", "image_width", "image_height"))):
            out.image_path[row] = path
            out.image_size[row] = (int(width), int(height)) if width and height else None
    if max_crops_values and "image_tilings" in views:
        tilings = con.sql(f"SELECT k.row, t.max_crops, any_value(t.num_crops) AS num_crops FROM image_tilings t "
                          f"JOIN {keys} k USING (dataset, sample_key) WHERE t.model_fingerprint = $fp "
                          "AND t.num_crops IS NOT NULL GROUP BY ALL", params=params).fetchnumpy()
        crops_values = np.asarray(max_crops_values)
        max_crops = np.asarray(tilings["max_crops"], dtype=np.int64)
        keep = np.isin(max_crops, crops_values)  # the table covers max_crops 1..15; keep the ones asked for
        col = np.searchsorted(np.sort(crops_values), max_crops[keep])
        col = np.argsort(crops_values)[col]  # positions in the order asked for
        crops = np.asarray(tilings["num_crops"], dtype=np.float32)
        out.tiling_crops[np.asarray(tilings["row"])[keep], col] = crops[keep]
    return out


# Materialise groups once (the view is a join): every later query reads the temp table.
_GROUPS_SQL = """
CREATE TEMP TABLE _g AS
SELECT dataset, sample_key, max_crops, top_k, num_active_blocks, score::FLOAT AS score,
       (CASE WHEN score_exp5 IS NOT NULL AND score_exp6 IS NOT NULL THEN (score_exp5 + score_exp6) / 2
             ELSE score END)::FLOAT AS mean_score,
       latency_total_ms::FLOAT AS latency_ms, coalesce(latency_source = 'sample', false) AS latency_is_sample,
       score IS NOT NULL AND latency_total_ms IS NOT NULL AS allowed,
       num_output_tokens::FLOAT AS output_tokens
FROM groups;
CREATE TEMP TABLE _keys AS
SELECT dataset, sample_key, (row_number() OVER (ORDER BY dataset, sample_key) - 1)::BIGINT AS row
FROM _g GROUP BY dataset, sample_key HAVING bool_or(allowed);
CREATE TEMP TABLE _acts AS
SELECT max_crops, top_k, num_active_blocks,
       (row_number() OVER (ORDER BY max_crops, top_k, num_active_blocks) - 1)::BIGINT AS col
FROM _g GROUP BY max_crops, top_k, num_active_blocks HAVING bool_or(allowed);
"""


def _as_workspace(workspace: Workspace | str | Path) -> Workspace:
    return workspace if isinstance(workspace, Workspace) else Workspace(workspace)


def _feature_matrix(table: pa.Table, column: str = "feature") -> tuple[np.ndarray, np.ndarray]:
    """(rows, matrix) from an Arrow table with ``row`` and a FLOAT[] column, without a per-row loop."""
    rows = table.column("row").to_numpy()
    feats = table.column(column).combine_chunks()
    if len(rows) == 0:
        return rows, np.zeros((0, 0), dtype=np.float32)
    lengths = pc.list_value_length(feats)
    lo, hi = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    if lo != hi:
        msg = (f"cached {column} vectors have different lengths ({lo} .. {hi})\n"
               "Hint: re-run `ctrl extract-features --force` for this model.")
        raise CtrlError(msg)
    flat = feats.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return rows, flat.reshape(len(rows), lo)


@dataclass
class _GroupTables:
    """What :func:`load_offline_data` reads from the workspace, before it becomes tensors."""

    action_space: ActionSpace
    keys: pa.Table  # dataset, sample_key, example_id, metadata_json, question: one row per sample, in row order
    cells: pa.Table  # row, col, score, mean_score, latency_ms, latency_is_sample, output_tokens
    features: SampleFeatures


def load_offline_data(workspace: Workspace | str | Path, model_fingerprint: str | None = None, *,
                      image_feature: str = GLOBAL_IMAGE_FEATURE) -> OfflineData:
    """Read the recorded groups and cached features of ``workspace`` into an :class:`OfflineData`.

    * Actions: the configurations with at least one sample recorded with a score and a
      latency, sorted by (max_crops, top_k, num_active_blocks).
    * Samples: every (dataset, sample_key) of the ``groups`` view with at least one such
      configuration, sorted by (dataset, sample_key); a sample without any cannot be decided
      for and is left out.
    * ``family``: per sample, :func:`family_of` its ``samples.metadata_json``.
    * ``model_fingerprint``: full or a unique prefix (the feature directory name); required
      when features of several models are cached.
    * ``image_feature``: the ``image_features`` column read (``GLOBAL_IMAGE_FEATURE``, the
      global crop's, what training reads; ``REFERENCE_IMAGE_FEATURE`` for a comparison only).

    Raises CtrlError (with a hint to run ``ctrl extract-features``) when no features are
    cached, samples lack language features or the image features were cached without the
    column (:func:`read_sample_features`); CacheMismatchError for an unknown fingerprint.
    """
    if image_feature not in IMAGE_FEATURE_COLUMNS:
        msg = f"image_feature must be one of {IMAGE_FEATURE_COLUMNS}, got {image_feature!r}"
        raise ValueError(msg)
    tables = _read_group_tables(_as_workspace(workspace), model_fingerprint, image_feature)
    keys, action_space, features = tables.keys, tables.action_space, tables.features
    n, num_actions = keys.num_rows, len(action_space)
    dataset = keys.column("dataset").to_pylist()
    sample_key = keys.column("sample_key").to_pylist()
    cells = {name: np.full((n, num_actions), np.nan, dtype=np.float32)
             for name in ("score", "mean_score", "latency_ms", "output_tokens")}
    r, c = tables.cells.column("row").to_numpy(), tables.cells.column("col").to_numpy()
    for name, grid in cells.items():
        grid[r, c] = tables.cells.column(name).to_numpy(zero_copy_only=False)  # nulls arrive as NaN
    is_sample = np.zeros((n, num_actions), dtype=bool)
    is_sample[r, c] = tables.cells.column("latency_is_sample").to_numpy(zero_copy_only=False)
    mask = ~np.isnan(cells["score"]) & ~np.isnan(cells["latency_ms"])
    is_sample &= ~np.isnan(cells["latency_ms"])
    family = [family_of(m) for m in keys.column("metadata_json").to_pylist()]
    return OfflineData(
        action_space=action_space, model_fingerprint=features.fingerprint, dataset=dataset, sample_key=sample_key,
        example_id=keys.column("example_id").to_pylist(),
        split=[split_of(d, k) for d, k in zip(dataset, sample_key)],
        image_features=torch.from_numpy(features.image), image_present=torch.from_numpy(features.image_present),
        lang_features=torch.from_numpy(features.lang), score=torch.from_numpy(cells["score"]),
        latency_ms=torch.from_numpy(cells["latency_ms"]), latency_is_sample=torch.from_numpy(is_sample),
        mask=torch.from_numpy(mask), tiling_crops=torch.from_numpy(features.tiling_crops),
        mean_score=torch.from_numpy(cells["mean_score"]),
        family=family if any(f is not None for f in family) else None, image_feature=image_feature,
        question=keys.column("question").to_pylist(), prompt_tokens=torch.from_numpy(features.prompt_tokens),
        output_tokens=torch.from_numpy(cells["output_tokens"]),
    )


def _read_group_tables(ws: Workspace, model_fingerprint: str | None, image_feature: str) -> _GroupTables:
    con = connect(ws)
    try:
        if "groups" not in view_names(con):
            msg = (f"workspace {ws.root} has no recorded groups (measurements and configs)\n"
                   "Hint: run `ctrl ingest` on exp5/exp6 results first.")
            raise CtrlError(msg)
        fingerprint = resolve_feature_model(con, ws.root, model_fingerprint)
        con.execute(_GROUPS_SQL)
        acts = con.sql("SELECT max_crops, top_k, num_active_blocks FROM _acts ORDER BY col").fetchall()
        if not acts:
            msg = (f"workspace {ws.root} has no configuration recorded with both a score and a latency\n"
                   "Hint: offline training needs exp6 latencies; ingest the exp6 results too.")
            raise CtrlError(msg)
        action_space = ActionSpace(tuple(acts))
        keys = con.sql("SELECT k.dataset, k.sample_key, s.example_id, s.metadata_json, s.question FROM _keys k "
                       "LEFT JOIN samples s USING (dataset, sample_key) ORDER BY k.row").to_arrow_table()
        cells = con.sql("SELECT k.row, a.col, g.score, g.mean_score, g.latency_ms, g.latency_is_sample, "
                        "g.output_tokens FROM _g g "
                        "JOIN _keys k USING (dataset, sample_key) "
                        "JOIN _acts a USING (max_crops, top_k, num_active_blocks)").to_arrow_table()
        features = read_sample_features(con, "_keys", fingerprint, image_feature=image_feature,
                                        max_crops_values=action_space.max_crops_values)
    finally:
        con.close()
    return _GroupTables(action_space, keys, cells, features)


# -- budgets ------------------------------------------------------------------------------

def budget_grid(lo: float, hi: float, num: int) -> list[float]:
    """``num`` evenly spaced budgets over [lo, hi] (both ends; the midpoint when num = 1)."""
    if num < 1:
        msg = f"`num` must be >= 1, got {num!r}"
        raise ValueError(msg)
    if num == 1:
        return [(lo + hi) / 2]
    return [lo + (hi - lo) * i / (num - 1) for i in range(num)]


def default_budget_range(data: OfflineData, low_quantile: float = 0.98,
                         high_quantile: float = 0.95) -> tuple[float, float]:
    """The default latency-budget range (ms), from the TRAIN split's allowed latencies.

    * ``lo``: the lowest budget that one *static* configuration meets on ``low_quantile``
      (0.98) of the train samples: per configuration the 0.98 quantile of its train latencies,
      the smallest of these, rounded UP to a whole ms. At the lowest budget, always choosing
      that configuration (a decider that needs no per-sample knowledge) violates at most 2 %
      of the train samples, so a violation rate <= 5 % is achievable on unseen samples too,
      with room for their sampling noise (a per-sample rule, such as each sample's fastest
      latency, is met on train only by hindsight).
    * ``hi`` = ``high_quantile`` (0.95) of each train sample's slowest allowed latency, rounded
      to a whole ms: above it the budget hardly binds (95 % of samples can run every configuration).

    Falls back to all samples when the data has no train split (e.g. a test-only subset).
    """
    for name, q in (("low_quantile", low_quantile), ("high_quantile", high_quantile)):
        if not 0.0 <= q <= 1.0:
            msg = f"`{name}` must be in [0, 1], got {q!r}"
            raise ValueError(msg)
    train = data.subset("train") if "train" in data.split else data
    if len(train) == 0:
        msg = "default_budget_range needs at least one sample"
        raise ValueError(msg)
    inf = torch.tensor(float("inf"))
    latency = train.latency_ms.double()
    allowed = torch.where(train.mask, latency, torch.tensor(float("nan"), dtype=torch.float64))
    seen = train.mask.any(dim=0)
    per_config = torch.nanquantile(allowed[:, seen], low_quantile, dim=0)  # (A_seen,)
    slowest = torch.where(train.mask, latency, -inf).amax(dim=1)
    lo = float(np.ceil(per_config.min().item()))
    hi = float(np.round(torch.quantile(slowest, high_quantile).item()))
    return lo, max(hi, lo + 1.0)  # never an empty range (e.g. one configuration)
