"""Shared fixtures: small origin-format trees written into tmp_path."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
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


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N`` the workers share the cores: each (and every process it starts) gets
    its share of threads, since OpenMP pools that oversubscribe the cores spin against each other
    and make small torch ops several times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    if hasattr(config.option, "loadscopereorder"):
        # xdist would hand out the files with the most tests first; the longest first (the
        # order pytest_collection_modifyitems sets) lets two workers finish together
        config.option.loadscopereorder = False
    _keep_bytecode()


#: test files by their share of the suite's time, longest first (measured on two workers)
LONGEST_FIRST = ("test_gpu_check.py", "test_online.py", "test_molmoe_native.py", "test_export.py",
                 "test_behaviour_commands.py", "test_trainer_cli.py", "test_trainer_policy.py",
                 "test_molmoe_commands.py", "test_features.py", "test_model_runtime.py", "test_testbed.py",
                 "test_faults.py", "test_sample_data.py", "test_profile.py", "test_molmoe_processor.py",
                 "test_trainer_data.py", "test_ingest.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in LONGEST_FIRST order, then the rest as collected; the tests of a file stay together."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _keep_bytecode() -> None:
    """Where PYTHONDONTWRITEBYTECODE is set, every process the suite starts (workers, CLI and rank
    subprocesses) would compile torch and transformers again, about 8 s each: the session keeps
    its bytecode instead, in a per-user directory outside the source tree and the venv."""
    if not sys.dont_write_bytecode:
        return
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    prefix = Path(tempfile.gettempdir()) / f"ctrl-test-pycache-{user}"
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False

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
    """The real embedded model in a temporary cache of this session: built once per run (the
    workers of ``pytest -n N`` copy the first one's build) and loaded from the copy."""
    from runtime import load_runtime

    def build(cache: Path) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("CTRL_CACHE_DIR", str(cache))
            load_runtime("embedded")

    cache = tmp_path_factory.mktemp("model-cache")
    shutil.copytree(_built_once(tmp_path_factory, "embedded-model-cache", build), cache, dirs_exist_ok=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("CTRL_CACHE_DIR", str(cache))
    yield load_runtime("embedded")
    patch.undo()


@pytest.fixture(scope="session")
def tiny_molmoe_dir(tmp_path_factory) -> Path:
    """A tiny random-weight MolmoE checkpoint with the real layout, built once per run by the
    origin reference's builder (skipped where the reference is absent). Tests only read it, so
    the workers of ``pytest -n N`` share one: the first builds it under a lock, the others wait."""
    from molmoe_origin import SKIP_REASON, build_tiny, reference_dir

    if reference_dir() is None:
        pytest.skip(SKIP_REASON)
    return _built_once(tmp_path_factory, "tiny-molmoe", build_tiny)


def _built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Path:
    """The directory ``build(dir)`` fills, built once per run: the first worker of ``pytest -n N``
    builds it under a lock, the others wait and read it (one per worker where there are no POSIX
    locks). Readers must not write into it."""
    try:
        import fcntl
    except ImportError:
        out = tmp_path_factory.mktemp(name) / "built"
        build(out)
        return out
    home = _run_shared_dir(tmp_path_factory.getbasetemp()) / f"{name}-shared"
    home.mkdir(exist_ok=True)
    with (home / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "done").is_file():
            shutil.rmtree(home / "built", ignore_errors=True)
            build(home / "built")
            (home / "done").touch()
    return home / "built"


#: mutation runs (docs/testing.md) set this: a feature workspace is built once per spec and copied
#: for every mutant that cannot change how it is built
FIXTURE_CACHE = os.environ.get("CTRL_TEST_FIXTURE_CACHE")
#: the packages a feature workspace is built with; a mutant in one of them builds its own
_WORKSPACE_BUILDERS = ("pipeline.", "features.", "runtime.", "synthetic.")


def build_feature_workspace(root: Path, runtime, spec=None, chunk_size: int = 256):
    """Generate a synthetic origin tree under ``root``, ingest it and extract its features.

    Returns (tree, workspace): what every trainer test starts from.
    """
    from synthetic import SyntheticSpec

    spec = spec or SyntheticSpec(num_samples=40)
    if os.environ.get("MUTANT_UNDER_TEST", "").startswith(_WORKSPACE_BUILDERS):
        return _build_feature_workspace(root, runtime, spec, chunk_size)
    # modules that ask for the same workspace get copies of one, within a run or across mutants
    cache = Path(FIXTURE_CACHE) if FIXTURE_CACHE else _run_shared_dir(root.parent) / "feature-workspaces"
    return _cached_feature_workspace(cache, root, runtime, spec, chunk_size)


def build_offline_workspace(root: Path, runtime, num_samples: int):
    """:func:`build_feature_workspace` with ``num_samples`` synthetic samples and a one-epoch offline
    run ``offline-run`` (hard reward, no cross-fitting, no evaluation) to continue from online.

    Returns (tree, workspace)."""
    from synthetic import SyntheticSpec
    from trainer import OfflineTrainConfig, RewardConfig, train_offline

    tree, ws = build_feature_workspace(root, runtime, SyntheticSpec(num_samples=num_samples))
    train_offline(OfflineTrainConfig(workspace=ws.root, num_epochs=1, batch_size=16, run_id="offline-run",
                                     cross_fit_folds=0, reward=RewardConfig(mode="hard"), disable_evaluation=True))
    return tree, ws


def _run_shared_dir(basetemp: Path) -> Path:
    """The directory all workers of this pytest run write under (each worker has its own basetemp)."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


def _build_feature_workspace(root: Path, runtime, spec, chunk_size: int):
    from features import FeatureConfig, extract_features
    from synthetic import generate_tree

    tree = generate_tree(spec, root / "data")
    workspace = Workspace(root / "ws")
    assert run_ingest([tree.exp5_dir, tree.exp6_dir], workspace).exit_code == 0
    extract_features(FeatureConfig(workspace=workspace.root, images_dir=tree.images_dir,
                                   batch_size=min(16, chunk_size), chunk_size=chunk_size), runtime=runtime)
    return tree, workspace


def _cached_feature_workspace(cache: Path, root: Path, runtime, spec, chunk_size: int):
    try:
        import fcntl
    except ImportError:  # no POSIX locks: each module builds its own
        return _build_feature_workspace(root, runtime, spec, chunk_size)
    import hashlib
    import pickle

    from pipeline.catalog import build_catalog

    key = hashlib.sha1(repr((spec, chunk_size, runtime.fingerprint)).encode()).hexdigest()[:16]
    cached = cache / key
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the tree's paths name the cached copy
        if not (cached / "tree.pickle").exists():
            shutil.rmtree(cached, ignore_errors=True)
            tree, _ = _build_feature_workspace(cached, runtime, spec, chunk_size)
            (cached / "tree.pickle").write_bytes(pickle.dumps(tree))
    workspace = Workspace(shutil.copytree(cached / "ws", root / "ws"))
    build_catalog(workspace)  # its views name the copy's files
    return pickle.loads((cached / "tree.pickle").read_bytes()), workspace
