"""Answer scoring for the online phase: clean a generated answer, then score it against the references.

The references are the ``answers`` list of the workspace's ``samples`` table; the metric is chosen by the
sample's ``dataset`` (``docs/origin_format.md`` §8, one table: :data:`DATASET_METRICS`). Every score is in [0, 1].

Metrics
- ``vqa_score`` (VQA v2, TextVQA, OK-VQA, and any unknown dataset): ``min(#references equal to the prediction / 3, 1)``
  after both sides go through :func:`normalize_vqa_answer`. This is the origin's formula (§8). The official VQA
  metric instead averages ``min(#matches / 3, 1)`` over the 10 leave-one-out subsets of 9 of the 10 human answers
  (Antol et al., ICCV 2015; ``GT-Vision-Lab/VQA`` ``vqaEval.py``). The two agree for 0 and for 4 or more
  matches; for 1, 2 and 3 matches the official value is 0.3, 0.6 and 0.9 against 1/3, 2/3 and 1 here.
- ``exact_match`` (TallyQA, ScienceQA): 1 if the normalized prediction equals any normalized reference.
- ``anls`` (ST-VQA, DocVQA, InfographicVQA): Average Normalized Levenshtein Similarity, the max over references
  of ``1 - lev(p, a) / max(|p|, |a|)`` on lowercased, whitespace-collapsed strings, set to 0 once the
  normalized distance reaches the threshold 0.5 (Biten et al., ICCV 2019; DocVQA, Mathew et al., WACV 2021).

Prediction cleaning (§4.1) is applied first by :func:`score_answer`: see :func:`clean_prediction`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "DATASET_METRICS",
    "DEFAULT_METRIC",
    "MetricName",
    "anls",
    "clean_prediction",
    "exact_match",
    "metric_for_dataset",
    "normalize_vqa_answer",
    "score_answer",
    "vqa_score",
]

MetricName = Literal["vqa_score", "exact_match", "anls"]

DEFAULT_METRIC: MetricName = "vqa_score"
"""Metric for a dataset name missing from :data:`DATASET_METRICS` (the origin's fallback too, §8)."""

DATASET_METRICS: dict[str, MetricName] = {
    # VQA-style short answers with several human references (§8).
    "coco_2014_vqa": "vqa_score",
    "text_vqa": "vqa_score",
    "okvqa": "vqa_score",
    # Text-reading datasets: ANLS, θ = 0.5 (the origin's "ansl_em").
    "st_qa": "anls",
    "stvqa": "anls",
    "doc_qa": "anls",
    "docvqa": "anls",
    "infographic": "anls",
    # TallyQA: exact match against any of the image's answers (the origin's "em", §9 D19).
    "tally_qa": "exact_match",
    # ScienceQA: simplified. The origin extracts a letter with a regex and matches it to the options ("mc", §8);
    # here the prediction is compared with the stored answer strings (e.g. the correct option's text).
    "science_qa_img": "exact_match",
}
"""Dataset name (as in ``samples.dataset``, matched case-insensitively) → metric. Unknown names use
:data:`DEFAULT_METRIC`."""

ANLS_THRESHOLD = 0.5

# --- VQA answer normalization (the official VQA evaluation script, vqaEval.py) ---------------------------------

# The standard contraction table of vqaEval.py, verbatim: including its quirks (the capitalised keys never match
# because words are lowercased first, and "somebody'd" maps to "somebodyd"), so scores stay comparable.
_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at",
    "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've",
    "someone'dve": "someone'd've", "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", "somethingll": "something'll",
    "thats": "that's", "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's",
    "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
_NUMBER_WORDS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
    "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}
_ARTICLES = frozenset({"a", "an", "the"})
# Periods and apostrophes are not here: a period is handled by _PERIOD, an apostrophe is kept ("don't").
_PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?",
                "!")
_COMMA_BETWEEN_DIGITS = re.compile(r"\d,\d")
# vqaEval.py writes "(?!<=\d)(\.)(?!\d)"; its first group is a (mistyped) lookahead that always succeeds, so the
# effective rule is "drop a period not followed by a digit": "dogs." -> "dogs", "2.5" stays, "5." -> "5".
_PERIOD = re.compile(r"\.(?!\d)")


def _strip_punctuation(text: str) -> str:
    """vqaEval.py ``processPunctuation``: delete or blank out punctuation, then drop periods.

    A mark is deleted when it touches a space anywhere in the text, or when the text has a comma between digits
    ("1,000" -> "1000"); otherwise it becomes a space ("black-and-white" -> "black and white").
    """
    delete_all = _COMMA_BETWEEN_DIGITS.search(text) is not None
    out = text
    for p in _PUNCTUATION:
        delete = delete_all or (p + " ") in text or (" " + p) in text
        out = out.replace(p, "" if delete else " ")
    return _PERIOD.sub("", out)


def normalize_vqa_answer(text: str) -> str:
    """Normalize an answer as the official VQA evaluation does (``GT-Vision-Lab/VQA`` ``vqaEval.py``).

    Steps: newlines/tabs to spaces and strip; punctuation (:func:`_strip_punctuation`, including the rule that a
    comma between digits deletes all punctuation, "1,000" -> "1000"); lowercase and split on whitespace; number
    words "none"/"zero".."ten" to digits; drop the articles a/an/the; expand the contraction table ("dont" ->
    "don't"); join with single spaces. Example: ``"Two dogs."`` -> ``"2 dogs"``.

    One difference from vqaEval.py: it normalizes only when the ten references are not all identical; here both
    sides are always normalized (the origin's behaviour).
    """
    text = text.replace("\n", " ").replace("\t", " ").strip()
    words = []
    for word in _strip_punctuation(text).lower().split():
        word = _NUMBER_WORDS.get(word, word)
        if word not in _ARTICLES:
            words.append(_CONTRACTIONS.get(word, word))
    return " ".join(words)


# --- prediction cleaning (§4.1) ------------------------------------------------------------------------------------


def clean_prediction(text: str) -> str:
    """Extract the answer from a generated text, as the origin's ``compute_accuracy`` does (§4.1).

    - if ``"Answer:"`` appears, keep what follows its first occurrence (``"... Answer: 2"`` -> ``"2"``);
    - otherwise, for multi-line output keep the last non-empty line;
    - otherwise collapse runs of whitespace to single spaces;
    - strip the result in every case.
    """
    if "Answer:" in text:
        return text.split("Answer:", 1)[1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        return lines[-1]
    return " ".join(text.split())


# --- metrics -----------------------------------------------------------------------------------------------------


def vqa_score(pred: str, answers: Sequence[str]) -> float:
    """``min(#answers equal to the prediction / 3, 1)``, both sides normalized by :func:`normalize_vqa_answer`.

    This is the origin's formula (§8). The official VQA accuracy averages this quantity over the 10 leave-one-out
    subsets of 9 references; we use the simpler ``min(n / 3, 1)`` so scores match the origin's recorded ones.
    Values: 0, 1/3, 2/3 or 1.
    """
    target = normalize_vqa_answer(pred)
    matches = sum(normalize_vqa_answer(a) == target for a in answers)
    return min(matches / 3.0, 1.0)


def exact_match(pred: str, answers: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized answer (:func:`normalize_vqa_answer`), else 0.0."""
    target = normalize_vqa_answer(pred)
    return float(any(normalize_vqa_answer(a) == target for a in answers))


def _levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; each costs 1), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls(pred: str, answers: Sequence[str], threshold: float = ANLS_THRESHOLD) -> float:
    """ANLS of one prediction: max over answers of ``1 - NL``, where ``NL = lev(p, a) / max(|p|, |a|)``.

    Strings are lowercased, stripped and whitespace-collapsed first (as the DocVQA evaluation does). A pair
    whose ``NL >= threshold`` scores 0; two empty strings score 1. ``threshold`` is θ, 0.5 in ST-VQA and DocVQA.
    """
    p = " ".join(pred.lower().split())
    best = 0.0
    for answer in answers:
        a = " ".join(answer.lower().split())
        longest = max(len(p), len(a))
        distance = _levenshtein(p, a) / longest if longest else 0.0
        if distance < threshold:
            best = max(best, 1.0 - distance)
    return best


_METRICS = {"vqa_score": vqa_score, "exact_match": exact_match, "anls": anls}


def metric_for_dataset(dataset: str) -> MetricName:
    """The metric name for ``dataset`` from :data:`DATASET_METRICS`; unknown names get :data:`DEFAULT_METRIC`."""
    return DATASET_METRICS.get(dataset.strip().lower(), DEFAULT_METRIC)


def score_answer(dataset: str, generated_text: str, answers: Sequence[str]) -> tuple[float, str]:
    """Clean ``generated_text`` (:func:`clean_prediction`) and score it with ``dataset``'s metric.

    Returns ``(score in [0, 1], cleaned prediction)``. Raises ``ValueError`` when ``answers`` is empty, since
    every metric would silently return 0.
    """
    if isinstance(answers, str) or len(answers) == 0:
        got = "a bare string" if isinstance(answers, str) else "an empty list"
        msg = (f"cannot score a {dataset!r} sample: expected a non-empty list of reference answers, got {got}\n"
               "Hint: take `answers` from the workspace's `samples` table and skip samples without references.")
        raise ValueError(msg)
    pred = clean_prediction(generated_text)
    return _METRICS[metric_for_dataset(dataset)](pred, answers), pred
