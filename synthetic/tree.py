"""Deterministic synthetic exp5/exp6 result trees in the exact origin formats (docs/origin_format.md §4).

Used for the sample data in ``data/``, as test fixtures (small trees, fault injection) and
for benchmarks (large trees). Only numpy, the standard library and Pillow are imported.

Synthetic model (the hidden truth; also described in ``data/README.md``)
-------------------------------------------------------------------------
Each sample belongs to an image with an original size drawn per dataset (varied aspect
ratios 1:2 .. 3:1). The Molmo tiling rule of §2.1 (all (i, j) with i*j <= max_crops; the
largest scale when every candidate downscales, else the least upscaling; ties favour fewer
crops; the margin of 112 px is subtracted first) gives the crop count, so ``max_crops`` 6
and 10 are identical for a 640x480 COCO image but not for a 1024x768 TextVQA one. Each
sample also has a hidden *detail need* d (small text or objects; high for TextVQA, DocVQA,
counting), a *reasoning need* r (high for OK-VQA, ScienceQA), an intrinsic difficulty e,
and question / answer lengths taken from its generated text.

``p(correct) = sigmoid(base_ds + e - 5.0*d*(1 - vis)*size - (3 + 5r)*blk - 4*(0.3 + r)*topk)``
with ``vis = log2(1 + crops)/log2(13)``, ``size`` = (pixels / 640x480)^0.25 clipped to
[0.8, 1.4], ``blk`` = the share of a fixed per-block importance missing from the exp5/exp6
active-block subset (``knobs.exp_active_blocks``; n = 12 drops block 15) and
``topk = exp(-k/3.5)``. exp5 and exp6 draw outcomes independently from the same p. An
outcome is correct, partial (VQA: an alternative answer with 1-2 of the 10 annotator
votes, score min(votes/3, 1); ANLS: a near miss) or wrong; the per-sample answers and
the prediction text are consistent with the recorded score. Captions get a CIDEr-like
quality per sample (good 0.8-1.4, poor 0.1-0.6); exp5 writes the batch mean to every
sample of the batch and exp6 (batch size 1) writes 0.0 (D19).

Images are written as thumbnails (``image_max_side``), or with ``image_scale`` at a size the
embedded preprocessor tiles as the truth tiles the original (``truth.scaled_image_sizes``).
Opt-in ``image_sizes="vqa"`` and ``prompt_context`` widen the size and prompt-length spreads.

Latency (exp6, ms): ``T_total = 55 + vision + prefill + (n_out - 1) * step`` with
vision = 6 + 11*(crops + 1), prefill = B*(0.9 + seq*(0.0024 + 0.00036*k)) over the whole
``input_ids`` length, step = B*(0.95 + 0.075*k) + 1.3, each part with mean-one lognormal
noise (sigma 0.05) and 0.5 % slow outliers (x1.3-2). Totals span about 125-500 ms
(COCO median 140-265 ms). ``T_decode_ms`` = (n_out - 1) steps (0.0 for one token);
``T_prefill_ms`` = blocks 1..15 of the *last decode step* (D1), or of the prefill if no
decode step ran. Under a mid budget, high-detail samples prefer crops and low-detail
samples prefer experts and blocks, so the best configuration differs per sample.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipeline.keys import build_sample_key
from pipeline.knobs import (
    BALANCED_MAX_CROPS,
    BALANCED_NUM_ACTIVE_BLOCKS,
    BALANCED_TOP_K,
    NUM_TOTAL_BLOCKS,
    Config,
    balanced_combinations,
    exp_active_blocks,
)
from pipeline.origin_format import (
    EXP5_FINAL_NAME,
    EXP6_FINAL_NAME,
    MERGE_NOTE,
    accuracy_mean_std,
    dataset_dir_names,
    exp5_name,
    exp6_name,
    latency_statistics,
)
from synthetic import truth as model
from synthetic.json_text import HOLE, JsonText, Raw, fill
from synthetic.truth import SUPPORTED_DATASETS, DatasetTruth, build_dataset, stream

__all__ = ["GENERATOR_VERSION", "GeneratedTree", "SampleTruth", "SyntheticSpec", "build_truth", "exp5_batch_size",
           "expected_score_matrix",
           "generate_tree", "image_filename", "rank_shards", "samples_of", "spec_fingerprint"]

#: bump when the output for an unchanged spec changes (invalidates data/.generated)
GENERATOR_VERSION = 2


@dataclass(frozen=True)
class SyntheticSpec:
    datasets: tuple[str, ...] = ("coco_2014_vqa", "text_vqa")
    num_samples: int = 150  # per dataset, exp5 covers all of them
    exp6_num_samples: int | None = None  # exp6 covers the first N in dataset order (None = all)
    max_crops: tuple[int, ...] = BALANCED_MAX_CROPS
    top_k: tuple[int, ...] = BALANCED_TOP_K
    num_active_blocks: tuple[int, ...] = BALANCED_NUM_ACTIVE_BLOCKS
    world_size: int = 2  # 1 = single GPU layout
    exp5_batch_size: int = 8  # base per-GPU batch; varied per config like the auto-adjust
    seed: int = 0
    write_images: bool = True
    image_max_side: int = 448  # big enough that the embedded preprocessor tiles them (84-px windows); a few KB each
    indent: int | None = 2  # json.dump indent (origin used indent=2)
    lost_merge_configs: tuple[Config, ...] = ()  # only the rank-0 file exists
    empty_configs: tuple[Config, ...] = ()  # 0 samples processed: NaN accuracy
    experiments: tuple[str, ...] = ("exp5", "exp6")
    # relative frequency of question template families by name (a family not named weighs 1, 0 leaves it out)
    family_weights: tuple[tuple[str, float], ...] = ()
    write_family: bool = True  # False: the family shows only in the question's words, as in real profiles
    # images written at their original size x image_scale (overrides image_max_side): each side becomes
    # round(28 + image_scale * (side - 112)), Molmo's 112-px tiling margin mapped onto the embedded
    # preprocessor's 28 px, nudged by <= 4 px where rounding would change a tiling; at
    # synthetic.truth.TILING_IMAGE_SCALE (0.375 = 84/224) the embedded tiling of every written file
    # (features' image_tilings) is the truth's crop count. None: thumbnails of image_max_side
    image_scale: float | None = None
    # original image sizes: "profile" (DatasetProfile.long_side, ASPECTS) or "vqa" (the real sets'
    # spread where the profile differs: COCO-like photos 480-640 px mostly 4:3, DocVQA portrait pages;
    # synthetic.truth.IMAGE_SIZE_MODELS); every other draw of the truth is the same
    image_sizes: str = "profile"
    # context sentences before the questions, their number drawn per sample around a mean per family
    # (synthetic.truth.PROMPT_CONTEXT_SENTENCES): prompt tokens (family means) 17-68 instead of 12-19
    prompt_context: bool = False


@dataclass(frozen=True)
class SampleTruth:
    """Hidden truth of one sample (dataset order index ``index``)."""

    dataset: str
    index: int
    metadata: dict  # as written in the per-sample dicts
    image_id: int | str  # also set when the metadata has none (OK-VQA, ScienceQA, ...)
    image_file: str
    image_width: int  # original size, used by the tiling rule (the written file is a thumbnail or scaled)
    image_height: int
    detail_need: float
    reasoning_need: float
    difficulty: float
    text_tokens: int


def spec_fingerprint(spec: SyntheticSpec) -> str:
    """Stable hash of a spec and the generator version (for the data/ stamp file)."""
    fields = asdict(spec)
    for name, default in (("family_weights", ()), ("write_family", True), ("image_scale", None),
                          ("image_sizes", "profile"), ("prompt_context", False)):  # the stamps of specs without them
        if fields[name] == default:
            fields.pop(name)
    payload = json.dumps({"version": GENERATOR_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def image_filename(dataset: str, image_id: int | str) -> str:
    """File name under ``images/``: COCO datasets use the val2014 naming, others the id."""
    prof = model.PROFILES[dataset]
    return f"COCO_val2014_{int(image_id):012d}.jpg" if prof.coco_images else f"{image_id}.{prof.image_ext}"


@dataclass
class GeneratedTree:
    """What :func:`generate_tree` wrote, plus the hidden truth behind it."""

    spec: SyntheticSpec
    out_dir: Path
    exp5_dir: Path | None
    exp6_dir: Path | None
    images_dir: Path | None
    files: list[Path]
    num_records: int  # per-sample list entries across all JSON files
    record_counts: dict[str, int]
    configs: list[Config]
    truth: dict[str, DatasetTruth] = field(repr=False)

    @property
    def samples(self) -> list[SampleTruth]:
        return [s for ds in self.spec.datasets for s in samples_of(ds, self.truth[ds])]

    def expected_accuracy(self, dataset: str, sample_index: int, max_crops: int, top_k: int,
                          num_active_blocks: int, experiment: str = "exp5") -> float:
        """E[recorded score] of one sample under a configuration (same p in exp5 and exp6)."""
        return float(self.truth[dataset].expected_score(max_crops, top_k, num_active_blocks, experiment)[sample_index])

    def expected_latency_ms(self, dataset: str, sample_index: int, max_crops: int, top_k: int,
                            num_active_blocks: int) -> float:
        """E[T_total_ms] of one sample under a configuration (without the rare outliers)."""
        return float(self.truth[dataset].expected_latency(max_crops, top_k, num_active_blocks)[sample_index])

    def outcome_table(self, dataset: str, configs: list[Config] | None = None) -> dict[str, np.ndarray]:
        """``configs`` (n_cfg, 3) and ``accuracy`` / ``latency_ms`` of shape (N, n_cfg)."""
        cfgs = configs or self.configs
        t = self.truth[dataset]
        return {"configs": np.array(cfgs, dtype=np.int64),
                "accuracy": np.stack([t.expected_score(*c) for c in cfgs], axis=1),
                "latency_ms": np.stack([t.expected_latency(*c) for c in cfgs], axis=1)}

    def best_config(self, dataset: str, sample_index: int, budget_ms: float) -> Config | None:
        """Oracle: highest expected accuracy with expected latency <= budget (None if none fits)."""
        tab = self.outcome_table(dataset)
        acc = np.where(tab["latency_ms"][sample_index] <= budget_ms, tab["accuracy"][sample_index], -np.inf)
        return None if np.isneginf(acc.max()) else self.configs[int(acc.argmax())]


def samples_of(dataset: str, t: DatasetTruth) -> list[SampleTruth]:
    return [SampleTruth(dataset, i, t.metadata[i], t.image_ids[t.image_index[i]], t.image_files[t.image_index[i]],
                        int(t.width[i]), int(t.height[i]), float(t.detail[i]), float(t.reasoning[i]),
                        float(t.difficulty[i]), int(t.text_tokens[i])) for i in range(t.n)]


def build_truth(spec: SyntheticSpec) -> dict[str, DatasetTruth]:
    """The hidden per-dataset truth of a spec without writing anything."""
    weights = dict(spec.family_weights)
    return {ds: build_dataset(ds, spec.num_samples, spec.seed, weights, spec.write_family, spec.image_sizes,
                              spec.prompt_context) for ds in spec.datasets}


def expected_score_matrix(spec: SyntheticSpec, datasets: Sequence[str], sample_keys: Sequence[str],
                          configs: Sequence[Config]) -> np.ndarray:
    """(N, C) float32: the hidden expected score (exp6) of sample i, named by ``datasets[i]`` and
    ``sample_keys[i]`` as ingest keys it, under each of ``configs``: what a decision on that sample
    is worth without outcome noise. A KeyError names a sample the spec does not generate."""
    return _truth_matrix(spec, datasets, sample_keys, configs,
                         lambda t, c: t.expected_score(*c, experiment="exp6"))


def expected_latency_matrix(spec: SyntheticSpec, datasets: Sequence[str], sample_keys: Sequence[str],
                            configs: Sequence[Config]) -> np.ndarray:
    """(N, C) float32: the hidden expected total latency (ms) of each sample under each configuration, without
    the measurement noise, the outcome's answer length or the slow outliers a recorded latency draws: what a
    perfect cost model could know of a request. Rows and errors as :func:`expected_score_matrix`."""
    return _truth_matrix(spec, datasets, sample_keys, configs, lambda t, c: t.expected_latency(*c))


def _truth_matrix(spec: SyntheticSpec, datasets: Sequence[str], sample_keys: Sequence[str], configs: Sequence[Config],
                  column: Callable[[DatasetTruth, Config], np.ndarray]) -> np.ndarray:
    truth = build_truth(spec)
    rows: dict[tuple[str, str], np.ndarray] = {}
    for ds in spec.datasets:
        values = np.stack([column(truth[ds], c) for c in configs], axis=1)
        for s in samples_of(ds, truth[ds]):
            rows[(ds, build_sample_key(ds, s.metadata)[0])] = values[s.index]
    return np.stack([rows[(ds, key)] for ds, key in zip(datasets, sample_keys)]).astype(np.float32)


# -- distributed emulation ------------------------------------------------------------

def rank_shards(n: int, world_size: int) -> list[list[int]]:
    """DistributedSampler(shuffle=False, drop_last=False): pad by repeating the head, stride W."""
    if world_size == 1:
        return [list(range(n))]
    total = -(-n // world_size) * world_size
    indices = list(range(n))
    while len(indices) < total:
        indices += indices[: total - len(indices)]
    return [indices[r:total:world_size] for r in range(world_size)]


def exp5_batch_size(base: int, max_crops: int, top_k: int, blocks: int) -> int:
    """_find_optimal_batch_size (§4.2) against a synthetic memory limit, then x0.85."""
    crops_f = next((f for c, f in ((2, 1.0), (4, 0.8), (6, 0.6), (8, 0.5), (10, 0.4), (12, 0.3)) if max_crops <= c),
                   0.25)
    topk_f = next((f for k, f in ((4, 1.0), (8, 0.9), (16, 0.8), (32, 0.7)) if top_k <= k), 0.6)
    ratio = blocks / NUM_TOTAL_BLOCKS
    blk_f = 1.0 if ratio <= 0.25 else 0.9 if ratio <= 0.5 else 0.8 if ratio <= 0.75 else 0.7
    est = max(1, int(base * min(crops_f, topk_f, blk_f)))
    if max_crops <= 2 and top_k <= 4 and blocks <= NUM_TOTAL_BLOCKS * 0.5:
        allowed = base * 2
    elif max_crops <= 4 and top_k <= 8:
        allowed = int(base * 1.5)
    else:
        allowed = base
    fits = lambda bs: bs * (max_crops + 1) * (0.6 + 0.05 * top_k) * ratio <= 6.0 * base  # noqa: E731
    cur, working = min(est, allowed), None
    for attempt in range(5):
        if fits(cur):
            working = cur
            nxt = min(allowed, int(cur * 1.5))
            if cur < allowed and attempt < 4 and nxt > cur:
                cur = nxt
                continue
            break
        old = cur
        cur = max(1, (working + old) // 2) if working is not None else max(1, old // 2)
        if cur == old:
            break
    found = working if working is not None else cur
    return max(1, int(found * 0.85))


# -- the writer -----------------------------------------------------------------------

@dataclass
class _RunClock:
    """Deterministic wall clock for start/end times (derived from the seed, never now())."""

    t: datetime

    def span(self, seconds: float) -> tuple[str, str, float]:
        start, self.t = self.t, self.t + timedelta(seconds=seconds)
        fmt = "%Y-%m-%d %H:%M:%S"
        out = (start.strftime(fmt), self.t.strftime(fmt), seconds)
        self.t += timedelta(seconds=1.7)  # re-configuration between configs
        return out


class _Writer:
    def __init__(self, spec: SyntheticSpec, out_dir: Path) -> None:
        self.spec, self.out = spec, out_dir
        self.js = JsonText(spec.indent)
        self.files: list[Path] = []
        self.records = {"exp5": 0, "exp6": 0}
        self.configs = balanced_combinations(spec.max_crops, spec.top_k, spec.num_active_blocks)

    def write(self, path: Path, obj: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.js.value(obj), encoding="ascii")
        self.files.append(path)

    # per-sample dict fragments ------------------------------------------------------
    def pred_templates(self, t: DatasetTruth, sample_id_hole: bool) -> list[list[list[str]]]:
        """For each sample and outcome: the §4.1 dict split at its holes.

        Holes: sample_id (if requested) and, for captions, score + coco_metrics.
        """
        metric = t.profile.metric
        out = []
        for i in range(t.n):
            meta, extra = Raw(self.js.value(t.metadata[i], 3)), t.extra[i]
            rows = []
            for o in range(3):
                sid = HOLE if sample_id_hole else 0
                pred = t.preds[i][o]
                if metric == "mc":
                    d = {"sample_id": sid, "score": float(t.scores[i, o]), "pred": pred,
                         "answer_idx": extra["answer_idx"], "predicted_idx": int(t.pred_idx[i, o]),
                         "options": extra["options"], "metadata": meta}
                elif metric == "cider_score":
                    d = {"sample_id": sid, "pred": pred, "captions": extra["captions"], "metadata": meta,
                         "score": HOLE, "coco_metrics": HOLE}
                else:
                    d = {"sample_id": sid, "score": float(t.scores[i, o]), "pred": pred, "answers": extra["answers"],
                         "metadata": meta}
                rows.append(self.js.template(d))
            out.append(rows)
        return out

    def coco_metrics(self, cider: float) -> str:
        m = {"Bleu_1": 0.45 + 0.2 * min(cider, 1.5), "Bleu_2": 0.28 + 0.18 * min(cider, 1.5),
             "Bleu_3": 0.17 + 0.14 * min(cider, 1.5), "Bleu_4": 0.1 + 0.12 * min(cider, 1.5),
             "METEOR": 0.14 + 0.08 * min(cider, 1.5), "ROUGE_L": 0.36 + 0.14 * min(cider, 1.5), "CIDEr": cider}
        return self.js.value(m, 3)

    # exp5 ---------------------------------------------------------------------------
    def exp5(self, ds: str, t: DatasetTruth, clock: _RunClock) -> None:
        spec, W = self.spec, self.spec.world_size
        d = self.out / "exp5" / dataset_dir_names(ds)[0]
        tmpl = self.pred_templates(t, sample_id_hole=True)
        shards = rank_shards(t.n, W)
        summary, all_samples = [], []
        for ci, (C, K, B) in enumerate(self.configs):
            bs = exp5_batch_size(spec.exp5_batch_size, C, K, B)
            per_rank_texts, per_rank_scores = self._exp5_ranks(ds, t, shards, (C, K, B), bs, tmpl)
            acc0, std0 = accuracy_mean_std(per_rank_scores[0], empty=math.nan)
            lat = t.expected_latency(C, K, B)
            n_batches = -(-len(per_rank_texts[0]) // bs)
            batch_s = float(np.mean(lat)) * (0.5 + 0.5 * bs) / 1000.0 if t.n else 0.0
            start, end, dur = clock.span(4.0 * 3 + 2.5 + n_batches * batch_s)
            block_ix = list(exp_active_blocks(B))
            base_cfg = {"dataset_name": ds, "split": t.profile.split, "batch_size": spec.exp5_batch_size,
                        "max_new_tokens": model.MAX_NEW_TOKENS, "max_crops": C, "top_k": K, "num_active_blocks": B,
                        "num_total_blocks": NUM_TOTAL_BLOCKS, "active_block_indices": block_ix}
            head = {"max_crops": C, "top_k": K, "num_active_blocks": B}
            timing = {"duration_seconds": dur, "duration_minutes": dur / 60.0, "duration_hours": dur / 3600.0,
                      "start_time": start, "end_time": end}
            incremental = {
                "summary": [{**head, "accuracy": acc0, "num_samples": len(per_rank_scores[0]), "std": std0, **timing}],
                "all_samples": self.js.array(per_rank_texts[0], 1),
                "config": {**base_cfg, "batch_size_used": bs, "world_size": W, "rank": 0, "config_index": ci,
                           "sampling_strategy": "balanced"},
            }
            self.write(d / exp5_name(C, K, B, rank=0 if W > 1 else None), incremental)
            self.records["exp5"] += len(per_rank_texts[0])
            if (C, K, B) in spec.lost_merge_configs:
                continue  # the gather never happened: rank 0's file is all there is
            merged_texts = [x for texts in per_rank_texts for x in texts]
            acc, std = accuracy_mean_std([x for scores in per_rank_scores for x in scores], empty=math.nan)
            entry = {**head, "accuracy": acc, "num_samples": len(merged_texts), "std": std}
            if W > 1:
                self.write(d / exp5_name(C, K, B), {
                    "summary": [entry], "all_samples": self.js.array(merged_texts, 1),
                    "config": {**base_cfg, "world_size": W, "note": MERGE_NOTE}})
                self.records["exp5"] += len(merged_texts)
            else:  # single GPU: the final summary keeps durations and times
                entry.update(timing)
            summary.append(entry)
            all_samples += merged_texts
        self.write(d / EXP5_FINAL_NAME, {
            "summary": summary, "all_samples": self.js.array(all_samples, 1),
            "config": self._final_config(ds, t, spec.exp5_batch_size)})
        self.records["exp5"] += len(all_samples)

    def _exp5_ranks(self, ds: str, t: DatasetTruth, shards: list[list[int]], knob: Config, batch_size: int,
                    tmpl: list[list[list[str]]]) -> tuple[list[list[str]], list[list[float]]]:
        """Each rank's exp5 record texts and scores of one configuration, batch by batch (the
        ``sample_id`` is the position in the batch)."""
        spec, (C, K, B) = self.spec, knob
        is_cider = t.profile.metric == "cider_score"
        empty = (C, K, B) in spec.empty_configs
        codes = t.outcomes(C, K, B, stream(spec.seed, ds, 2, C, K, B))
        quality = self._cider_quality(t, codes, stream(spec.seed, ds, 5, C, K, B)) if is_cider else None
        per_rank_texts, per_rank_scores = [], []
        for shard in shards:
            texts, scores = [], []
            for b0 in range(0, 0 if empty else len(shard), batch_size):
                batch = shard[b0:b0 + batch_size]
                if is_cider:  # batch-level CIDEr copied to every sample of the batch (§4.1)
                    cider = float(np.mean([quality[s] for s in batch]))
                    metrics = self.coco_metrics(cider)
                    texts += [fill(tmpl[s][codes[s]], [str(j), float.__repr__(cider), metrics])
                              for j, s in enumerate(batch)]
                    scores += [cider] * len(batch)
                else:
                    texts += [fill(tmpl[s][codes[s]], [str(j)]) for j, s in enumerate(batch)]
                    scores += [float(t.scores[s, codes[s]]) for s in batch]
            per_rank_texts.append(texts)
            per_rank_scores.append(scores)
        return per_rank_texts, per_rank_scores

    def _final_config(self, ds: str, t: DatasetTruth, batch_size: int) -> dict:
        return {"dataset_name": ds, "split": t.profile.split, "batch_size": batch_size,
                "max_new_tokens": model.MAX_NEW_TOKENS, "max_crops_list": list(self.spec.max_crops),
                "top_k_list": list(self.spec.top_k), "num_active_blocks_list": list(self.spec.num_active_blocks),
                "sampling_strategy": "balanced", "num_combinations": len(self.configs),
                "world_size": self.spec.world_size}

    @staticmethod
    def _cider_quality(t: DatasetTruth, codes: np.ndarray, rng: np.random.Generator) -> list[float]:
        u = rng.random(t.n)
        good = model.CIDER_GOOD[0] + u * (model.CIDER_GOOD[1] - model.CIDER_GOOD[0])
        poor = model.CIDER_POOR[0] + u * (model.CIDER_POOR[1] - model.CIDER_POOR[0])
        return np.where(codes == 0, good, poor).tolist()

    # exp6 ---------------------------------------------------------------------------
    def exp6(self, ds: str, t: DatasetTruth, clock: _RunClock) -> None:
        spec, W = self.spec, self.spec.world_size
        d = self.out / "exp6" / dataset_dir_names(ds)[1]
        pred_tmpl = self.pred_templates(t, sample_id_hole=False)  # predictions' sample_id is always 0
        lat_tmpl = self.js.template({k: HOLE for k in (
            "sample_id", "max_crops", "top_k", "num_active_blocks", "T_total_ms", "T_prefill_ms", "T_decode_ms",
            "num_vision_tokens", "num_language_tokens", "num_output_tokens", "num_total_tokens", "accuracy")})
        shards = rank_shards(t.n, W)
        if spec.exp6_num_samples is not None:  # per rank num_samples // W, first part of each shard
            per_rank = spec.exp6_num_samples // W if W > 1 else spec.exp6_num_samples
            shards = [s[:per_rank] for s in shards]
        summary, all_samples = [], []
        for C, K, B in self.configs:
            per_rank = self._exp6_ranks(ds, t, shards, (C, K, B), lat_tmpl, pred_tmpl)
            block_ix = list(exp_active_blocks(B))
            rank0 = per_rank[0]
            start, end, dur = clock.span(3.0 + (4 * sum(rank0[2][:1]) + sum(rank0[2]) + 12.0 * len(rank0[2])) / 1000.0)
            cfg = {"dataset_name": ds, "split": t.profile.split, "batch_size": 1,
                   "max_new_tokens": model.MAX_NEW_TOKENS, "max_crops": C, "top_k": K, "num_active_blocks": B,
                   "num_total_blocks": NUM_TOTAL_BLOCKS, "active_block_indices": block_ix, "world_size": W}
            self.write(d / exp6_name(C, K, B, rank=0), {
                "summary": [self._exp6_summary(C, K, B, [rank0], block_ix)],
                "per_sample_latencies": self.js.array(rank0[0], 1),
                "per_sample_predictions": self.js.array(rank0[1], 1), "config": cfg})
            self.records["exp6"] += 2 * len(rank0[0])
            if (C, K, B) in spec.lost_merge_configs:
                continue
            entry = self._exp6_summary(C, K, B, per_rank, None)
            lat_all = [x for r in per_rank for x in r[0]]
            if W > 1:
                self.write(d / exp6_name(C, K, B), {
                    "summary": [entry], "per_sample_latencies": self.js.array(lat_all, 1),
                    "per_sample_predictions": self.js.array([x for r in per_rank for x in r[1]], 1),
                    "config": {**cfg, "note": MERGE_NOTE}})
                self.records["exp6"] += 2 * len(lat_all)
            else:
                entry.update({"duration_seconds": dur, "duration_minutes": dur / 60.0, "duration_hours": dur / 3600.0,
                              "start_time": start, "end_time": end})
            summary.append(entry)
            all_samples += lat_all
        self.write(d / EXP6_FINAL_NAME, {
            "summary": summary, "all_samples": self.js.array(all_samples, 1), "config": self._final_config(ds, t, 1)})
        self.records["exp6"] += len(all_samples)

    def _exp6_ranks(self, ds: str, t: DatasetTruth, shards: list[list[int]], knob: Config, lat_tmpl: list[str],
                    pred_tmpl: list[list[list[str]]]) -> list[tuple]:
        """Each rank's exp6 records of one configuration: (latency texts, prediction texts, total,
        prefill figure, decode, score), the numbers as lists."""
        spec, (C, K, B), W = self.spec, knob, self.spec.world_size
        is_cider = t.profile.metric == "cider_score"
        zero_metrics = self.coco_metrics(0.0)
        empty = (C, K, B) in spec.empty_configs
        codes = t.outcomes(C, K, B, stream(spec.seed, ds, 3, C, K, B))
        vision, prefill, step = t.latency_parts(C, K, B)
        nv, seq = t.vision_tokens(C), t.sequence_length(C)
        noise_rng = stream(spec.seed, ds, 4, C, K, B, W)
        per_rank = []
        for shard in shards:
            idx = np.array([] if empty else shard, dtype=np.int64)
            m = len(idx)
            noise = np.exp(noise_rng.normal(-model.LAT_NOISE_SIGMA ** 2 / 2, model.LAT_NOISE_SIGMA, (m, 4)))
            slow = np.where(noise_rng.random(m) < 0.005, 1.3 + 0.7 * noise_rng.random(m), 1.0)
            code = codes[idx]
            n_out = t.out_tokens[idx, code]
            step_s = step[idx] * noise[:, 2]
            decode = np.where(n_out > 1, (n_out - 1) * step_s, 0.0)
            llm_pre = prefill[idx] * noise[:, 1]
            total = (model.LAT_OVERHEAD * noise[:, 3] + vision[idx] * noise[:, 0] + llm_pre + decode) * slow
            # D1: the hooks keep overwriting, so "prefill" is blocks 1..15 of the last forward
            blocks_1_15 = np.where(n_out > 1, step_s - model.LAT_DECODE_HEAD, llm_pre) * (B - 1) / B
            score = t.scores[idx, code] if not is_cider else np.zeros(m)
            lat_texts, pred_texts = [], []
            for j, (s, c, tt, tp, td, no, sc) in enumerate(zip(idx.tolist(), code.tolist(), total.tolist(),
                                                               blocks_1_15.tolist(), decode.tolist(),
                                                               n_out.tolist(), score.tolist())):
                nvi, nli = int(nv[s]), int(seq[s])
                lat_texts.append(fill(lat_tmpl, [str(j), str(C), str(K), str(B), repr(tt), repr(tp), repr(td),
                                                  str(nvi), str(nli), str(no), str(nvi + nli), repr(sc)]))
                parts = pred_tmpl[s][c]
                pred_texts.append(fill(parts, ["0.0", zero_metrics]) if is_cider else parts[0])
            per_rank.append((lat_texts, pred_texts, total.tolist(), blocks_1_15.tolist(), decode.tolist(),
                             score.tolist()))
        return per_rank

    @staticmethod
    def _exp6_summary(C: int, K: int, B: int, ranks: list, block_ix: list[int] | None) -> dict:
        total, pre, dec, scores = ([x for r in ranks for x in r[k]] for k in (2, 3, 4, 5))
        entry: dict = {"max_crops": C, "top_k": K, "num_active_blocks": B}
        if block_ix is not None:  # the rank file's summary also carries the block info
            entry.update(num_total_blocks=NUM_TOTAL_BLOCKS, active_block_indices=block_ix)
        entry.update(num_samples=len(total), accuracy=accuracy_mean_std(scores, empty=math.nan)[0],
                     latency_total_ms=latency_statistics(total), latency_prefill_ms=latency_statistics(pre),
                     latency_decode_ms=latency_statistics(dec))
        return entry


# -- images ----------------------------------------------------------------------------

def _write_images(spec: SyntheticSpec, truth: dict[str, DatasetTruth], images_dir: Path) -> list[Path]:
    """One small image per distinct image: coloured shapes; many small marks when detailed."""
    images_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for ds in spec.datasets:
        t = truth[ds]
        rng = stream(spec.seed, ds, 6)
        scaled = None if spec.image_scale is None else model.scaled_image_sizes(t.image_size, spec.image_scale)
        for k, name in enumerate(t.image_files):
            if scaled is not None:
                w, h = (int(x) for x in scaled[k])
            else:
                w0, h0 = (int(x) for x in t.image_size[k])
                scale = min(1.0, spec.image_max_side / max(w0, h0)) if spec.image_max_side else 1.0
                w, h = max(8, round(w0 * scale)), max(8, round(h0 * scale))
            bg = tuple(int(x) for x in rng.integers(40, 216, 3))
            img = Image.new("RGB", (w, h), bg)
            draw = ImageDraw.Draw(img)
            for _ in range(int(rng.integers(2, 5))):  # a few large objects
                x0, y0 = int(rng.integers(0, w * 3 // 4)), int(rng.integers(0, h * 3 // 4))
                box = [x0, y0, x0 + int(rng.integers(w // 6, w // 2 + 1)), y0 + int(rng.integers(h // 6, h // 2 + 1))]
                fill = tuple(int(x) for x in rng.integers(0, 256, 3))
                (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
            for _ in range(int(3 + 25 * t.image_detail[k])):  # text-like strokes / small objects
                x0, y0 = int(rng.integers(0, w - 3)), int(rng.integers(0, h - 2))
                draw.rectangle([x0, y0, x0 + int(rng.integers(1, 5)), y0 + 1],
                               fill=(0, 0, 0) if sum(bg) > 380 else (255, 255, 255))
            path = images_dir / name
            if path.suffix == ".png":
                img.save(path, format="PNG", optimize=False)
            else:
                img.save(path, format="JPEG", quality=75)
            written.append(path)
    return written


# -- entry point -----------------------------------------------------------------------

def _validate(spec: SyntheticSpec) -> None:
    bad = [d for d in spec.datasets if d not in model.PROFILES]
    if bad:
        msg = f"unsupported datasets {bad}; choose from {', '.join(SUPPORTED_DATASETS)}"
        raise ValueError(msg)
    if spec.world_size < 1 or spec.num_samples < 0 or spec.exp5_batch_size < 1:
        msg = "world_size and exp5_batch_size must be >= 1, num_samples >= 0"
        raise ValueError(msg)
    if set(spec.experiments) - {"exp5", "exp6"}:
        msg = f"experiments must be a subset of ('exp5', 'exp6'), got {spec.experiments}"
        raise ValueError(msg)
    for b in spec.num_active_blocks:
        exp_active_blocks(b)  # raises on values outside 1..16
    if spec.image_scale is not None and not spec.image_scale > 0:
        msg = f"image_scale must be > 0 (or None), got {spec.image_scale!r}"
        raise ValueError(msg)
    if spec.image_sizes not in model.IMAGE_SIZES:
        msg = f"image_sizes must be one of {model.IMAGE_SIZES}, got {spec.image_sizes!r}"
        raise ValueError(msg)


def generate_tree(spec: SyntheticSpec, out_dir: Path, *, overwrite: bool = False) -> GeneratedTree:
    """Write ``out_dir/{exp5,exp6,images}`` for ``spec``; byte-identical for equal specs.

    Existing non-empty ``exp5``/``exp6``/``images`` subdirectories raise FileExistsError
    unless ``overwrite`` is set, in which case those three (and nothing else) are removed.
    """
    _validate(spec)
    out_dir = Path(out_dir)
    subdirs = [out_dir / s for s in ("exp5", "exp6", "images")]
    for sub in subdirs:
        if sub.exists() and any(sub.iterdir()):
            if not overwrite:
                msg = f"{sub} is not empty (pass overwrite=True to replace it)"
                raise FileExistsError(msg)
            shutil.rmtree(sub)
    truth = build_truth(spec)
    writer = _Writer(spec, out_dir)
    # runs start at a seed-derived instant; exp5 then exp6 per dataset, like the scripts
    clock = _RunClock(datetime(2025, 10, 6, 9, 0, 0) + timedelta(minutes=(spec.seed * 7919) % (60 * 24 * 30)))
    for ds in spec.datasets:
        for exp in ("exp5", "exp6"):
            if exp in spec.experiments:
                getattr(writer, exp)(ds, truth[ds], clock)
                clock.t += timedelta(minutes=7)
    images_dir = out_dir / "images" if spec.write_images else None
    files = writer.files + (_write_images(spec, truth, images_dir) if images_dir else [])
    return GeneratedTree(
        spec=spec, out_dir=out_dir,
        exp5_dir=out_dir / "exp5" if "exp5" in spec.experiments else None,
        exp6_dir=out_dir / "exp6" if "exp6" in spec.experiments else None,
        images_dir=images_dir, files=sorted(files), num_records=sum(writer.records.values()),
        record_counts=dict(writer.records), configs=list(writer.configs), truth=truth)
