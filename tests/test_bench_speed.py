"""benchmarks/bench_speed.py's profile of one request per configuration, on the CPU: its files, and
the counts a GPU run reads its launch overhead from (here aten operations, no kernels)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_speed import every_token, profile_requests  # noqa: E402

from runtime.molmoe import MolmoERuntime  # noqa: E402


def test_the_profile_writes_each_configurations_tables_and_counts(tiny_molmoe_dir, tmp_path):
    runtime = MolmoERuntime(tiny_molmoe_dir, fast_path=True)
    rows = profile_requests(runtime, [(1, 8, 16), (1, 2, 12)], tmp_path, max_new_tokens=3, log=lambda line: None)
    assert [r["config"] for r in rows] == ["1-8-16", "1-2-12"]
    for row in rows:
        assert (tmp_path / f"ops-{row['config']}.txt").is_file()
        assert (tmp_path / f"trace-{row['config']}.json.gz").is_file()
        assert row["kernels"] == row["prefill_kernels"] == row["step_kernels"] == 0  # no GPU
        assert row["host_ops"] > row["step_host_ops"] > 0
    # fewer blocks at a lower top-K: a decode step dispatches fewer operations
    assert rows[1]["step_host_ops"] < rows[0]["step_host_ops"]
    assert json.loads((tmp_path / "profile.json").read_text()) == rows


def test_a_timed_request_runs_to_its_tokens(tiny_molmoe_dir):
    runtime = MolmoERuntime(tiny_molmoe_dir, fast_path=True)
    inputs = runtime.preprocess(None, "Why?", 1)
    eos = runtime.eos_id
    with every_token(runtime):
        assert runtime.eos_id != eos
        assert len(runtime.generate(inputs, max_new_tokens=12).token_ids) == 12
    assert runtime.eos_id == eos
