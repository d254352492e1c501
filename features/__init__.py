"""features: per-sample image and language features, computed once per model and cached.

The model runtime itself lives in ``runtime`` (imports torch); ``online`` reuses it.
"""

from features.extract import FeatureConfig, FeatureReport, extract_features

__all__ = ["FeatureConfig", "FeatureReport", "extract_features"]
