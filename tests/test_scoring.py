"""runtime.scoring: prediction cleaning (§4.1), VQA normalization, vqa_score / exact match / ANLS, dispatch (§8).

Sections: docs/origin_format.md.
"""

from __future__ import annotations

import pytest

from runtime.scoring import (
    DATASET_METRICS,
    anls,
    clean_prediction,
    exact_match,
    metric_for_dataset,
    normalize_vqa_answer,
    score_answer,
    vqa_score,
)

# --- cleaning ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: foo", "foo"),
        ("The image shows two cats.\nAnswer:  2 \n", "2"),
        ("Answer: yes Answer: no", "yes Answer: no"),  # only the first marker splits
        ("first line\n\nsecond line\n  \n", "second line"),  # last non-empty line
        ("  a   red\tcar  ", "a red car"),  # single line: whitespace collapsed
        ("\n  only line \n", "only line"),  # one non-empty line among blanks
        ("", ""),
    ],
)
def test_clean_prediction(text, expected):
    assert clean_prediction(text) == expected


# --- normalization ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Two dogs.", "2 dogs"),
        ("2 dogs", "2 dogs"),
        ("YES", "yes"),
        ("The cat", "cat"),
        ("a man on an elephant", "man on elephant"),
        ("dont know", "don't know"),
        ("isnt", "isn't"),
        ("don't", "don't"),  # apostrophes are kept
        ("1,000", "1000"),  # a comma between digits deletes punctuation instead of blanking it
        ("2.5", "2.5"),  # a period before a digit stays
        ("black-and-white", "black and white"),  # a mark not touching a space becomes a space
        ("yes, it is!", "yes it is"),  # a mark touching a space is deleted
        ("(left)", "left"),
        ("none", "0"),
        ("ten", "10"),
        ("  red\n\tcar ", "red car"),
    ],
)
def test_normalize_vqa_answer(raw, expected):
    assert normalize_vqa_answer(raw) == expected


# --- vqa_score --------------------------------------------------------------------------------------------------

TEN = ["2", "2", "two", "3", "3", "4", "4", "4", "4", "5"]  # "2" matched by 3, "3" by 2, "5" by 1, "4" by 4


@pytest.mark.parametrize(
    ("pred", "expected"),
    [("7", 0.0), ("5", 1 / 3), ("3", 2 / 3), ("Two.", 1.0), ("4", 1.0)],
)
def test_vqa_score_levels(pred, expected):
    assert vqa_score(pred, TEN) == pytest.approx(expected)


def test_vqa_score_normalizes_both_sides():
    assert vqa_score("Two dogs.", ["2 dogs", "two dogs", "the 2 dogs"]) == 1.0
    assert vqa_score("1,000", ["1000"]) == pytest.approx(1 / 3)


# --- exact match ------------------------------------------------------------------------------------------------


def test_exact_match():
    assert exact_match("Three", ["1", "3"]) == 1.0  # any answer; number word -> digit
    assert exact_match("The red car.", ["red car"]) == 1.0
    assert exact_match("red", ["red car"]) == 0.0  # no partial credit
    assert exact_match("3", []) == 0.0


# --- ANLS -------------------------------------------------------------------------------------------------------


def test_anls_exact_and_case_insensitive():
    assert anls("Hello World", ["hello  world "]) == 1.0


def test_anls_near_miss_above_threshold():
    # "hello world" vs "hello wrld": one deletion over 11 chars
    assert anls("hello wrld", ["hello world"]) == pytest.approx(1 - 1 / 11)
    assert anls("kitten", ["sitting"]) == pytest.approx(1 - 3 / 7)  # the textbook distance 3


def test_anls_takes_the_best_answer():
    assert anls("abcd", ["zzzz", "abcx"]) == pytest.approx(0.75)


def test_anls_below_threshold_is_zero():
    assert anls("abxy", ["abcd"]) == 0.0  # distance 2/4 = 0.5 reaches θ
    assert anls("abcx", ["abcd"], threshold=0.2) == 0.0  # 0.25 >= 0.2
    assert anls("kitchen", ["sitting"]) == 0.0  # distance 5/7 >= 0.5
    assert anls("", ["abc"]) == 0.0


def test_anls_empty_strings_match():
    assert anls("", [""]) == 1.0


# --- dispatch and score_answer ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "metric"),
    [
        ("coco_2014_vqa", "vqa_score"),
        ("text_vqa", "vqa_score"),
        ("okvqa", "vqa_score"),
        ("st_qa", "anls"),
        ("doc_qa", "anls"),
        ("DocVQA", "anls"),  # case-insensitive
        ("stvqa", "anls"),
        ("infographic", "anls"),
        ("tally_qa", "exact_match"),
        ("science_qa_img", "exact_match"),
        ("some_new_dataset", "vqa_score"),  # unknown names fall back
    ],
)
def test_metric_for_dataset(dataset, metric):
    assert metric_for_dataset(dataset) == metric


def test_metric_table_values_are_known_metrics():
    assert set(DATASET_METRICS.values()) == {"vqa_score", "exact_match", "anls"}


def test_score_answer_cleans_then_scores():
    assert score_answer("text_vqa", "Let me look.\nAnswer: Two", ["2", "2", "2"]) == (1.0, "Two")
    assert score_answer("tally_qa", "I count\nthree", ["3"]) == (1.0, "three")
    score, pred = score_answer("doc_qa", "Answer: hello wrld", ["Hello World"])
    assert pred == "hello wrld" and score == pytest.approx(1 - 1 / 11)
    assert score_answer("okvqa", "blue", ["red"]) == (0.0, "blue")


@pytest.mark.parametrize(
    ("answers", "match"),
    [([], r"'doc_qa'.*empty list"), ((), r"'doc_qa'.*empty list"), ("yes", r"'doc_qa'.*bare string")],
)
def test_score_answer_rejects_missing_references(answers, match):
    with pytest.raises(ValueError, match=match):
        score_answer("doc_qa", "Answer: yes", answers)


# --- rules that single examples above do not pin down --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # a mark touching a space on either side deletes that mark everywhere in the answer
        ("dog- cat-bird", "dog catbird"),
        ("dog -cat-bird", "dog catbird"),
        # touching no space: every occurrence becomes a space
        ("dog-cat-bird", "dog cat bird"),
        # newlines and tabs count as spaces before the rule applies (vqaEval replaces them first)
        ("dog\n-cat-bird", "dog catbird"),
        ("dog\t-cat-bird", "dog catbird"),
    ],
)
def test_punctuation_touching_a_space_is_deleted_not_blanked(raw, expected):
    assert normalize_vqa_answer(raw) == expected


def test_multi_line_output_keeps_the_last_non_empty_line():
    assert clean_prediction("first\nsecond\n\nthird\n") == "third"


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [("kitten", "sitting", 3), ("sitting", "kitten", 3), ("flaw", "lawn", 2), ("ab", "ba", 2), ("abc", "abc", 0),
     ("", "abc", 3), ("abc", "", 3), ("", "", 0), ("a", "b", 1), ("abcd", "abd", 1), ("abd", "abcd", 1)],
)
def test_edit_distance(a, b, distance):
    from runtime.scoring import _levenshtein

    assert _levenshtein(a, b) == distance


def test_missing_reference_messages_say_what_was_given():
    with pytest.raises(ValueError, match="got a bare string\nHint: take `answers` from the workspace's `samples`"):
        score_answer("text_vqa", "x", "cat")
    with pytest.raises(ValueError, match="^cannot score a 'text_vqa' sample: expected a non-empty list of reference "
                                         "answers, got an empty list\n"):
        score_answer("text_vqa", "x", [])
