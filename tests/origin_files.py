"""Small, hand-written origin-format files for tests that need exact control over content.

Realistic trees come from ``synthetic``; these builders make the edge cases
(one file of each kind, duplicates, NaN summaries) explicit in the test that uses them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.knobs import exp_active_blocks

DATASET = "coco_2014_vqa"


def vqa_record(i: int, score: float | None = None, sample_id: int = 0) -> dict[str, Any]:
    """exp5 all_samples / exp6 per_sample_predictions entry for question i (docs/origin_format.md §4.1)."""
    return {
        "sample_id": sample_id,
        "score": float(i % 2) if score is None else score,
        "pred": f"answer {i}",
        "answers": [f"answer {i}"] * 10,
        "metadata": {"image_id": 1000 + i // 3, "example_id": 500000 + i, "question": f"question {i}?",
                     "answers": [f"answer {i}"] * 10},
    }


def _config(c: int, k: int, b: int, **extra: Any) -> dict[str, Any]:
    return {"dataset_name": DATASET, "split": "validation", "max_crops": c, "top_k": k, "num_active_blocks": b,
            "num_total_blocks": 16, "active_block_indices": list(exp_active_blocks(b)), **extra}


def _summary(c: int, k: int, b: int, scores: list[float], **extra: Any) -> dict[str, Any]:
    n = len(scores)
    mean = sum(scores) / n if n else float("nan")
    std = (sum((s - mean) ** 2 for s in scores) / n) ** 0.5 if n else float("nan")
    return {"max_crops": c, "top_k": k, "num_active_blocks": b, "accuracy": mean, "num_samples": n, "std": std, **extra}


def exp5_config_doc(c: int, k: int, b: int, indices: list[int], *, merged: bool, world_size: int = 2) -> dict:
    records = [vqa_record(i, sample_id=j % 8) for j, i in enumerate(indices)]
    extra = {"note": "Merged results from all ranks", "world_size": world_size} if merged else {
        "rank": 0, "world_size": world_size, "batch_size_used": 8, "config_index": 0, "sampling_strategy": "balanced"}
    return {"summary": [_summary(c, k, b, [r["score"] for r in records])], "all_samples": records,
            "config": _config(c, k, b, batch_size=8, max_new_tokens=16, **extra)}


def exp5_final_doc(configs: list[tuple[int, int, int]], indices: list[int], world_size: int = 2) -> dict:
    summary, samples = [], []
    for c, k, b in configs:
        records = [vqa_record(i, score=float((i + c) % 2)) for i in indices]
        summary.append(_summary(c, k, b, [r["score"] for r in records]))
        samples.extend(records)
    return {"summary": summary, "all_samples": samples,
            "config": {"dataset_name": DATASET, "split": "validation",
                       "max_crops_list": sorted({c for c, _, _ in configs}),
                       "top_k_list": [4], "num_active_blocks_list": [12], "world_size": world_size}}


def exp6_latency(i: int, local: int, c: int, k: int, b: int, *, decode_ms: float = 40.0) -> dict[str, Any]:
    return {"sample_id": local, "max_crops": c, "top_k": k, "num_active_blocks": b,
            "T_total_ms": 200.0 + i, "T_prefill_ms": 6.5, "T_decode_ms": decode_ms,
            "num_vision_tokens": (c + 1) * 144, "num_language_tokens": (c + 1) * 144 + 40,
            "num_output_tokens": 3, "num_total_tokens": 2 * (c + 1) * 144 + 40, "accuracy": float(i % 2)}


def exp6_config_doc(c: int, k: int, b: int, indices: list[int], *, merged: bool, world_size: int = 2) -> dict:
    lats = [exp6_latency(i, j, c, k, b) for j, i in enumerate(indices)]
    preds = [vqa_record(i, sample_id=0) for i in indices]
    totals = [x["T_total_ms"] for x in lats] or [float("nan")]
    stats = {"P50": totals[len(totals) // 2], "P95": max(totals), "P99": max(totals), "mean": sum(totals) / len(totals),
             "std": 1.0, "min": min(totals), "max": max(totals)}
    summary = _summary(c, k, b, [p["score"] for p in preds], latency_total_ms=stats,
                       latency_prefill_ms=dict(stats), latency_decode_ms=dict(stats))
    extra = {"note": "Merged results from all ranks"} if merged else {}
    return {"summary": [summary], "per_sample_latencies": lats, "per_sample_predictions": preds,
            "config": _config(c, k, b, batch_size=1, max_new_tokens=16, world_size=world_size, **extra)}


def core_exp_doc(tier: str, k: int, b: int, indices: list[int]) -> dict:
    records = []
    for j, i in enumerate(indices):
        records.append({"sample_id": j, "tier": tier, "tier_range": {"min_crops": 4, "max_crops": 8}, "top_k": k,
                        "num_active_blocks": b, "output_tokens": 2, "actual_num_crops": 6, "actual_tiling": [2, 3],
                        "target_vision_tokens": 1008, "actual_vision_tokens": 1000, "actual_text_tokens": 60,
                        "total_sequence_length": 1060, "accuracy": float(i % 2), "pred": f"answer {i}",
                        "metadata": vqa_record(i)["metadata"], "T_vision_total": 30.0, "T_LLM_prefill": 120.0,
                        "T_LLM_decode": 20.0, "T_total": 175.0, "T_decode_per_token": 10.0,
                        "T_decode_per_step": [[10.0]]})
    return {"tier": tier, "tier_range": {"min_crops": 4, "max_crops": 8}, "max_crops": 8, "top_k": k,
            "num_active_blocks": b, "num_total_blocks": 16, "active_block_indices": list(range(b)),
            "num_samples": len(records), "accuracy": 0.5, "accuracy_std": 0.5,
            "latency_stats": {"T_total_mean": 175.0, "T_total_p50": 175.0, "T_total_p95": 175.0},
            "per_sample_results": records}


def write(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))  # stdlib json writes NaN, like the origin scripts
    return path


def exp5_name(c: int, k: int, b: int, rank: int | None = None) -> str:
    return f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}" + (f"_rank{rank}" if rank is not None else "") + ".json"


def exp6_name(c: int, k: int, b: int, rank: int | None = None) -> str:
    return f"exp6_latency_crops{c}_topk{k}_blocks{b}" + (f"_rank{rank}" if rank is not None else "") + ".json"
