"""Property test of "which copy wins": whatever subset of copies a tree holds, the kept row
comes from the highest-priority file and num_copies counts every copy."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_ingest
from origin_files import exp5_config_doc, exp5_final_doc, exp5_name, write
from pipeline import Workspace

CONFIG = (2, 4, 12)
PRIORITY = ["exp5_merged", "exp5_incremental", "exp5_final"]


@st.composite
def trees(draw):
    n = draw(st.integers(min_value=1, max_value=6))
    merged = draw(st.none() | st.lists(st.integers(0, n - 1), min_size=1, max_size=8))
    rank0 = draw(st.none() | st.lists(st.integers(0, n - 1), min_size=1, max_size=4))
    final = draw(st.none() | st.lists(st.integers(0, n - 1), min_size=1, max_size=8))
    # a second merged file of the same content elsewhere: ties go to the smaller path
    mirror = draw(st.booleans()) and merged is not None
    return merged, rank0, final, mirror


@settings(max_examples=20)
@given(tree=trees())
def test_kept_copy_and_copy_count(tree):
    merged, rank0, final, mirror = tree
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "r"
        files = {}
        if merged is not None:
            files["exp5_merged"] = [write(root / "b" / exp5_name(*CONFIG),
                                          exp5_config_doc(*CONFIG, merged, merged=True))]
            if mirror:
                files["exp5_merged"].append(write(root / "a" / exp5_name(*CONFIG),
                                                  exp5_config_doc(*CONFIG, merged, merged=True)))
        if rank0 is not None:
            files["exp5_incremental"] = [write(root / "b" / exp5_name(*CONFIG, rank=0),
                                               exp5_config_doc(*CONFIG, rank0, merged=False))]
        if final is not None:
            files["exp5_final"] = [write(root / "b" / "exp5_accuracy_results.json", exp5_final_doc([CONFIG], final))]
        if not files:
            return
        ws = Workspace(Path(tmp) / "ws")
        assert run_ingest([root], ws).exit_code == 0
        rows = {r["sample_key"]: r for r in ws.read_table("measurements").iter_rows(named=True)}

        contents = {"exp5_merged": merged, "exp5_incremental": rank0, "exp5_final": final}
        expected_keys = {f"ex:{500000 + i}" for kind in files for i in contents[kind]}
        assert set(rows) == expected_keys
        for key, row in rows.items():
            i = int(key[3:]) - 500000
            holders = [kind for kind in PRIORITY if kind in files and i in contents[kind]]
            assert row["source_kind"] == holders[0]
            if holders[0] == "exp5_merged" and mirror:
                assert row["source_file"] == str(min(files["exp5_merged"]).resolve())
            copies = sum(contents[kind].count(i) * len(files[kind]) for kind in files)
            assert row["num_copies"] == copies
