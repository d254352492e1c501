"""features: per-sample image and language features, computed once per model and cached.

The model runtime the features come from is ``runtime``, which online training and the profiler run too.
"""

from features.extract import FeatureConfig, FeatureReport, extract_features

__all__ = ["FeatureConfig", "FeatureReport", "extract_features"]
