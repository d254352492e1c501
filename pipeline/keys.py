"""Stable sample keys built from metadata, never from ``sample_id`` (docs/origin_format.md §4.4, D8).

Rules, first match wins (the rule's name is stored as ``samples.key_source``):

1. ``example_id`` present          -> ``ex:<example_id>``            (VQA v2, TextVQA, OK-VQA, DocVQA, ST-VQA, MMMU)
2. ``question_id`` present         -> ``qid:<question_id>``
3. ``image_id`` and ``caption_id`` -> ``img:<image_id>/cap:<caption_id>``  (COCO captions)
4. ``image_id`` on a per-image dataset, or with no question -> ``img:<image_id>``  (TallyQA)
5. ``image_id`` and a question     -> ``img:<image_id>/q:<hash>``
6. a question                      -> ``q:<hash>``  (ScienceQA: no ids at all)

``<hash>`` is the first 16 hex digits of SHA-1 over the whitespace-normalised question
and the options list, so the key survives re-runs, ranks, batch sizes and configurations.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

#: datasets whose unit is an image with several questions (docs/origin_format.md §8)
PER_IMAGE_DATASETS = frozenset({"tally_qa", "coco_caption", "coco_2014_vqa_multi"})

KEY_SOURCES = ("example_id", "question_id", "image_caption", "image", "image_question", "question_hash")


class SampleKeyError(ValueError):
    """Metadata from which no key can be built (raised as a ValueError subclass)."""


def canonical_id(value: Any) -> str | None:
    """Text form of an id: ints and integral floats print as integers, strings are stripped.

    Returns None for missing values (None, "", NaN) so that an absent id falls through to
    the next rule instead of producing a key like ``ex:None``.
    """
    if value is None or isinstance(value, bool):
        return None
    if type(value) is int:
        return str(value)
    if isinstance(value, float):
        if value != value:  # NaN
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        text = value.strip()
        return text or None
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def question_hash(question: str | None, options: Any = None) -> str:
    normalised = " ".join(str(question or "").split())
    payload = orjson.dumps([normalised, options if options is not None else []], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha1(payload).hexdigest()[:16]


def build_sample_key(dataset: str, metadata: dict[str, Any]) -> tuple[str, str]:
    """Return ``(sample_key, key_source)`` for one sample's metadata.

    Raises ``ValueError`` when the metadata holds none of example_id, question_id,
    image_id or question.
    """
    example_id = canonical_id(metadata.get("example_id"))
    if example_id is not None:
        return "ex:" + example_id, "example_id"
    question_id = canonical_id(metadata.get("question_id"))
    if question_id is not None:
        return "qid:" + question_id, "question_id"
    image_id = canonical_id(metadata.get("image_id"))
    question = metadata.get("question")
    has_question = isinstance(question, str) and question.strip() != ""
    if image_id is not None:
        caption_id = canonical_id(metadata.get("caption_id"))
        if caption_id is not None:
            return f"img:{image_id}/cap:{caption_id}", "image_caption"
        if dataset in PER_IMAGE_DATASETS or not has_question:
            return "img:" + image_id, "image"
        return f"img:{image_id}/q:{question_hash(question, metadata.get('options'))}", "image_question"
    if has_question:
        return "q:" + question_hash(question, metadata.get("options")), "question_hash"
    msg = "metadata has none of example_id, question_id, image_id, question: cannot build a sample key"
    raise SampleKeyError(msg)
