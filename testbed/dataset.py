"""A VQA dataset on disk: what the testbed generator writes and ``ctrl profile`` reads.

Layout of one dataset directory::

    <dir>/dataset.json     {"format": "ctrl-vqa-dataset", "version": 1, "name": ..., "split": ...,
                            "samples": [{"example_id", "image_id", "question", "answers", "family"}, ...]}
    <dir>/images/<image_id>.png

Samples carry the metadata keys of the origin's per-sample records (``example_id``,
``image_id``, ``question``, ``answers``; docs/origin_format.md §4.1), so results written from them
get the same sample keys at ingest as the origin's VQA sets, and ``ctrl extract-features
--images <dir>/images`` finds the images by image_id. ``family`` names the question family
(extra metadata, kept by ingest in ``metadata_json``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import CtrlError
from pipeline.workspace import write_bytes_atomic

DATASET_FORMAT = "ctrl-vqa-dataset"
DATASET_VERSION = 1
DATASET_FILE = "dataset.json"


@dataclass(frozen=True)
class VqaSample:
    """One question about one image; ``answers`` are the reference answers (VQA score over them)."""

    example_id: str
    image_id: str
    question: str
    answers: tuple[str, ...]
    family: str

    def metadata(self) -> dict:
        """The origin-style metadata dict of a per-sample record."""
        return {"example_id": self.example_id, "image_id": self.image_id, "question": self.question,
                "answers": list(self.answers), "family": self.family}


@dataclass(frozen=True)
class VqaDataset:
    name: str
    split: str
    samples: tuple[VqaSample, ...]
    root: Path

    @property
    def images_dir(self) -> Path:
        return self.root / "images"

    def image_path(self, sample: VqaSample) -> Path:
        return self.images_dir / f"{sample.image_id}.png"


def write_dataset(root: Path, name: str, split: str, samples: list[VqaSample]) -> Path:
    """Write ``dataset.json`` (atomic; images are written by the caller into ``root/images``)."""
    ids = [s.example_id for s in samples]
    if len(set(ids)) != len(ids):
        msg = f"dataset {name!r}: example_id values must be unique"
        raise ValueError(msg)
    payload = {"format": DATASET_FORMAT, "version": DATASET_VERSION, "name": name, "split": split,
               "samples": [{**asdict(s), "answers": list(s.answers)} for s in samples]}
    root.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(root / DATASET_FILE, (json.dumps(payload, indent=1) + "\n").encode())
    return root / DATASET_FILE


def read_dataset(root: str | Path) -> VqaDataset:
    """Read a dataset directory; a missing or foreign file is a one-line CtrlError."""
    root = Path(root)
    path = root / DATASET_FILE
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        msg = f"{path}: no such file (a dataset directory holds {DATASET_FILE} and images/)"
        raise CtrlError(msg) from None
    except ValueError as err:
        msg = f"{path}: not JSON ({err})"
        raise CtrlError(msg) from None
    if not isinstance(payload, dict) or payload.get("format") != DATASET_FORMAT:
        msg = (f"{path}: format {payload.get('format') if isinstance(payload, dict) else None!r}, "
               f"expected {DATASET_FORMAT!r}")
        raise CtrlError(msg)
    if payload.get("version") != DATASET_VERSION:
        msg = f"{path}: version {payload.get('version')!r}, this ctrl reads version {DATASET_VERSION}"
        raise CtrlError(msg)
    samples = []
    for i, s in enumerate(payload.get("samples", [])):
        try:
            samples.append(VqaSample(str(s["example_id"]), str(s["image_id"]), str(s["question"]),
                                     tuple(str(a) for a in s["answers"]), str(s.get("family", ""))))
        except (KeyError, TypeError) as err:
            msg = f"{path}: samples[{i}]: missing or invalid field {err}"
            raise CtrlError(msg) from None
    return VqaDataset(str(payload["name"]), str(payload["split"]), tuple(samples), root)
