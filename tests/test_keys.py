"""Sample keys: stable, built from metadata, independent of everything that is not an id."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.keys import build_sample_key, canonical_id

ids = st.one_of(st.integers(min_value=0, max_value=10**12),
                st.text(alphabet="0123456789abcdef", min_size=1, max_size=16))
noise = st.dictionaries(st.sampled_from(["pred", "score", "sample_id", "answers", "question_type", "style"]),
                        st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4)


@given(example_id=ids, image_id=ids, extra=noise)
def test_key_ignores_non_id_fields_and_key_order(example_id, image_id, extra):
    meta = {"example_id": example_id, "image_id": image_id, "question": "what?"}
    reordered = dict(reversed(list({**extra, **meta}.items())))
    assert build_sample_key("text_vqa", meta) == build_sample_key("text_vqa", reordered)


@given(a=st.integers(min_value=0, max_value=10**9), b=st.integers(min_value=0, max_value=10**9))
def test_distinct_question_ids_give_distinct_keys(a, b):
    ka, _ = build_sample_key("coco_2014_vqa", {"example_id": a, "image_id": 1})
    kb, _ = build_sample_key("coco_2014_vqa", {"example_id": b, "image_id": 1})
    assert (ka == kb) == (a == b)


@given(n=st.integers(min_value=0, max_value=2**50))
def test_integral_float_and_int_ids_agree(n):
    assert canonical_id(n) == canonical_id(float(n)) == str(n)


def test_other_id_types_have_one_text_form():
    assert canonical_id(2**70) == "1180591620717411303424"  # beyond 64 bits: still its digits
    assert canonical_id(1.5) == "1.5" and canonical_id(-0.25) == "-0.25"  # not integral: as written
    assert canonical_id({"b": 1, "a": [2, 3]}) == '{"a":[2,3],"b":1}'  # structured ids: sorted-key JSON
    assert canonical_id([7, "x"]) == '[7,"x"]'
    assert canonical_id(True) is None and canonical_id(float("nan")) is None


def test_ids_written_with_surrounding_whitespace_equal_the_number():
    assert canonical_id(" 42") == canonical_id("42\n") == canonical_id(42) == "42"
    assert canonical_id("  ") is None  # blank: falls through to the next rule
    assert build_sample_key("text_vqa", {"example_id": " 42", "question": "q?"}) == ("ex:42", "example_id")
    assert build_sample_key("text_vqa", {"question_id": "\t7 ", "image_id": 3}) == ("qid:7", "question_id")


@given(question=st.text(min_size=1).filter(lambda q: q.strip()), options=st.lists(st.text(max_size=8), max_size=5))
def test_question_hash_is_whitespace_insensitive_and_option_sensitive(question, options):
    base = build_sample_key("science_qa_img", {"question": question, "options": options})
    spaced = build_sample_key("science_qa_img", {"question": "  " + question.replace(" ", "   ") + "\n",
                                                 "options": options})
    assert base == spaced and base[1] == "question_hash"
    other = build_sample_key("science_qa_img", {"question": question, "options": options + ["extra option"]})
    assert other[0] != base[0]


@pytest.mark.parametrize(
    ("dataset", "meta", "expected"),
    [
        ("coco_2014_vqa", {"example_id": 42, "question_id": 7, "image_id": 3}, ("ex:42", "example_id")),
        ("vizwiz", {"question_id": "q7", "image_id": 3}, ("qid:q7", "question_id")),
        ("coco_caption", {"image_id": 3, "caption_id": 9}, ("img:3/cap:9", "image_caption")),
        ("tally_qa", {"image_id": 3, "question": "how many?"}, ("img:3", "image")),
        ("some_vqa", {"image_id": 3}, ("img:3", "image")),
        ("coco_2014_vqa", {"example_id": None, "image_id": 3.0}, ("img:3", "image")),
    ],
)
def test_rule_precedence(dataset, meta, expected):
    assert build_sample_key(dataset, meta) == expected


def test_image_with_question_on_per_question_dataset_hashes_the_question():
    key, source = build_sample_key("okvqa", {"image_id": 3, "question": "why?"})
    assert source == "image_question" and key.startswith("img:3/q:")
    assert key != build_sample_key("okvqa", {"image_id": 3, "question": "who?"})[0]


def test_sample_id_is_never_used():
    with pytest.raises(ValueError, match="cannot build a sample key"):
        build_sample_key("coco_2014_vqa", {"sample_id": 4})


def _sha1_16(payload: bytes) -> str:
    import hashlib

    return hashlib.sha1(payload).hexdigest()[:16]


def test_question_hash_is_the_documented_sha1_prefix():
    """16 hex digits of SHA-1 over the JSON [whitespace-normalised question, options] (object keys sorted):
    keys are stored in workspaces, so the exact bytes are part of the format."""
    key, source = build_sample_key("science_qa", {"question": " What is\n  shown? ", "options": {"b": 2, "a": 1}})
    assert (key, source) == ("q:" + _sha1_16(b'["What is shown?",{"a":1,"b":2}]'), "question_hash")
    assert build_sample_key("science_qa", {"question": "Why?"})[0] == "q:" + _sha1_16(b'["Why?",[]]')
    key, _ = build_sample_key("okvqa", {"image_id": 5, "question": "Why?", "options": ["x"]})
    assert key == "img:5/q:" + _sha1_16(b'["Why?",["x"]]')


def test_no_question_hashes_as_the_empty_question():
    from pipeline.keys import question_hash

    assert question_hash(None) == question_hash("") == question_hash("  ") == _sha1_16(b'["",[]]')


def test_blank_questions_are_no_questions():
    assert build_sample_key("okvqa", {"image_id": 5, "question": "  \n"}) == ("img:5", "image")
    with pytest.raises(ValueError, match="^metadata has none of example_id, question_id, image_id, question: "
                                         "cannot build a sample key$"):
        build_sample_key("science_qa", {"question": " \t "})
