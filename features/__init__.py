"""features: per-sample image and language features, computed once per model and cached.

The model runtime the features come from is ``runtime``, which online training and the profiler run too.
Names are imported on first use: ``features.config`` alone (what ``ctrl --help`` reads) loads no torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"FeatureConfig": "features.config", "FeatureReport": "features.extract",
            "extract_features": "features.extract"}

__all__ = ["FeatureConfig", "FeatureReport", "extract_features"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module 'features' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)
