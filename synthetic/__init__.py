"""Synthetic origin-format result trees: exp5 / exp6 files as the origin scripts write them for
MolmoE-1B, drawn from a documented hidden model (``synthetic.truth``) with the origin's quirks.

A test and benchmark tool, kept out of the production path: ingest, features and training never
import it. ``data/generate.py --synthetic`` writes one; tests and benchmarks build their own.
"""

from pipeline.knobs import balanced_combinations
from synthetic.tree import (
    GENERATOR_VERSION,
    GeneratedTree,
    SampleTruth,
    SyntheticSpec,
    build_truth,
    exp5_batch_size,
    expected_latency_matrix,
    expected_score_matrix,
    generate_tree,
    image_filename,
    rank_shards,
    samples_of,
    spec_fingerprint,
)
from synthetic.truth import SUPPORTED_DATASETS

__all__ = [
    # the spec and the writer
    "SyntheticSpec",
    "generate_tree",
    "GeneratedTree",
    "GENERATOR_VERSION",
    "spec_fingerprint",
    # the hidden truth
    "SampleTruth",
    "build_truth",
    "expected_latency_matrix",
    "expected_score_matrix",
    "samples_of",
    "SUPPORTED_DATASETS",
    # the origin's batching and sharding, emulated
    "balanced_combinations",
    "exp5_batch_size",
    "image_filename",
    "rank_shards",
]
