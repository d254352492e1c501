"""Finding a sample's image on disk by its image_id."""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

from PIL import Image, UnidentifiedImageError

_EXTENSIONS = (".png", ".jpg", ".jpeg")


class ImageIndex:
    """File names under a directory (recursive), indexed once so lookups cost no disk access.

    Names tried for an image_id, in order: ``--image-pattern`` if given (a format string with
    ``{image_id}``, ``{dataset}``, ``{split}``), ``{image_id}.png|jpg|jpeg``,
    ``COCO_{val|train|test}2014_{image_id:012d}.jpg`` and ``{image_id:012d}.jpg``.
    """

    def __init__(self, root: Path | None, pattern: str | None = None) -> None:
        self.root = root
        self.pattern = pattern
        self.by_name: dict[str, Path] = {}
        self.by_relpath: dict[str, Path] = {}
        if root is not None and root.is_dir():
            for dirpath, _, filenames in os.walk(root):
                for name in sorted(filenames):
                    path = Path(dirpath) / name
                    self.by_name.setdefault(name, path)
                    self.by_relpath[str(path.relative_to(root))] = path

    def candidates(self, image_id: str, dataset: str, split: str | None) -> list[str]:
        names: list[str] = []
        if self.pattern:
            names.append(self.pattern.format(image_id=image_id, dataset=dataset, split=split or ""))
        names.extend(f"{image_id}{ext}" for ext in _EXTENSIONS)
        if image_id.isdigit():
            number = int(image_id)
            coco_split = {"validation": "val", "train": "train", "test": "test"}.get(split or "", "val")
            names.extend(f"COCO_{s}2014_{number:012d}.jpg" for s in dict.fromkeys((coco_split, "val", "train")))
            names.append(f"{number:012d}.jpg")
        return names

    def find(self, image_id: str, dataset: str, split: str | None) -> Path | None:
        for name in self.candidates(image_id, dataset, split):
            path = self.by_relpath.get(name) or self.by_name.get(name)
            if path is not None:
                return path
        return None


def open_image(path: Path) -> Image.Image | None:
    """The image as RGB, or None when the file cannot be decoded (or declares more pixels than
    PIL's decompression-bomb limit: a tiny file can claim 40000 x 40000 and exhaust memory).
    Only regular files are opened: a FIFO named like an image would block forever, a device
    never ends."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # over the limit / 2 too
            with Image.open(path) as img:
                return img.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning):
        return None
