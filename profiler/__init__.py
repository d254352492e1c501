"""``ctrl profile``: measure a model's knob sweep and write exp5 / exp6 trees that ``ctrl ingest`` reads.

The profiler produces ingest *input*: it runs the model (``runtime``) on a VQA dataset
(``testbed.dataset``) under every configuration of a sweep and writes the origin's file format
(``pipeline.origin_format``) with the origin's measurement defects fixed. ``profiler.archive``
packs such a tree into one small Parquet file (the shipped sample data) and back.
"""

from profiler.archive import UnpackReport, pack_profile, unpack_profile
from profiler.sweep import DatasetReport, ProfileConfig, ProfileReport, format_report, parse_configs, profile_model
from profiler.tree import PROFILE_VERSION, TreeWriter

__all__ = [
    # configs and runners
    "ProfileConfig",
    "profile_model",
    "parse_configs",
    "ProfileReport",
    "DatasetReport",
    "format_report",
    # the tree and its archive
    "PROFILE_VERSION",
    "TreeWriter",
    "pack_profile",
    "unpack_profile",
    "UnpackReport",
]
