"""Detect the kind of one origin results file and parse it into fragment tables.

A fragment is what one file contributes: measurement rows (before dedupe), the first copy
of each sample's metadata, and the recorded configuration summaries. Formats:
``docs/origin_format.md`` §4 (exp5/exp6) and §5 (core_exp).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import knobs
from pipeline._parse_common import (
    COUNT_RANGE,
    FRAGMENT_MEASUREMENTS,
    FRAGMENT_SAMPLES,
    FRAGMENT_SUMMARIES,
    LATENCY_RANGE,
    MAX_INT32,
    Ctx,
    MeasurementBuilder,
    NotResultsFile,
    ParsedFile,
    RunInfo,
    SampleCollector,
    SummaryBuilder,
    block_indices,
    check_name_knobs,
    column,
    count_duplicates,
    knob_values,
    records_list,
    run_info,
    score_range,
    type_name,
)
from pipeline.errors import IngestError
from pipeline.knobs import Config
from pipeline.origin_format import (
    CORE_EXP_RE,
    EXP5_CONFIG_RE,
    EXP5_FINAL_NAME,
    EXP6_CONFIG_RE,
    EXP6_FINAL_NAME,
    EXP6_FINAL_RE,
    RANK_SUFFIX_RE,
    looks_like_results_name,
)

__all__ = [
    "FRAGMENT_MEASUREMENTS",
    "FRAGMENT_SAMPLES",
    "FRAGMENT_SUMMARIES",
    "PARSER_VERSION",
    "NotResultsFile",
    "ParsedFile",
    "detect_kind",
    "load_json",
    "parse_file",
]

#: bump whenever parsing output changes: fragments cached by an older parser are re-parsed
PARSER_VERSION = "3"

_F64, _I32, _STR = pa.float64(), pa.int32(), pa.string()


def load_json(path: Path, data: bytes) -> Any:
    """The file's JSON value; a key repeated within one object is an error naming the key.

    orjson first (fast). It keeps the last of repeated keys without a word, so its result is
    checked: outside strings a colon only separates a key from its value, so the file has
    exactly as many colons as the compact re-serialisation of its value unless an object
    lost a repeated key (whose value's colons are lost with it). A colon written as a
    ``\\u003a`` escape would spoil the count; such files, files whose counts differ and files
    with NaN/Infinity (which orjson rejects) go through the stdlib parser, which sees every key.
    """
    try:
        return loads_unique_keys(data)
    except RepeatedKeyError as e:
        msg = (f"duplicate key {e.key!r}: an object names it twice, and which value is meant is "
               "ambiguous (fix the file, keeping one)")
        raise IngestError(path, msg) from None
    except (ValueError, RecursionError) as e:
        raise IngestError(path, f"invalid JSON: {e}" if isinstance(e, orjson.JSONDecodeError) else "invalid JSON"
                          ) from None


class RepeatedKeyError(ValueError):
    """A JSON object names ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def loads_unique_keys(data: bytes) -> Any:
    """The JSON value of ``data``, refusing an object that names a key twice (:class:`RepeatedKeyError`).

    Other failures: ``orjson.JSONDecodeError`` (a ``ValueError``) where both parsers refuse the
    text, ``RecursionError`` where orjson read it and the stdlib parser, asked to find a repeated
    key, cannot go as deep. NaN and Infinity literals are accepted (through the stdlib parser).
    """
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as fast_err:
        try:
            return json.loads(data, object_pairs_hook=_refuse_repeated_keys)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise fast_err from None
    if b"\\u003" not in data:
        try:
            if data.count(b":") == orjson.dumps(doc).count(b":"):
                return doc
        except orjson.JSONEncodeError:
            pass
    return json.loads(data, object_pairs_hook=_refuse_repeated_keys)


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKeyError(key)
            seen.add(key)
    return obj


def parse_file(path: Path, data: bytes) -> ParsedFile:
    """Parse one results file. Raises IngestError (bad file) or NotResultsFile (other JSON)."""
    doc = load_json(path, data)
    kind = detect_kind(path, doc)
    ctx = Ctx(path)
    parser = {
        "exp5_merged": _parse_exp5_config,
        "exp5_incremental": _parse_exp5_config,
        "exp5_final": _parse_exp5_final,
        "exp6_merged": _parse_exp6_config,
        "exp6_rank": _parse_exp6_config,
        "exp6_final": _parse_exp6_final,
        "core_exp_merged": _parse_core_exp,
        "core_exp_rank": _parse_core_exp,
    }[kind]
    return parser(ctx, doc, kind)


def detect_kind(path: Path, doc: Any) -> str:
    """The file's kind from its content; the name decides rank vs merged where content cannot."""
    name = path.name
    named = looks_like_results_name(name)
    if not isinstance(doc, dict):
        if named:
            raise IngestError(path, f"expected a JSON object at the top level, got {type_name(doc)}")
        msg = f"top level is {type_name(doc)}, not a results object"
        raise NotResultsFile(msg)
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    rank_suffix = bool(RANK_SUFFIX_RE.search(name))
    if "per_sample_results" in doc:
        return "core_exp_rank" if rank_suffix else "core_exp_merged"
    if "per_sample_latencies" in doc:
        return "exp6_rank" if rank_suffix and "note" not in config else "exp6_merged"
    if "all_samples" in doc:
        final_names = (EXP5_FINAL_NAME, EXP6_FINAL_NAME)
        if name in final_names or any(k.endswith("_list") for k in config):
            samples, summary = doc.get("all_samples"), doc.get("summary")
            first = samples[0] if isinstance(samples, list) and samples and isinstance(samples[0], dict) else {}
            first_summary = summary[0] if isinstance(summary, list) and summary and isinstance(summary[0], dict) else {}
            if EXP6_FINAL_RE.match(name) or "T_total_ms" in first or "latency_total_ms" in first_summary:
                return "exp6_final"
            return "exp5_final"
        return "exp5_merged" if "note" in config else "exp5_incremental"
    if named:
        raise IngestError(path, "wrong shape: none of all_samples, per_sample_latencies, per_sample_results found")
    msg = "not an exp5/exp6/core_exp results file (no all_samples, per_sample_latencies or per_sample_results)"
    raise NotResultsFile(msg)


# ----------------------------------------------------------------------------- summaries


def _single_summary(ctx: Ctx, doc: dict) -> tuple[dict, str]:
    """The one-element ``summary`` list of a per-config file ({} when absent or empty)."""
    summary = doc.get("summary")
    if summary is None or summary == []:
        return {}, "summary"
    if isinstance(summary, dict):
        return summary, "summary"
    if not isinstance(summary, list) or not isinstance(summary[0], dict):
        raise ctx.fail(field="summary", reason=f"expected a list of objects, got {type_name(summary)}")
    return summary[0], "summary[0]"


def _stat(ctx: Ctx, entry: dict, where: str, key: str, stat: str) -> float | None:
    stats = entry.get(key)
    if stats is None:
        return None
    if not isinstance(stats, dict):
        raise ctx.fail(field=f"{where}.{key}", reason=f"expected an object of statistics, got {type_name(stats)}")
    return ctx.number(stats, stat, f"{where}.{key}")


def _add_exp_summary(ctx: Ctx, sb: SummaryBuilder, info: RunInfo, cfg: Config, blocks: list[int],
                     entry: dict, where: str) -> None:
    accuracy = ctx.number(entry, "accuracy", where)
    sb.add(
        info, cfg, blocks,
        accuracy=accuracy,
        std=ctx.number(entry, "std", where),
        num_samples=ctx.integer(entry, "num_samples", where, required=False, lo=0, hi=MAX_INT32),
        nan=accuracy is None and "accuracy" in entry,
        latency_total_ms_mean=_stat(ctx, entry, where, "latency_total_ms", "mean"),
        latency_total_ms_p50=_stat(ctx, entry, where, "latency_total_ms", "P50"),
        latency_total_ms_p95=_stat(ctx, entry, where, "latency_total_ms", "P95"),
        latency_prefill_ms_mean=_stat(ctx, entry, where, "latency_prefill_ms", "mean"),
        latency_decode_ms_mean=_stat(ctx, entry, where, "latency_decode_ms", "mean"),
        latency_vision_ms_mean=_stat(ctx, entry, where, "latency_vision_ms", "mean"),
    )


# ----------------------------------------------------------------------------- exp5


def _parse_exp5_config(ctx: Ctx, doc: dict, kind: str) -> ParsedFile:
    config = ctx.obj(doc, "config", "")
    info = run_info(ctx, config, "exp5")
    cfg = knob_values(ctx, config, "config", info.num_total_blocks)
    check_name_knobs(ctx, EXP5_CONFIG_RE, cfg)
    blocks = block_indices(ctx, config, "config", info, cfg[2])
    records = records_list(ctx, doc, "all_samples")
    samples = SampleCollector(ctx, info.dataset, info.split)
    keys = samples.keys(records, "all_samples")
    mb = MeasurementBuilder()
    mb.add(info, kind, cfg, keys, blocks=blocks,
           score=column(ctx, records, "all_samples", "score", _F64, required=True, valid=score_range(info.dataset)),
           pred=column(ctx, records, "all_samples", "pred", _STR, required=False))
    sb = SummaryBuilder(kind)
    entry, where = _single_summary(ctx, doc)
    _add_exp_summary(ctx, sb, info, cfg, blocks, entry, where)
    table = mb.table()
    return ParsedFile(kind, "exp5", info.dataset, table, samples.table(), sb.table(), count_duplicates(table))


def _parse_exp5_final(ctx: Ctx, doc: dict, kind: str) -> ParsedFile:
    """Final aggregate: samples are attributed to configurations only when provable.

    ``all_samples`` is every configuration's list concatenated in summary order without labels
    (§4.2). The split is provable when the summary's num_samples add up to the list length and
    every chunk's mean score reproduces its summary accuracy; otherwise only summaries are kept.
    """
    config = ctx.obj(doc, "config", "")
    info = run_info(ctx, config, "exp5")
    summary = records_list(ctx, doc, "summary")
    records = records_list(ctx, doc, "all_samples")
    sb = SummaryBuilder(kind)
    entries = []
    for j, entry in enumerate(summary):
        where = f"summary[{j}]"
        cfg = knob_values(ctx, entry, where, info.num_total_blocks)
        blocks = list(knobs.exp_active_blocks(cfg[2], info.num_total_blocks))
        _add_exp_summary(ctx, sb, info, cfg, blocks, entry, where)
        entries.append((cfg, blocks, ctx.number(entry, "accuracy", where),
                        ctx.integer(entry, "num_samples", where, required=False, lo=0, hi=MAX_INT32)))
    samples = SampleCollector(ctx, info.dataset, info.split)
    keys = samples.keys(records, "all_samples")
    scores = column(ctx, records, "all_samples", "score", _F64, required=True, valid=score_range(info.dataset))
    preds = column(ctx, records, "all_samples", "pred", _STR, required=False)
    reason = _final_mapping_problem(entries, scores)
    mb = MeasurementBuilder()
    note = None
    if reason is None:
        start = 0
        for cfg, blocks, _, count in entries:
            mb.add(info, kind, cfg, keys[start:start + count], blocks=blocks,
                   score=scores.slice(start, count), pred=preds.slice(start, count))
            start += count
    else:
        note = f"all_samples not attributed to configurations ({reason}); per-config files are used instead"
    table = mb.table()
    return ParsedFile(kind, "exp5", info.dataset, table, samples.table(), sb.table(), count_duplicates(table), note)


def _final_mapping_problem(entries: list[tuple], scores: pa.Array) -> str | None:
    counts = [e[3] for e in entries]
    if any(c is None for c in counts):
        return "a summary entry has no num_samples"
    if sum(counts) != len(scores):
        return f"summary num_samples add up to {sum(counts)} but all_samples has {len(scores)} entries"
    values = scores.to_numpy(zero_copy_only=False)
    start = 0
    for j, (cfg, _, accuracy, count) in enumerate(entries):
        chunk = values[start:start + count]
        start += count
        if count == 0:
            continue
        if accuracy is None or abs(float(np.mean(chunk)) - accuracy) > 1e-6:
            return (f"chunk {j} (crops{cfg[0]}_topk{cfg[1]}_blocks{cfg[2]}) has mean score "
                    f"{float(np.mean(chunk)):.6f}, summary says {accuracy}")
    return None


# ----------------------------------------------------------------------------- exp6


def _parse_exp6_config(ctx: Ctx, doc: dict, kind: str) -> ParsedFile:
    config = ctx.obj(doc, "config", "")
    info = run_info(ctx, config, "exp6")
    cfg = knob_values(ctx, config, "config", info.num_total_blocks)
    check_name_knobs(ctx, EXP6_CONFIG_RE, cfg)
    entry, where = _single_summary(ctx, doc)
    blocks = block_indices(ctx, config if "active_block_indices" in config else entry, "config", info, cfg[2])
    lats = records_list(ctx, doc, "per_sample_latencies")
    preds = records_list(ctx, doc, "per_sample_predictions")
    if len(lats) != len(preds):
        raise ctx.fail(field="per_sample_predictions",
                       reason=f"has {len(preds)} entries but per_sample_latencies has {len(lats)}: "
                              "metadata can only be attached by position")
    samples = SampleCollector(ctx, info.dataset, info.split)
    keys = samples.keys(preds, "per_sample_predictions")
    total = column(ctx, lats, "per_sample_latencies", "T_total_ms", _F64, required=True, valid=LATENCY_RANGE)
    prefill_raw = column(ctx, lats, "per_sample_latencies", "T_prefill_ms", _F64, required=False, valid=LATENCY_RANGE)
    decode = column(ctx, lats, "per_sample_latencies", "T_decode_ms", _F64, required=False, valid=LATENCY_RANGE)
    n_vision = column(ctx, lats, "per_sample_latencies", "num_vision_tokens", _I32, required=False, valid=COUNT_RANGE)
    n_language = column(ctx, lats, "per_sample_latencies", "num_language_tokens", _I32, required=False,
                        valid=COUNT_RANGE)
    n_output = column(ctx, lats, "per_sample_latencies", "num_output_tokens", _I32, required=False, valid=COUNT_RANGE)
    valid_scores = score_range(info.dataset)
    score = pc.coalesce(column(ctx, preds, "per_sample_predictions", "score", _F64, required=False, valid=valid_scores),
                        column(ctx, lats, "per_sample_latencies", "accuracy", _F64, required=False, valid=valid_scores))
    if score.null_count:
        i = score.is_null().to_pylist().index(True)
        raise ctx.fail(field=f"per_sample_predictions[{i}].score",
                       reason="missing, and per_sample_latencies has no accuracy either")
    _check_parts_within_total(ctx, total, {"T_decode_ms": decode, "T_prefill_ms": prefill_raw})
    # D1: a 0 decode time with more than one output token is a missing value, not a time
    decode_missing = pc.fill_null(pc.and_(pc.equal(decode, 0.0), pc.fill_null(pc.greater(n_output, 1), True)), False)
    columns = {
        "latency_total_ms": total,
        "latency_prefill_raw_ms": prefill_raw,
        "latency_decode_ms": pc.if_else(decode_missing, pa.scalar(None, _F64), decode),
        "num_vision_tokens": n_vision,
        "num_output_tokens": n_output,
        "flag_decode_missing": decode_missing,
    }
    if _ctrl_profile_version(ctx, config) is not None:
        # written by `ctrl profile` (profiler/): a real prefill time, vision timed, text-only counts
        columns.update({
            "latency_prefill_ms": prefill_raw,
            "latency_vision_ms": column(ctx, lats, "per_sample_latencies", "T_vision_ms", _F64, required=False,
                                        valid=LATENCY_RANGE),
            "num_crops": column(ctx, lats, "per_sample_latencies", "num_crops", _I32, required=False,
                                valid=COUNT_RANGE),
            "num_text_tokens": n_language,
        })
    else:
        columns.update({
            "num_text_tokens": pc.subtract(n_language, n_vision),  # D10: language count includes image placeholders
            "flag_prefill_invalid": pa.repeat(pa.scalar(True), len(keys)),  # D1: last decode step, not prefill
            "flag_text_tokens_derived": pc.is_valid(n_language),
        })
    mb = MeasurementBuilder()
    mb.add(info, kind, cfg, keys, blocks=blocks, score=score,
           pred=column(ctx, preds, "per_sample_predictions", "pred", _STR, required=False), columns=columns)
    sb = SummaryBuilder(kind)
    _add_exp_summary(ctx, sb, info, cfg, blocks, entry, where)
    table = mb.table()
    return ParsedFile(kind, "exp6", info.dataset, table, samples.table(), sb.table(), count_duplicates(table))


#: how far a part of a request's latency may exceed its total (timer rounding), in ms
PART_TOLERANCE_MS = 1.0


def _check_parts_within_total(ctx: Ctx, total: pa.Array, parts: dict[str, pa.Array]) -> None:
    """A part of a request's latency (decode, prefill) cannot take longer than the whole request."""
    for name, part in parts.items():
        over = pc.fill_null(pc.greater(part, pc.add(total, PART_TOLERANCE_MS)), False)
        if pc.any(over).as_py():
            i = over.to_pylist().index(True)
            raise ctx.fail(field=f"per_sample_latencies[{i}].{name}",
                           reason=f"{part[i].as_py()!r} ms is longer than the request's T_total_ms "
                                  f"{total[i].as_py()!r} ms")


def _ctrl_profile_version(ctx: Ctx, config: dict) -> int | None:
    """``config.ctrl_profile_version`` of files written by ``ctrl profile`` (measured without the
    origin's defects D1/D2/D10); None for the origin scripts' files."""
    return ctx.integer(config, "ctrl_profile_version", "config", required=False, lo=1)


def _parse_exp6_final(ctx: Ctx, doc: dict, kind: str) -> ParsedFile:
    """Final aggregate: summaries only; its all_samples carry no metadata, so no sample key (§4.3)."""
    config = ctx.obj(doc, "config", "")
    info = run_info(ctx, config, "exp6")
    summary = records_list(ctx, doc, "summary")
    records_list(ctx, doc, "all_samples")  # shape check only
    sb = SummaryBuilder(kind)
    for j, entry in enumerate(summary):
        where = f"summary[{j}]"
        cfg = knob_values(ctx, entry, where, info.num_total_blocks)
        blocks = block_indices(ctx, entry, where, info, cfg[2])
        _add_exp_summary(ctx, sb, info, cfg, blocks, entry, where)
    empty = FRAGMENT_MEASUREMENTS.arrow_schema().empty_table()
    return ParsedFile(kind, "exp6", info.dataset, empty, FRAGMENT_SAMPLES.arrow_schema().empty_table(), sb.table(), 0,
                      "per-sample latencies come from the per-config files (these carry no metadata)")


# ----------------------------------------------------------------------------- core_exp


def _parse_core_exp(ctx: Ctx, doc: dict, kind: str) -> ParsedFile:
    """core_exp per-config file (§5.3). It has no config.dataset_name: the dataset is the
    file name's task prefix with '-' turned back into '_'."""
    m = CORE_EXP_RE.match(ctx.path.name)
    if m is None:
        raise ctx.fail(field="", reason="core_exp file name must be "
                            "<task>_imgsizetier-<tier>_crops<N>_topk<K>_blocks<B>[_rank<r>].json")
    dataset = m.group(1).replace("-", "_")
    tier = doc.get("tier", m.group(2))
    if tier not in knobs.TIERS:
        raise ctx.fail(field="tier", reason=f"expected one of low, medium, high, got {tier!r}")
    total_blocks = ctx.integer(doc, "num_total_blocks", "", required=False, lo=1, hi=1024) or knobs.NUM_TOTAL_BLOCKS
    info = RunInfo("core_exp", dataset, None, 1, total_blocks)
    max_crops = ctx.integer(doc, "max_crops", "", required=False, lo=1, hi=64) or knobs.TIERS[tier].max_crops
    cfg = (max_crops,
           ctx.integer(doc, "top_k", "", lo=1, hi=knobs.NUM_EXPERTS),
           ctx.integer(doc, "num_active_blocks", "", lo=1, hi=total_blocks))
    if (int(m.group(4)), int(m.group(5))) != cfg[1:]:
        raise ctx.fail(field="", reason=f"file name says topk{m.group(4)}_blocks{m.group(5)} "
                            f"but the file has top_k={cfg[1]}, num_active_blocks={cfg[2]}")
    blocks = block_indices(ctx, doc, "", info, cfg[2])
    records = records_list(ctx, doc, "per_sample_results")
    samples = SampleCollector(ctx, dataset, None)
    keys = samples.keys(records, "per_sample_results")
    name = "per_sample_results"
    columns = {
        "num_crops": column(ctx, records, name, "actual_num_crops", _I32, required=False, valid=COUNT_RANGE),
        "latency_total_ms": column(ctx, records, name, "T_total", _F64, required=True, valid=LATENCY_RANGE),
        "latency_prefill_ms": column(ctx, records, name, "T_LLM_prefill", _F64, required=False, valid=LATENCY_RANGE),
        "latency_prefill_raw_ms": column(ctx, records, name, "T_LLM_prefill", _F64, required=False,
                                         valid=LATENCY_RANGE),
        "latency_decode_ms": column(ctx, records, name, "T_LLM_decode", _F64, required=False, valid=LATENCY_RANGE),
        "latency_vision_ms": column(ctx, records, name, "T_vision_total", _F64, required=False, valid=LATENCY_RANGE),
        "num_vision_tokens": column(ctx, records, name, "actual_vision_tokens", _I32, required=False,
                                    valid=COUNT_RANGE),
        "num_text_tokens": column(ctx, records, name, "actual_text_tokens", _I32, required=False, valid=COUNT_RANGE),
        "num_output_tokens": column(ctx, records, name, "output_tokens", _I32, required=False, valid=COUNT_RANGE),
        "flag_prefill_partial": pa.repeat(pa.scalar(True), len(keys)),  # D2: blocks 1..15 only
    }
    mb = MeasurementBuilder()
    mb.add(info, kind, cfg, keys, blocks=blocks, tier=tier,
           score=column(ctx, records, name, "accuracy", _F64, required=True, valid=score_range(info.dataset)),
           pred=column(ctx, records, name, "pred", _STR, required=False), columns=columns)
    # merge_rank_results.py leaves rank 0's stale latency_stats next to the recomputed aggregate_stats
    stats = doc.get("aggregate_stats") if isinstance(doc.get("aggregate_stats"), dict) else doc.get("latency_stats")
    stats = stats if isinstance(stats, dict) else {}
    sb = SummaryBuilder(kind)
    accuracy = ctx.number(doc, "accuracy", "")
    sb.add(info, cfg, blocks, tier=tier, accuracy=accuracy, std=ctx.number(doc, "accuracy_std", ""),
           num_samples=ctx.integer(doc, "num_samples", "", required=False, lo=0, hi=MAX_INT32),
           nan=accuracy is None and "accuracy" in doc,
           latency_total_ms_mean=ctx.number(stats, "T_total_mean", "latency_stats"),
           latency_total_ms_p50=ctx.number(stats, "T_total_p50", "latency_stats"),
           latency_total_ms_p95=ctx.number(stats, "T_total_p95", "latency_stats"),
           latency_prefill_ms_mean=ctx.number(stats, "T_LLM_prefill_mean", "latency_stats"),
           latency_decode_ms_mean=ctx.number(stats, "T_LLM_decode_mean", "latency_stats"),
           latency_vision_ms_mean=ctx.number(stats, "T_vision_total_mean", "latency_stats"))
    table = mb.table()
    return ParsedFile(kind, "core_exp", dataset, table, samples.table(), sb.table(), count_duplicates(table))
