"""The model runtime: one interface (``base``) over the embedded model and a MolmoE-1B checkpoint.

``load_runtime("embedded")`` builds (once, into the cache) and loads the seeded embedded model;
``load_runtime("testbed")`` loads the trained testbed from the cache (``ctrl testbed train``);
``load_runtime(path)`` loads a directory: our embedded format if it carries the embedded
marker, otherwise a MolmoE checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from features.model.base import (
    REFERENCE_MAX_CROPS,
    GenerationResult,
    ModelInputs,
    ModelLoadError,
    ModelRuntime,
)
from features.model.embedded import build_embedded_model, is_embedded_dir

__all__ = [
    "REFERENCE_MAX_CROPS",
    "GenerationResult",
    "ModelInputs",
    "ModelLoadError",
    "ModelRuntime",
    "build_embedded_model",
    "load_runtime",
    "model_fingerprint",
]


def _resolve(model: str) -> tuple[str, Path]:
    """("embedded" | "molmoe", directory) for a --model value, building the embedded model when
    needed; "testbed" is the trained testbed of the current recipe, which must be in the cache
    (training takes minutes, so it is an explicit step: ``ctrl testbed train``)."""
    if model == "embedded":
        return "embedded", build_embedded_model()
    if model == "testbed":
        from testbed.train import cached_testbed_dir

        path = cached_testbed_dir()
        if path is None:
            raise ModelLoadError("--model testbed: the trained testbed is not in the cache; "
                                 "run `ctrl testbed train` first (about 30 minutes on one core)")
        return "embedded", path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{model}: no such model directory (use 'embedded', 'testbed' or a local directory)")
    return ("embedded" if is_embedded_dir(path) else "molmoe"), path


def load_runtime(model: str = "embedded", device: str = "cpu", importance_scores: Path | None = None) -> ModelRuntime:
    """A ready runtime: ``"embedded"`` (seed 0, built into the cache when absent) or a directory path.

    ``importance_scores`` is a §6 importance file used by ``blocks_for`` / ``knobs(num_active_blocks=...)``;
    without it the default block rule of ``pipeline.knobs.select_active_blocks`` applies.
    """
    kind, path = _resolve(model)
    if kind == "embedded":
        from features.model.embedded import EmbeddedRuntime

        return EmbeddedRuntime(path, device=device, importance_scores=importance_scores)
    from features.model.molmoe import MolmoERuntime

    return MolmoERuntime(path, device=device, importance_scores=importance_scores)


def model_fingerprint(model: str = "embedded") -> str:
    """The fingerprint ``load_runtime(model)`` would report, without loading the weights:
    lets a fully cached feature run skip the model altogether."""
    kind, path = _resolve(model)
    if kind == "embedded":
        from features.model.embedded import directory_fingerprint

        return directory_fingerprint(path)
    from features.model.molmoe import checkpoint_fingerprint

    return checkpoint_fingerprint(path)
