"""The file kinds ingest recognises and which copy of a measurement wins.

Precedence, documented in docs/ingest.md ("Which copy wins"):

* measurements: merged per-config file > rank-0 / incremental per-config file > final
  aggregate; ties between files of the same kind go to the lexicographically smaller path,
  and inside one file the first occurrence wins (sampler padding repeats the first items).
* recorded summaries: merged > final aggregate > rank-0 file (a rank-0 summary covers only
  rank 0's shard).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FileKind:
    name: str
    experiment: str
    #: rank among copies of the same measurement (0 wins); None = the kind yields no measurements
    measurement_priority: int | None
    #: rank among recorded summaries of the same configuration (0 wins)
    summary_priority: int
    description: str


KINDS: dict[str, FileKind] = {
    k.name: k
    for k in (
        FileKind("exp5_merged", "exp5", 0, 0, "exp5 per-config file merged from all ranks "
                                              "(`..._blocks{B}.json` with config.note)"),
        FileKind("exp5_incremental", "exp5", 1, 2, "exp5 per-config file written after each config "
                                                   "(`..._rank0.json`, or un-suffixed on one GPU)"),
        FileKind("exp5_final", "exp5", 2, 1, "exp5 final aggregate `exp5_accuracy_results.json` "
                                             "(samples used only where the config mapping is provable)"),
        FileKind("exp6_merged", "exp6", 0, 0, "exp6 per-config file merged from all ranks "
                                              "(`exp6_latency_crops..._blocks{B}.json`)"),
        FileKind("exp6_rank", "exp6", 1, 2, "exp6 per-config rank-0 file (`..._rank0.json`, also on one GPU)"),
        FileKind("exp6_final", "exp6", None, 1, "exp6 final aggregate `exp6_latency_results.json` "
                                                "(summaries only: its samples carry no metadata)"),
        FileKind("core_exp_merged", "core_exp", 0, 0, "core_exp per-config file "
                                                      "(`<task>_imgsizetier-<tier>_crops<N>_topk<K>_blocks<B>.json`)"),
        FileKind("core_exp_rank", "core_exp", 1, 2, "core_exp per-rank temporary file (`..._rank<r>.json`)"),
    )
}


def priority_sql(column: str, which: str) -> str:
    """A SQL CASE mapping a kind column to its priority (``which``: measurement | summary)."""
    attr = "measurement_priority" if which == "measurement" else "summary_priority"
    arms = " ".join(
        f"WHEN '{k.name}' THEN {getattr(k, attr)}" for k in KINDS.values() if getattr(k, attr) is not None
    )
    return f"(CASE {column} {arms} ELSE 99 END)"
