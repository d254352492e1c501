"""The options of ``ctrl extract-features``, each declared once on its field (``pipeline.options``).

Imports no torch: ``ctrl --help`` builds the command's options from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import CtrlError
from pipeline.execution import check_dtype_name, execution_field
from pipeline.options import WORKSPACE_CLI, WORKSPACE_HELP, option

#: the fields an --image-pattern may use
IMAGE_PATTERN_FIELDS = ("image_id", "dataset", "split")


@dataclass
class FeatureConfig:
    """Options of ``ctrl extract-features`` (the help of each is on its field)."""

    workspace: Path | None = option(None, help=WORKSPACE_HELP, **WORKSPACE_CLI)
    images_dir: Path | None = option(None, help="Directory searched (recursively) for images by image_id "
                                     "(runtime.images.ImageIndex); none: text-only features.", flags=("--images",),
                                     is_dir=True, exists=True)
    image_pattern: str | None = option(None, help="Extra file name pattern, e.g. '{dataset}/{image_id}.jpg'.")
    model: str = option("embedded", help="'embedded' (built offline from a seed), 'testbed' (the trained testbed, "
                        "see `ctrl testbed train`), a local model directory or a Hugging Face id "
                        "org/name[@revision] in the local HF cache.")
    device: str = execution_field("device")
    dtype: str = execution_field("dtype", more_help="Features of two dtypes are cached apart.")
    float32_attention: bool = execution_field("float32_attention", more_help="MolmoE's vision tower attends as the "
                                              "decoder does, and its features of two attention dtypes are cached "
                                              "apart: extract them as the server will run.")
    batch_size: int = option(16, help="Requests per forward pass.", min=1)
    chunk_size: int = option(256, help="Samples per atomically written chunk: the resume granularity.", cli=False)
    force: bool = option(False, help="Recompute features already cached for this model.", flags=("--force",))

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            msg = f"batch_size must be >= 1, got {self.batch_size!r}"
            raise CtrlError(msg)
        if self.chunk_size < self.batch_size:
            msg = f"chunk_size ({self.chunk_size}) must be >= batch_size ({self.batch_size})"
            raise CtrlError(msg)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            msg = f"device must be cpu or cuda, got {self.device!r}"
            raise CtrlError(msg)
        check_dtype_name(self.dtype)
        if self.image_pattern is not None:
            check_image_pattern(self.image_pattern)
        if self.images_dir is not None and not Path(self.images_dir).is_dir():
            msg = f"--images {self.images_dir} is not a directory"
            raise CtrlError(msg)


def check_image_pattern(pattern: str) -> None:
    """Refuse a pattern that names another field, a positional one, or is not a format string."""
    import string

    try:
        parsed = list(string.Formatter().parse(pattern))
    except ValueError as err:
        msg = f"--image-pattern {pattern!r} is not a valid pattern ({err}); use e.g. '{{dataset}}/{{image_id}}.jpg'"
        raise CtrlError(msg) from None
    for _, field_name, _, _ in parsed:
        if field_name is None:
            continue
        if field_name not in IMAGE_PATTERN_FIELDS:
            shown = "{" + field_name + "}"
            msg = (f"--image-pattern {pattern!r} uses {shown}; the fields are "
                   + ", ".join("{" + f + "}" for f in IMAGE_PATTERN_FIELDS))
            raise CtrlError(msg)
