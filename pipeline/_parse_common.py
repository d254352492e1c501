"""Shared pieces of the results parsers: field access with path-qualified errors,
columnar conversion, and builders for the fragment tables."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import knobs
from pipeline.errors import IngestError
from pipeline.keys import build_sample_key, canonical_id
from pipeline.knobs import Config
from pipeline.schema import CONFIGS, MEASUREMENTS, SAMPLES, Column, TableSchema

_DERIVED_MEASUREMENT_COLUMNS = {"source_file", "num_copies", "flag_copies_disagree", "flag_partial_config"}
_ROW_INDEX = Column("row_index", pa.int32(), "position in the file", nullable=False)

FRAGMENT_MEASUREMENTS = TableSchema(
    name="fragment_measurements",
    description="measurement rows of one file, before dedupe",
    primary_key=(),
    columns=tuple(c for c in MEASUREMENTS.columns if c.name not in _DERIVED_MEASUREMENT_COLUMNS) + (_ROW_INDEX,),
)
FRAGMENT_SAMPLES = TableSchema(
    name="fragment_samples",
    description="sample rows of one file, first copy per key",
    primary_key=(),
    columns=tuple(c for c in SAMPLES.columns if c.name != "source_file") + (_ROW_INDEX,),
)
_SUMMARY_DROP = {"summary_source_file", "accuracy", "accuracy_std", "num_samples", "flag_partial_config"}
RECOMPUTED_STATS = {"latency_total_ms_mean", "latency_total_ms_p50", "latency_total_ms_p95",
               "latency_prefill_ms_mean", "latency_decode_ms_mean", "latency_vision_ms_mean"}
FRAGMENT_SUMMARIES = TableSchema(
    name="fragment_summaries",
    description="recorded configuration summaries of one file",
    primary_key=(),
    columns=tuple(c for c in CONFIGS.columns if c.name not in _SUMMARY_DROP | RECOMPUTED_STATS)
    + (Column("source_kind", pa.string(), "kind of the file", nullable=False), _ROW_INDEX),
)

_SAMPLE_META_COLUMNS = ("example_id", "question_id", "image_id", "question")


@dataclass
class ParsedFile:
    """What one file contributes; tables follow the FRAGMENT_* schemas."""

    kind: str
    experiment: str
    dataset: str
    measurements: pa.Table
    samples: pa.Table
    summaries: pa.Table
    duplicate_rows: int
    note: str | None = None

    @property
    def rows(self) -> int:
        return self.measurements.num_rows


class NotResultsFile(Exception):
    """Valid JSON that is not an origin results file: listed as skipped."""


# ----------------------------------------------------------------------------- helpers


def type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


class Ctx:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, field: str, reason: str) -> IngestError:
        return IngestError(self.path, reason, field)

    def obj(self, parent: dict, key: str, where: str) -> dict:
        value = parent.get(key)
        if not isinstance(value, dict):
            raise self.fail(join(where, key),
                            f"expected an object, got {type_name(value)}" if key in parent else "missing")
        return value

    def lst(self, parent: dict, key: str, where: str) -> list:
        value = parent.get(key)
        if not isinstance(value, list):
            raise self.fail(join(where, key),
                            f"expected a list, got {type_name(value)}" if key in parent else "missing")
        return value

    def integer(self, parent: dict, key: str, where: str, *, required: bool = True, lo: int | None = None,
                hi: int | None = None) -> int | None:
        value = parent.get(key)
        if value is None:
            if required:
                raise self.fail(join(where, key), "missing" if key not in parent else "expected an integer, got null")
            return None
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and not value.is_integer())):
            raise self.fail(join(where, key), f"expected an integer, got {value!r}")
        value = int(value)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.fail(join(where, key), f"{value} is outside {lo}..{hi}")
        return value

    def number(self, parent: dict, key: str, where: str) -> float | None:
        """Optional float; NaN becomes None (a NaN summary is flagged by the caller)."""
        value = parent.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(join(where, key), f"expected a number, got {value!r}")
        return None if math.isnan(value) else float(value)

    def string(self, parent: dict, key: str, where: str) -> str:
        value = parent.get(key)
        if not isinstance(value, str) or not value:
            raise self.fail(join(where, key),
                            "missing" if key not in parent else f"expected a non-empty string, got {value!r}")
        return value


def join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


#: the largest world size and count the tables hold (int32 columns)
MAX_WORLD_SIZE = 65_536
MAX_INT32 = 2**31 - 1
#: a latency no request takes (one hour): larger recorded values are measurement or writing errors
MAX_LATENCY_MS = 3_600_000.0
#: value ranges of the recorded columns: a score is in [0, 1] (CIDEr, the captioning metric, is
#: unbounded above), a time or a count is finite and >= 0
SCORE_RANGE = (0.0, 1.0)
CIDER_RANGE = (0.0, None)
LATENCY_RANGE = (0.0, MAX_LATENCY_MS)


def score_range(dataset: str) -> tuple[float, float | None]:
    """The valid scores of a dataset: CIDEr (>= 0) for captioning datasets, else [0, 1]."""
    return CIDER_RANGE if "caption" in dataset.lower() else SCORE_RANGE
COUNT_RANGE = (0, None)


def column(ctx: Ctx, records: list, list_name: str, key: str, dtype: pa.DataType, *, required: bool,
           valid: tuple[float | None, float | None] | None = None) -> pa.Array:
    """Gather ``record[key]`` over records into an arrow array; name the first bad record on failure.
    ``valid`` = (lo, hi): values outside (either end None = open; infinities are always outside a
    finite end) fail the file, naming the first such record."""
    arr = _column(ctx, records, list_name, key, dtype, required=required)
    if valid is not None and len(arr) > arr.null_count:
        lo, hi = valid
        bounds = pc.min_max(arr).as_py()
        if (lo is not None and bounds["min"] < lo) or (hi is not None and bounds["max"] > hi):
            for i, v in enumerate(arr.to_pylist()):
                if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
                    field = f"{list_name}[{i}].{key}"
                    interval = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
                    raise ctx.fail(field, f"{v!r} is outside {interval}")
    return arr


def _column(ctx: Ctx, records: list, list_name: str, key: str, dtype: pa.DataType, *, required: bool) -> pa.Array:
    values = [r.get(key) for r in records]
    try:
        arr = pa.array(values, type=dtype)  # not from_pandas=True: it tries to import pandas on every call
        if pa.types.is_floating(dtype) and arr.null_count < len(arr):
            arr = pc.if_else(pc.is_nan(arr), pa.scalar(None, dtype), arr)  # NaN is a missing value here
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        arr = None
    if arr is not None and not (required and arr.null_count):
        if pa.types.is_floating(dtype):
            # pyarrow silently turns booleans into numbers
            if not any(type(v) is bool for v in values):
                return arr
        elif pa.types.is_integer(dtype):
            # ... and truncates floats like 1.5 into integer columns
            if not any(type(v) is bool or (type(v) is float and not v.is_integer()) for v in values):
                return arr
        else:
            return arr
    expect = "a number" if (pa.types.is_integer(dtype) or pa.types.is_floating(dtype)) else "a string"
    for i, (record, v) in enumerate(zip(records, values)):
        field = f"{list_name}[{i}].{key}"
        if v is None or (isinstance(v, float) and math.isnan(v)):
            if required:
                raise ctx.fail(field, "missing" if key not in record
                               else f"expected {expect}, got {'null' if v is None else 'NaN'}")
            continue
        ok = isinstance(v, str) if expect == "a string" else (isinstance(v, (int, float)) and not isinstance(v, bool))
        if pa.types.is_integer(dtype) and ok and isinstance(v, float) and not v.is_integer():
            ok = False
        if not ok:
            raise ctx.fail(field, f"expected {expect}, got {v!r}")
    raise ctx.fail(field=f"{list_name}[*].{key}", reason=f"cannot convert to {dtype}")  # pragma: no cover - defensive


def records_list(ctx: Ctx, doc: dict, key: str) -> list[dict]:
    records = ctx.lst(doc, key, "")
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ctx.fail(field=f"{key}[{i}]", reason=f"expected an object, got {type_name(r)}")
    return records


@dataclass
class RunInfo:
    experiment: str
    dataset: str
    split: str | None
    world_size: int
    num_total_blocks: int


def run_info(ctx: Ctx, config: dict, experiment: str) -> RunInfo:
    dataset = ctx.string(config, "dataset_name", "config")
    split = config.get("split")
    if split is not None and not isinstance(split, str):  # stored as null it would silently merge splits
        raise ctx.fail(join("config", "split"), f"expected a string, got {split!r}")
    world_size = ctx.integer(config, "world_size", "config", required=False, lo=1, hi=MAX_WORLD_SIZE) or 1
    rank = ctx.integer(config, "rank", "config", required=False, lo=0, hi=MAX_WORLD_SIZE)
    if rank is not None and rank >= world_size:
        raise ctx.fail(join("config", "rank"), f"rank {rank} does not exist in a world of {world_size}")
    total = ctx.integer(config, "num_total_blocks", "config", required=False, lo=1, hi=1024) or knobs.NUM_TOTAL_BLOCKS
    return RunInfo(experiment, dataset, split, world_size, total)


def knob_values(ctx: Ctx, obj: dict, where: str, total_blocks: int) -> Config:
    return (
        ctx.integer(obj, "max_crops", where, lo=1, hi=64),
        ctx.integer(obj, "top_k", where, lo=1, hi=knobs.NUM_EXPERTS),
        ctx.integer(obj, "num_active_blocks", where, lo=1, hi=total_blocks),
    )


def check_name_knobs(ctx: Ctx, pattern: re.Pattern, values: Config, offset: int = 1) -> None:
    m = pattern.match(ctx.path.name)
    if not m:
        return
    named = tuple(int(m.group(offset + i)) for i in range(3))
    if named != values:
        raise ctx.fail(field="config",
                       reason=f"file name says crops{named[0]}_topk{named[1]}_blocks{named[2]} but config has "
                              f"max_crops={values[0]}, top_k={values[1]}, num_active_blocks={values[2]}")


def block_indices(ctx: Ctx, obj: dict, where: str, info: RunInfo, num_active: int) -> list[int]:
    value = obj.get("active_block_indices")
    if value is None:
        if info.experiment in ("exp5", "exp6"):
            return list(knobs.exp_active_blocks(num_active, info.num_total_blocks))
        return list(range(num_active))
    if not isinstance(value, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        raise ctx.fail(join(where, "active_block_indices"), f"expected a list of integers, got {value!r}")
    if len(value) != num_active:
        raise ctx.fail(join(where, "active_block_indices"),
                       f"has {len(value)} blocks but num_active_blocks is {num_active}")
    outside = [b for b in value if not 0 <= b < info.num_total_blocks]
    if outside:
        raise ctx.fail(join(where, "active_block_indices"),
                       f"block {outside[0]} is outside 0..{info.num_total_blocks - 1} (num_total_blocks)")
    if len(set(value)) != len(value):
        repeated = next(b for b in value if value.count(b) > 1)
        raise ctx.fail(join(where, "active_block_indices"), f"block {repeated} is listed twice")
    return sorted(value)


# ----------------------------------------------------------------------------- sample metadata


def answers_of(record: dict, meta: dict) -> list[str] | None:
    for source in (meta, record):
        answers = source.get("answers")
        if isinstance(answers, list):
            return [a if type(a) is str else str(a) for a in answers]
        if isinstance(answers, str):
            return [answers]
    for source in (meta, record):
        answer = source.get("answer")
        if answer is not None and not isinstance(answer, (dict, list)):
            return [str(answer)]
    options, idx = meta.get("options", record.get("options")), meta.get("answer_idx", record.get("answer_idx"))
    if isinstance(options, list) and isinstance(idx, int) and 0 <= idx < len(options):
        return [str(options[idx])]
    for source in (meta, record):
        captions = source.get("captions")
        if isinstance(captions, list):
            return [str(c) for c in captions]
    return None


_NOT_IN_METADATA_JSON = frozenset(_SAMPLE_META_COLUMNS) | {"answers"}
_JSON_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
#: per-process memo of sample rows, bounded so memory stays flat on any tree size
_ROW_CACHE: dict[tuple[str, str], tuple[dict, tuple]] = {}
_ROW_CACHE_SIZE = 20_000


class SampleCollector:
    """Builds sample keys for a list of per-sample dicts and keeps the first copy of each sample."""

    def __init__(self, ctx: Ctx, dataset: str, split: str | None) -> None:
        self.ctx, self.dataset, self.split = ctx, dataset, split
        self.rows: list[tuple] = []
        self.seen: set[str] = set()

    def keys(self, records: list[dict], list_name: str) -> list[str]:
        keys = []
        seen, rows, dataset = self.seen, self.rows, self.dataset
        for i, record in enumerate(records):
            meta = record.get("metadata")
            if meta is None:
                meta = {}
            elif type(meta) is not dict:
                raise self.ctx.fail(field=f"{list_name}[{i}].metadata",
                                    reason=f"expected an object, got {type_name(meta)}")
            example_id = meta.get("example_id")
            if type(example_id) is int:  # the common case, without the general rule's overhead
                key, source = f"ex:{example_id}", "example_id"
            else:
                try:
                    key, source = build_sample_key(dataset, meta)
                except ValueError as err:
                    raise self.ctx.fail(field=f"{list_name}[{i}].metadata", reason=str(err)) from None
            keys.append(key)
            if key in seen:
                continue
            seen.add(key)
            # the same sample's metadata recurs in every configuration's file: reuse the row
            # built for an equal metadata dict (equality makes the reuse exact, not a guess)
            cached = _ROW_CACHE.get((dataset, key))
            if cached is not None and cached[0] == meta:
                rows.append(cached[1])
                continue
            question = meta.get("question")
            row = (
                key, source,
                canonical_id(example_id), canonical_id(meta.get("question_id")), canonical_id(meta.get("image_id")),
                question if question is None or type(question) is str else orjson.dumps(question).decode(),
                answers_of(record, meta),
                orjson.dumps({k: v for k, v in meta.items() if k not in _NOT_IN_METADATA_JSON},
                             option=_JSON_OPTS).decode(),
            )
            rows.append(row)
            if type(meta.get("answers")) is list:  # only then is the row a function of meta alone
                if len(_ROW_CACHE) >= _ROW_CACHE_SIZE:
                    _ROW_CACHE.clear()
                _ROW_CACHE[(dataset, key)] = (meta, row)
        return keys

    def table(self) -> pa.Table:
        n = len(self.rows)
        names = ("sample_key", "key_source", "example_id", "question_id", "image_id", "question", "answers",
                 "metadata_json")
        columns = dict(zip(names, map(list, zip(*self.rows)))) if n else {name: [] for name in names}
        columns.update(dataset=[self.dataset] * n, split=[self.split] * n, row_index=list(range(n)))
        return pa.Table.from_pydict(columns, schema=FRAGMENT_SAMPLES.arrow_schema())


# ----------------------------------------------------------------------------- measurement rows


class MeasurementBuilder:
    """Accumulates fragment measurement columns, block by block (one block = one config)."""

    def __init__(self) -> None:
        self.blocks: list[pa.Table] = []

    def add(self, info: RunInfo, kind: str, cfg: Config, keys: list[str], *, blocks: list[int],
            score: pa.Array, pred: pa.Array | None = None, tier: str | None = None,
            columns: dict[str, Any] | None = None) -> None:
        n = len(keys)
        if n == 0:
            return
        schema = FRAGMENT_MEASUREMENTS.arrow_schema()
        constants = {
            "experiment": info.experiment, "dataset": info.dataset, "split": info.split,
            "max_crops": cfg[0], "top_k": cfg[1], "num_active_blocks": cfg[2], "tier": tier,
            "num_total_blocks": info.num_total_blocks, "active_block_indices": blocks,
            "world_size": info.world_size, "source_kind": kind,
        }
        given: dict[str, Any] = {"sample_key": keys, "score": score, "pred": pred, **(columns or {})}
        offset = sum(b.num_rows for b in self.blocks)
        given["row_index"] = pa.array(range(offset, offset + n), pa.int32())
        arrays = []
        for field in schema:
            if field.name in constants:
                arrays.append(pa.repeat(pa.scalar(constants[field.name], field.type), n))
                continue
            value = given.get(field.name)
            if value is None:
                value = pa.repeat(pa.scalar(False), n) if pa.types.is_boolean(field.type) else pa.nulls(n, field.type)
            elif not isinstance(value, pa.Array):
                value = pa.array(value, field.type)
            arrays.append(value if value.type == field.type else value.cast(field.type))
        self.blocks.append(pa.Table.from_arrays(arrays, schema=schema))

    def table(self) -> pa.Table:
        if not self.blocks:
            return FRAGMENT_MEASUREMENTS.arrow_schema().empty_table()
        return pa.concat_tables(self.blocks)


def count_duplicates(table: pa.Table) -> int:
    """Rows that repeat an earlier (sample, configuration) of the same file: sampler padding."""
    if table.num_rows == 0:
        return 0
    keys = zip(*(table.column(c).to_pylist() for c in ("sample_key", "max_crops", "top_k", "num_active_blocks")))
    return table.num_rows - len(set(keys))


class SummaryBuilder:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.rows: dict[str, list] = {c.name: [] for c in FRAGMENT_SUMMARIES.columns}

    def add(self, info: RunInfo, cfg: Config, blocks: list[int], *, accuracy: float | None,
            std: float | None, num_samples: int | None, tier: str | None = None, nan: bool = False,
            **latency: float | None) -> None:
        row = {
            "experiment": info.experiment, "dataset": info.dataset, "split": info.split,
            "max_crops": cfg[0], "top_k": cfg[1], "num_active_blocks": cfg[2], "tier": tier,
            "num_total_blocks": info.num_total_blocks, "active_block_indices": blocks, "world_size": info.world_size,
            "recorded_accuracy": accuracy, "recorded_accuracy_std": std, "recorded_num_samples": num_samples,
            "flag_summary_nan": nan or accuracy is None or not num_samples,
            "source_kind": self.kind, "row_index": len(self.rows["row_index"]),
        }
        for name in RECOMPUTED_STATS:
            row["recorded_" + name] = latency.get(name)
        for name, values in self.rows.items():
            values.append(row[name])

    def table(self) -> pa.Table:
        return pa.Table.from_pydict(self.rows, schema=FRAGMENT_SUMMARIES.arrow_schema())
