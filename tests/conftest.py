"""Shared fixtures: small origin-format trees written into tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from origin_files import (
    exp5_config_doc,
    exp5_final_doc,
    exp5_name,
    exp6_config_doc,
    exp6_name,
    write,
)
from pipeline import IngestConfig, IngestReport, Workspace, ingest

# wall-clock deadlines make property tests flaky on a loaded 2-core CI machine
settings.register_profile("ctrl", deadline=None, print_blob=True)
# mutation runs (docs/testing.md): a failing example is enough, shrinking it only costs time
settings.register_profile("mutation", deadline=None, max_examples=30,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(os.environ.get("CTRL_HYPOTHESIS_PROFILE", "ctrl"))

#: configurations of the small tree
CONFIGS = [(2, 4, 12), (6, 8, 16)]
NUM_SAMPLES = 5  # with world size 2: rank 0 gets 0, 2, 4; rank 1 gets 1, 3, 0 (padding)


def shard(rank: int, n: int = NUM_SAMPLES, world: int = 2) -> list[int]:
    padded = list(range(n)) + list(range((-n) % world))
    return padded[rank::world]


@pytest.fixture
def small_tree(tmp_path: Path) -> Path:
    """A two-GPU exp5 + exp6 run: rank-0 files, merged files (with padding) and final aggregates."""
    root = tmp_path / "results"
    exp5 = root / "exp5" / "exp5_accuracy_coco-2014-vqa"
    exp6 = root / "exp6" / "exp6_latency_coco-2014-vqa"
    merged_order = shard(0) + shard(1)
    for c, k, b in CONFIGS:
        write(exp5 / exp5_name(c, k, b, rank=0), exp5_config_doc(c, k, b, shard(0), merged=False))
        write(exp5 / exp5_name(c, k, b), exp5_config_doc(c, k, b, merged_order, merged=True))
        write(exp6 / exp6_name(c, k, b, rank=0), exp6_config_doc(c, k, b, shard(0), merged=False))
        write(exp6 / exp6_name(c, k, b), exp6_config_doc(c, k, b, merged_order, merged=True))
    write(exp5 / "exp5_accuracy_results.json", exp5_final_doc(CONFIGS, merged_order))
    return root


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "ws")


def run_ingest(paths: list[Path], workspace: Workspace, **kwargs) -> IngestReport:
    return ingest(IngestConfig(paths=paths, workspace=workspace.root,
                               num_workers=kwargs.pop("num_workers", 1), **kwargs))


@pytest.fixture(scope="session")
def embedded_runtime(tmp_path_factory):
    """The real embedded model, built once per test session into a temporary cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("CTRL_CACHE_DIR", str(tmp_path_factory.mktemp("model-cache")))
    from runtime import load_runtime

    yield load_runtime("embedded")
    patch.undo()


@pytest.fixture(scope="session")
def tiny_molmoe_dir(tmp_path_factory) -> Path:
    """A tiny random-weight MolmoE checkpoint with the real layout, built once per session by the
    origin reference's builder (skipped where the reference is absent)."""
    from molmoe_origin import SKIP_REASON, build_tiny, reference_dir

    if reference_dir() is None:
        pytest.skip(SKIP_REASON)
    return build_tiny(tmp_path_factory.mktemp("tiny-molmoe") / "ckpt")


def build_feature_workspace(root: Path, runtime, spec=None, chunk_size: int = 256):
    """Generate a synthetic origin tree under ``root``, ingest it and extract its features.

    Returns (tree, workspace): what every trainer test starts from.
    """
    from features import FeatureConfig, extract_features
    from synthetic import SyntheticSpec, generate_tree

    tree = generate_tree(spec or SyntheticSpec(num_samples=40), root / "data")
    workspace = Workspace(root / "ws")
    assert run_ingest([tree.exp5_dir, tree.exp6_dir], workspace).exit_code == 0
    extract_features(FeatureConfig(workspace=workspace.root, images_dir=tree.images_dir,
                                   batch_size=min(16, chunk_size), chunk_size=chunk_size), runtime=runtime)
    return tree, workspace
