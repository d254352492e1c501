"""One test per file kind, and the bad-input table: every error names the file, field and reason."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from origin_files import (
    core_exp_doc,
    exp5_config_doc,
    exp5_final_doc,
    exp5_name,
    exp6_config_doc,
    exp6_name,
    write,
)
from pipeline.errors import IngestError
from pipeline.knobs import exp_active_blocks
from pipeline.parse import NotResultsFile, parse_file


def parse(path: Path):
    return parse_file(path, path.read_bytes())


def test_exp5_rank0_file(tmp_path):
    p = write(tmp_path / exp5_name(2, 4, 12, rank=0), exp5_config_doc(2, 4, 12, [0, 2, 4], merged=False))
    got = parse(p)
    assert (got.kind, got.experiment, got.dataset, got.rows) == ("exp5_incremental", "exp5", "coco_2014_vqa", 3)
    rows = got.measurements.to_pylist()
    assert [r["sample_key"] for r in rows] == ["ex:500000", "ex:500002", "ex:500004"]
    assert rows[0]["active_block_indices"] == list(exp_active_blocks(12)) and rows[0]["world_size"] == 2
    assert got.summaries.num_rows == 1 and got.summaries.column("recorded_num_samples").to_pylist() == [3]


def test_reference_answers_come_from_answer_options_or_captions_when_there_is_no_answers_list(tmp_path):
    doc = exp5_config_doc(2, 4, 12, [0, 1, 2, 3, 4], merged=False)
    records = doc["all_samples"]
    for r in records:
        del r["answers"], r["metadata"]["answers"]
    records[0]["metadata"]["answer"] = 7  # a number: kept as its text
    records[1]["answer"] = "yes"  # on the record, not in the metadata
    records[2]["metadata"]["options"] = ["red", "green", "blue"]
    records[2]["answer_idx"] = 2  # the index on the record, the options in the metadata
    records[3]["options"], records[3]["metadata"]["answer_idx"] = ["left", "right"], 0
    records[4]["metadata"]["captions"] = ["a cat", "two cats"]
    got = parse(write(tmp_path / exp5_name(2, 4, 12, rank=0), doc))
    assert got.samples.column("answers").to_pylist() == [["7"], ["yes"], ["blue"], ["left"], ["a cat", "two cats"]]


def test_exp5_merged_file_counts_padding_duplicates(tmp_path):
    p = write(tmp_path / exp5_name(2, 4, 12), exp5_config_doc(2, 4, 12, [0, 2, 4, 1, 3, 0], merged=True))
    got = parse(p)
    assert got.kind == "exp5_merged" and got.rows == 6 and got.duplicate_rows == 1
    assert got.samples.num_rows == 5  # first copy of each sample only


def test_exp5_single_gpu_unsuffixed_file_is_incremental(tmp_path):
    p = write(tmp_path / exp5_name(2, 4, 12), exp5_config_doc(2, 4, 12, [0, 1], merged=False, world_size=1))
    assert parse(p).kind == "exp5_incremental"


def test_exp5_final_is_split_by_summary_when_provable(tmp_path):
    doc = exp5_final_doc([(2, 4, 12), (6, 4, 12)], [0, 1, 2, 3])
    got = parse(write(tmp_path / "exp5_accuracy_results.json", doc))
    assert got.kind == "exp5_final" and got.note is None and got.rows == 8
    rows = got.measurements.to_pylist()
    assert {r["max_crops"] for r in rows[:4]} == {2} and {r["max_crops"] for r in rows[4:]} == {6}
    # chunk scores were built as (i + c) % 2: the mapping must keep each score with its config
    assert all(r["score"] == float((int(r["sample_key"][3:]) - 500000 + r["max_crops"]) % 2) for r in rows)


def test_exp5_final_not_provable_keeps_summaries_only(tmp_path):
    doc = exp5_final_doc([(2, 4, 12), (6, 4, 12)], [0, 1, 2, 3])
    doc["summary"][0]["accuracy"] = 0.99  # chunk means no longer reproduce the summary
    got = parse(write(tmp_path / "exp5_accuracy_results.json", doc))
    assert got.rows == 0 and got.summaries.num_rows == 2
    assert "not attributed" in got.note and "chunk 0" in got.note


def test_exp6_rank_file_flags_known_defects(tmp_path):
    doc = exp6_config_doc(2, 4, 12, [0, 2, 4], merged=False)
    doc["per_sample_latencies"][1]["T_decode_ms"] = 0.0
    got = parse(write(tmp_path / exp6_name(2, 4, 12, rank=0), doc))
    assert got.kind == "exp6_rank"
    rows = got.measurements.to_pylist()
    assert all(r["flag_prefill_invalid"] and r["latency_prefill_ms"] is None and r["latency_prefill_raw_ms"] == 6.5
               for r in rows)
    assert all(r["flag_text_tokens_derived"] and r["num_text_tokens"] == 40 for r in rows)
    assert [r["flag_decode_missing"] for r in rows] == [False, True, False]
    assert rows[1]["latency_decode_ms"] is None and rows[0]["latency_decode_ms"] == 40.0
    # metadata attached by position: predictions' sample_id is always 0 and is ignored
    assert [r["sample_key"] for r in rows] == ["ex:500000", "ex:500002", "ex:500004"]


def test_exp6_merged_and_final(tmp_path):
    assert (parse(write(tmp_path / exp6_name(2, 4, 12), exp6_config_doc(2, 4, 12, [0, 1], merged=True))).kind
            == "exp6_merged")
    per_config = exp6_config_doc(2, 4, 12, [0, 1], merged=True)
    final = {"summary": per_config["summary"], "all_samples": per_config["per_sample_latencies"],
             "config": {"dataset_name": "coco_2014_vqa", "split": "validation", "max_crops_list": [2], "world_size": 2}}
    got = parse(write(tmp_path / "exp6_latency_results.json", final))
    assert got.kind == "exp6_final" and got.rows == 0 and got.summaries.num_rows == 1
    assert got.summaries.column("recorded_latency_total_ms_mean").to_pylist() == [200.5]


def test_core_exp_file(tmp_path):
    name = "text-vqa_imgsizetier-medium_crops6_topk7_blocks15.json"
    got = parse(write(tmp_path / name, core_exp_doc("medium", 7, 15, [0, 1, 2])))
    assert (got.kind, got.dataset, got.rows) == ("core_exp_merged", "text_vqa", 3)
    row = got.measurements.to_pylist()[0]
    assert ((row["tier"], row["max_crops"], row["num_crops"], row["latency_vision_ms"], row["flag_prefill_partial"])
            == ("medium", 8, 6, 30.0, True))
    rank = parse(write(tmp_path / name.replace(".json", "_rank1.json"), core_exp_doc("medium", 7, 15, [0])))
    assert rank.kind == "core_exp_rank"


def test_nan_summary_of_empty_config_is_read_and_flagged(tmp_path):
    p = write(tmp_path / exp5_name(2, 4, 12, rank=0), exp5_config_doc(2, 4, 12, [], merged=False))
    assert b"NaN" in p.read_bytes()  # what json.dump writes; orjson alone would reject the file
    got = parse(p)
    assert got.rows == 0
    assert got.summaries.to_pylist()[0]["flag_summary_nan"] is True
    assert got.summaries.to_pylist()[0]["recorded_accuracy"] is None


def test_other_json_is_not_a_results_file(tmp_path):
    with pytest.raises(NotResultsFile):
        parse(write(tmp_path / "tokenizer_config.json", {"model_max_length": 2048}))
    with pytest.raises(NotResultsFile):
        parse(write(tmp_path / "list.json", [1, 2, 3]))


def _exp6(tmp_path: Path) -> tuple[Path, dict]:
    return tmp_path / exp6_name(2, 4, 12, rank=0), exp6_config_doc(2, 4, 12, [0, 1, 2], merged=False)


def _mutate(fn):
    def build(tmp_path: Path) -> Path:
        path, doc = _exp6(tmp_path)
        doc = copy.deepcopy(doc)
        fn(doc)
        return write(path, doc)
    return build


def _raw(content: str | bytes, name: str | None = None):
    def build(tmp_path: Path) -> Path:
        path = tmp_path / (name or exp6_name(2, 4, 12, rank=0))
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path
    return build


def _set(path: list, value):
    def fn(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return fn


def _delete(path: list):
    def fn(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return fn


# (case id, file builder, message regex): every promised message has a row
BAD_INPUT = [
    ("truncated", lambda t: _raw(json.dumps(_exp6(t)[1])[:200])(t),
     r"^exp6_latency_crops2_topk4_blocks12_rank0\.json: invalid JSON"),
    ("empty file", _raw(""), r"invalid JSON"),
    ("not utf-8", _raw(b"\xff\xfe{"), r"invalid JSON"),
    ("top-level list", _raw("[1, 2]"), r"expected a JSON object at the top level, got a list"),
    ("wrong shape", _raw('{"summary": []}'),
     r"wrong shape: none of all_samples, per_sample_latencies, per_sample_results"),
    ("total is null", _mutate(_set(["per_sample_latencies", 1, "T_total_ms"], None)),
     r"per_sample_latencies\[1\]\.T_total_ms: expected a number, got null"),
    ("total is NaN", _mutate(_set(["per_sample_latencies", 1, "T_total_ms"], float("nan"))),
     r"per_sample_latencies\[1\]\.T_total_ms: expected a number, got NaN"),
    ("block list not a list", _mutate(_set(["config", "active_block_indices"], "0-11")),
     r"config\.active_block_indices: expected a list of integers, got '0-11'"),
    ("block outside the model", _mutate(_set(["config", "active_block_indices"], [*range(11), 16])),
     r"config\.active_block_indices: block 16 is outside 0\.\.15 \(num_total_blocks\)"),
    ("top_k missing", _mutate(_delete(["config", "top_k"])), r"config\.top_k: missing$"),
    ("top_k null", _mutate(_set(["config", "top_k"], None)), r"config\.top_k: expected an integer, got null$"),
    ("empty dataset name", _mutate(_set(["config", "dataset_name"], "")),
     r"config\.dataset_name: expected a non-empty string, got ''$"),
    ("split not a string", _mutate(_set(["config", "split"], 3)), r"config\.split: expected a string, got 3$"),
    ("world size 0", _mutate(_set(["config", "world_size"], 0)), r"config\.world_size: 0 is outside 1\.\.65536$"),
    ("no config", _mutate(_delete(["config"])), r"\.json: config: missing$"),
    ("total is a string", _mutate(_set(["per_sample_latencies", 2, "T_total_ms"], "fast")),
     r"per_sample_latencies\[2\]\.T_total_ms: expected a number, got 'fast'"),
    ("total missing", _mutate(_delete(["per_sample_latencies", 0, "T_total_ms"])),
     r"per_sample_latencies\[0\]\.T_total_ms: missing"),
    ("tokens not integer", _mutate(_set(["per_sample_latencies", 0, "num_vision_tokens"], 1.5)),
     r"per_sample_latencies\[0\]\.num_vision_tokens: expected a number, got 1\.5"),
    ("bool as number", _mutate(_set(["per_sample_latencies", 0, "T_decode_ms"], True)),
     r"per_sample_latencies\[0\]\.T_decode_ms: expected a number, got True"),
    ("pred not a string", _mutate(_set(["per_sample_predictions", 1, "pred"], 7)),
     r"per_sample_predictions\[1\]\.pred: expected a string, got 7"),
    ("no dataset name", _mutate(_delete(["config", "dataset_name"])), r"config\.dataset_name: missing"),
    ("config not an object", _mutate(_set(["config"], [])), r"config: expected an object, got a list"),
    ("top_k out of range", _mutate(_set(["config", "top_k"], 0)), r"config\.top_k: 0 is outside 1\.\.64"),
    ("name disagrees with config", _mutate(_set(["config", "max_crops"], 6)),
     r"file name says crops2_topk4_blocks12 but config has max_crops=6"),
    ("lists of different length", _mutate(lambda d: d["per_sample_predictions"].pop()),
     r"per_sample_predictions: has 2 entries but per_sample_latencies has 3"),
    ("metadata without ids", _mutate(_set(["per_sample_predictions", 2, "metadata"], {"style": "vqa"})),
     r"per_sample_predictions\[2\]\.metadata: metadata has none of"),
    ("metadata not an object", _mutate(_set(["per_sample_predictions", 0, "metadata"], "x")),
     r"per_sample_predictions\[0\]\.metadata: expected an object, got a string"),
    ("metadata a boolean", _mutate(_set(["per_sample_predictions", 0, "metadata"], True)),
     r"per_sample_predictions\[0\]\.metadata: expected an object, got a boolean"),
    ("config null", _mutate(_set(["config"], None)), r"config: expected an object, got null"),
    ("record not an object", _mutate(_set(["per_sample_latencies", 1], 5)),
     r"per_sample_latencies\[1\]: expected an object, got a number"),
    ("block list length", _mutate(_set(["config", "active_block_indices"], [0, 1])),
     r"config\.active_block_indices: has 2 blocks but num_active_blocks is 12"),
    ("summary stats not an object", _mutate(_set(["summary", 0, "latency_total_ms"], 3.0)),
     r"summary\[0\]\.latency_total_ms: expected an object of statistics"),
]


@pytest.mark.parametrize(("build", "message"), [(b, m) for _, b, m in BAD_INPUT], ids=[c for c, _, _ in BAD_INPUT])
def test_bad_input_gives_one_line_error_naming_file_and_field(tmp_path, build, message):
    path = build(tmp_path)
    with pytest.raises(IngestError, match=message) as info:
        parse(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(path.name + ": ")


def _json_text(rng, depth: int, repeat: bool) -> tuple[str, bool]:
    """A random JSON text written by hand (keys and strings with colons, escapes, non-ASCII,
    NaN-free numbers); with ``repeat`` some object may name a key twice. Returns the text and
    whether it does."""
    atoms = ['"a:b"', '"12:30:00"', '"\\u003a"', '"caf\\u00e9"', '"\\"q:\\""', '"x"', '"日本:語"', "1", "-2.5e3",
             "true", "null", '"C:\\\\dir"']
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(atoms), False
    if rng.random() < 0.4:
        items = [_json_text(rng, depth - 1, repeat) for _ in range(rng.randrange(4))]
        return "[" + ", ".join(t for t, _ in items) + "]", any(r for _, r in items)
    keys = rng.sample(["k", "k:1", "time:s", "ü", "\\u003akey", "pred", "config"], rng.randrange(1, 5))
    repeated = repeat and rng.random() < 0.2
    if repeated:
        keys.append(rng.choice(keys))
    members = [(key, _json_text(rng, depth - 1, repeat)) for key in keys]
    text = "{" + " , ".join(f'"{key}" :{value}' for key, (value, _) in members) + "}"
    return text, repeated or any(r for _, (_, r) in members)


def test_a_key_named_twice_in_one_object_is_refused_wherever_it_is(tmp_path):
    import random

    from pipeline.parse import load_json

    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for _ in range(2000):
        text, repeated = _json_text(rng, 4, repeat=rng.random() < 0.5)
        seen[repeated] += 1
        if repeated:
            with pytest.raises(IngestError, match=r"^x\.json: duplicate key '[^']+': an object names it twice"):
                load_json(Path("x.json"), text.encode())
        else:
            assert load_json(Path("x.json"), text.encode()) == json.loads(text)
    assert min(seen.values()) > 300, seen
