"""Hidden synthetic model behind :mod:`synthetic` (datasets, accuracy, latency).

Everything here is deterministic given ``(seed, dataset)`` and uses numpy only. The
writer in :mod:`synthetic` turns these tables into exp5/exp6 JSON trees; the
model itself is documented in that module's docstring and in ``data/README.md``. Sections (§)
and defect labels (D1 ..) cite docs/origin_format.md.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

import numpy as np

from pipeline.knobs import NUM_TOTAL_BLOCKS, TOKENS_PER_CROP, exp_active_blocks
from pipeline.knobs import select_tiling as knobs_select_tiling

# -- Molmo image geometry (docs/origin_format.md §2.1)
CROP_WINDOW_PX = 224
TOTAL_MARGIN_PX = 112
# -- the embedded model's preprocessor (runtime/embedded_model.py: 112-px crops, a 14-px margin a side)
EMBEDDED_WINDOW_PX = 84
EMBEDDED_TOTAL_MARGIN_PX = 28
#: the ``SyntheticSpec.image_scale`` at which the embedded preprocessor tiles a written image exactly
#: as Molmo's rule tiles its original size (window over window: 84 / 224)
TILING_IMAGE_SCALE = EMBEDDED_WINDOW_PX / CROP_WINDOW_PX
#: the max_crops values whose tilings a written image is made to agree on (features store 1..15)
TILING_CHECK_MAX_CROPS = tuple(range(1, 16))
#: global image in the sequence: start + 12 rows x (12 patches + 1 col token) + end
GLOBAL_IMAGE_SEQ_TOKENS = 1 + 12 * 13 + 1

# -- accuracy model (logit units)
A_DETAIL = 5.0  # detail need x missing visual capacity
A_BLOCK_BASE = 3.0  # every sample suffers from dropped blocks ...
A_BLOCK_REASON = 5.0  # ... reasoning-heavy ones much more
A_TOPK = 4.0  # missing experts hurt reasoning-heavy samples
#: synthetic per-block importance; block 0 and the last block matter most, so the
#: exp5/exp6 subsets (which drop block 15 for n <= 12) are penalised accordingly
BLOCK_IMPORTANCE = np.array([3.0, 1.2, 1.0, 1.0, 0.6, 1.1, 0.8, 0.9, 1.0, 0.9, 0.6, 0.9, 0.9, 0.6, 1.0, 1.5])
CIDER_GOOD = (0.8, 1.4)  # per-sample CIDEr-like quality ranges (uniform) for good / poor captions
CIDER_POOR = (0.1, 0.6)

# -- latency model (ms)
LAT_OVERHEAD = 55.0  # generate() set-up, host work, lm_head of the first token
LAT_VISION_BASE, LAT_VISION_PER_IMAGE = 6.0, 11.0  # ViT + pooling + projector per image array
LAT_PREFILL_BLOCK = 0.9  # per active block, fixed
LAT_PREFILL_TOKEN, LAT_PREFILL_TOKEN_K = 0.0024, 0.00036  # per block per token (+ per expert)
LAT_DECODE_BLOCK, LAT_DECODE_BLOCK_K = 0.95, 0.075  # per block per decode step (+ per expert)
LAT_DECODE_HEAD = 1.3  # lm_head + sampling + HF bookkeeping per decode step
LAT_NOISE_SIGMA = 0.05  # lognormal, mean-one
MAX_NEW_TOKENS = 16

# -- vocabulary (small on purpose; enough to make questions and answers look real)
COLORS = ["red", "blue", "green", "white", "black", "yellow", "brown", "gray", "orange", "pink"]
OBJECTS = ["dog", "cat", "bus", "car", "pizza", "umbrella", "bicycle", "horse", "train", "clock", "kite",
           "cake", "bench", "boat", "giraffe", "laptop", "surfboard", "skateboard", "sheep", "elephant"]
PEOPLE = ["man", "woman", "boy", "girl", "player", "person"]
PLACES = ["kitchen", "beach", "street", "park", "living room", "airport", "field", "bathroom"]
SPORTS = ["tennis", "baseball", "soccer", "frisbee", "skiing", "surfing"]
THINGS = ["bottle", "shirt", "phone", "camera", "sign", "can", "box", "bus", "jersey", "banner"]
BRANDS = ["coca cola", "nike", "samsung", "sony", "pepsi", "adidas", "canon", "heineken", "toyota", "apple"]
WORDS = ["stop", "exit", "open", "sale", "welcome", "police", "taxi", "menu", "coffee", "hotel", "bus stop",
         "one way", "pharmacy", "bakery", "parking"]
USES = ["transportation", "eating", "cutting", "cooking", "sleeping", "writing", "surfing", "protection"]
COUNTRIES = ["italy", "japan", "mexico", "france", "india", "china", "germany", "spain"]
FAMILIES = ["feline", "canine", "equine", "bovine", "ursine", "avian"]
DECADES = ["1950s", "1960s", "1970s", "1980s", "1990s"]
STATES = ["Maine", "Texas", "Ohio", "Oregon", "Florida", "Iowa", "Nevada", "Georgia", "Utah", "Vermont"]
PROPERTIES = ["hard", "soft", "stretchy", "fragile", "sticky", "bumpy", "shiny", "salty"]
ANIMALS = ["camel", "polar bear", "otter", "gecko", "penguin", "fennec fox", "walrus", "jerboa"]
PLACE_NAMES = ["Lake Tahoe", "the Sahara", "Mount Rainier", "the Amazon", "Yellowstone", "the Arctic"]
DOC_FIELDS = ["date", "total amount", "name of the company", "page number", "invoice number"]
STORES = ["store", "restaurant", "street", "bank", "hotel"]
NUMBERS = [str(i) for i in range(9)]


@dataclass(frozen=True)
class DatasetProfile:
    """How one origin dataset looks: metric, ids, image sizes, question mix, base rate."""

    name: str
    metric: str  # vqa_score | anls | mc | em | cider_score (the per-sample dict layout, §4.1)
    split: str
    coco_images: bool  # COCO_val2014_<id>.jpg file names and integer image ids
    image_ext: str
    long_side: tuple[int, int]  # original image long side range (px)
    questions_per_image: tuple[int, int]
    base_logit: float
    id_base: int  # integer image ids are drawn above this (disjoint per dataset)


PROFILES: dict[str, DatasetProfile] = {
    p.name: p
    for p in (
        DatasetProfile("coco_2014_vqa", "vqa_score", "validation", True, "jpg", (420, 900), (1, 4), 2.2, 100_000),
        DatasetProfile("text_vqa", "vqa_score", "validation", False, "jpg", (700, 1600), (1, 2), 2.0, 0),
        DatasetProfile("okvqa", "vqa_score", "validation", True, "jpg", (420, 900), (1, 2), 1.0, 200_000),
        DatasetProfile("doc_qa", "anls", "validation", False, "png", (1000, 2200), (1, 3), 1.9, 0),
        DatasetProfile("st_qa", "anls", "validation", False, "jpg", (600, 1400), (1, 2), 1.5, 0),
        DatasetProfile("science_qa_img", "mc", "validation", False, "png", (300, 800), (1, 1), 2.2, 0),
        DatasetProfile("tally_qa", "em", "test", True, "jpg", (420, 900), (1, 1), 1.4, 300_000),
        DatasetProfile("coco_caption", "cider_score", "validation", True, "jpg", (420, 900), (1, 1), 1.6, 400_000),
    )
}
SUPPORTED_DATASETS: tuple[str, ...] = tuple(PROFILES)
#: per dataset, the question template families in template order (written as ``metadata.family``);
#: each template has its own detail and reasoning means, so the knob sensitivities differ by family
QUESTION_FAMILIES: dict[str, tuple[str, ...]] = {
    "coco_2014_vqa": ("color", "count", "presence", "holding", "place", "sport"),
    "text_vqa": ("brand", "written_text", "number", "clock_time", "book_title"),
    "okvqa": ("use", "food_origin", "animal_family", "decade"),
    "doc_qa": ("document_field",),
    "st_qa": ("store_name",),
    "science_qa_img": ("farthest_state", "adaptation", "offspring_ratio", "common_property"),
    "tally_qa": ("tally_count",),
    "coco_caption": ("caption",),
}
ASPECTS = np.array([0.5, 0.75, 1.0, 4 / 3, 1.5, 16 / 9, 2.0, 3.0])
ASPECT_P = np.array([0.06, 0.16, 0.12, 0.34, 0.12, 0.1, 0.06, 0.04])


@dataclass(frozen=True)
class SizeModel:
    """Original image sizes of one dataset: long side uniform in ``long_side``, aspect (width / height)
    drawn from ``aspects`` with probabilities ``aspect_p``."""

    long_side: tuple[int, int]
    aspects: tuple[float, ...]
    aspect_p: tuple[float, ...]


_COCO_LIKE = SizeModel((480, 640), (4 / 3, 3 / 4, 3 / 2, 2 / 3, 1.0, 16 / 9, 9 / 16),
                       (0.5, 0.17, 0.1, 0.05, 0.08, 0.07, 0.03))
#: ``SyntheticSpec.image_sizes="vqa"``: the size spread of the real sets where the profile's differs
#: (COCO photos 480-640 px, mostly 4:3; DocVQA portrait pages); the others keep their profile's
IMAGE_SIZE_MODELS: dict[str, dict[str, SizeModel]] = {
    "vqa": {
        "coco_2014_vqa": _COCO_LIKE, "okvqa": _COCO_LIKE, "tally_qa": _COCO_LIKE, "coco_caption": _COCO_LIKE,
        "doc_qa": SizeModel((1000, 2200), (0.65, 1 / 2 ** 0.5, 8.5 / 11, 0.85), (0.15, 0.4, 0.35, 0.1)),
    },
}
IMAGE_SIZES = ("profile", *IMAGE_SIZE_MODELS)

#: ``SyntheticSpec.prompt_context``: mean number of context sentences put before a question, per
#: template family (each about 12 tokens; drawn per sample, Poisson); families not named get none
PROMPT_CONTEXT_SENTENCES: dict[str, float] = {
    "color": 0.3, "count": 1.0, "presence": 0.3, "holding": 2.0, "place": 3.0, "sport": 1.0,
    "brand": 1.0, "written_text": 0.5, "number": 2.0, "clock_time": 1.5, "book_title": 3.0,
    "use": 2.0, "food_origin": 3.0, "animal_family": 2.5, "decade": 4.0,
    "document_field": 4.0, "store_name": 1.5,
    "farthest_state": 2.0, "adaptation": 3.0, "offspring_ratio": 4.0, "common_property": 2.5,
}


def stream(seed: int, dataset: str, *parts: int) -> np.random.Generator:
    """An independent, reproducible random stream keyed by seed, dataset and purpose."""
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(dataset.encode()), *parts]))


def count_tokens(text: str) -> int:
    """Rough GPT-NeoX token count: words (long ones cost two), digit triples, punctuation."""
    n = 0
    for tok in re.findall(r"[A-Za-z]+|\d{1,3}|[^\sA-Za-z\d]", text):
        n += 2 if len(tok) > 8 else 1
    return max(n, 1)


def select_tiling(height: np.ndarray, width: np.ndarray, max_crops: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised Molmo tiling rule (§2.1) for original image sizes; returns (rows, cols)."""
    rows, cols = knobs_select_tiling(np.asarray(height), np.asarray(width), max_crops,
                                     window_px=CROP_WINDOW_PX, total_margin_px=TOTAL_MARGIN_PX)
    return np.atleast_1d(rows), np.atleast_1d(cols)


def embedded_tiling(height: np.ndarray, width: np.ndarray, max_crops: int) -> tuple[np.ndarray, np.ndarray]:
    """The embedded model's tiling of written image sizes (84-px windows, 28-px margin); (rows, cols)."""
    rows, cols = knobs_select_tiling(np.asarray(height), np.asarray(width), max_crops,
                                     window_px=EMBEDDED_WINDOW_PX, total_margin_px=EMBEDDED_TOTAL_MARGIN_PX)
    return np.atleast_1d(rows), np.atleast_1d(cols)


def scaled_image_sizes(size: np.ndarray, scale: float, max_nudge: int = 4) -> np.ndarray:
    """(n, 2) written (width, height) for original sizes ``size`` (n, 2) at ``scale``.

    Each side becomes ``round(28 + scale * (side - 112))``: the original scaled, Molmo's 112-px tiling
    margin mapped onto the embedded preprocessor's 28 px. At ``TILING_IMAGE_SCALE`` (84 / 224) the
    embedded tiling of the file is then the truth's tiling of the original (the scales each tiling
    compares are equal). Where rounding would flip one of those comparisons (a side 112 + 8k is exact),
    each side is moved by at most ``max_nudge`` px to the nearest size whose embedded tiling equals the
    truth's at every max_crops of ``TILING_CHECK_MAX_CROPS``; if none does, the rounded size stays.
    """
    size = np.asarray(size, dtype=np.int64).reshape(-1, 2)
    out = np.maximum(8, np.round(EMBEDDED_TOTAL_MARGIN_PX + scale * (size - TOTAL_MARGIN_PX))).astype(np.int64)
    truth = [select_tiling(size[:, 1], size[:, 0], c) for c in TILING_CHECK_MAX_CROPS]

    def agrees(written: np.ndarray, rows: np.ndarray) -> np.ndarray:
        ok = np.ones(len(written), dtype=bool)
        for (tr, tc), c in zip(truth, TILING_CHECK_MAX_CROPS):
            r, k = embedded_tiling(written[:, 1], written[:, 0], c)
            ok &= (r == tr[rows]) & (k == tc[rows])
        return ok

    bad = np.flatnonzero(~agrees(out, np.arange(len(out))))
    steps = sorted(((dw, dh) for dw in range(-max_nudge, max_nudge + 1) for dh in range(-max_nudge, max_nudge + 1)
                    if dw or dh), key=lambda d: (abs(d[0]) + abs(d[1]), d))
    for dw, dh in steps:
        if not len(bad):
            break
        cand = np.maximum(8, out[bad] + np.array([dw, dh]))
        ok = agrees(cand, bad)
        out[bad[ok]] = cand[ok]
        bad = bad[~ok]
    return out


def block_deficit(num_active_blocks: int) -> float:
    """Share of (synthetic) block importance missing from the exp5/exp6 active subset."""
    active = list(exp_active_blocks(num_active_blocks, NUM_TOTAL_BLOCKS))
    return float(1.0 - BLOCK_IMPORTANCE[active].sum() / BLOCK_IMPORTANCE.sum())


def topk_deficit(top_k: int) -> float:
    return float(np.exp(-top_k / 3.5))


@dataclass
class DatasetTruth:
    """Hidden per-sample truth of one synthetic dataset, in dataset order."""

    profile: DatasetProfile
    # per image
    image_ids: list  # int or str
    image_files: list[str]
    image_size: np.ndarray  # (n_images, 2) original (width, height)
    image_detail: np.ndarray  # (n_images,) mean detail need of its questions (drives drawing)
    # per sample
    image_index: np.ndarray  # (N,) -> image row
    detail: np.ndarray  # (N,) in [0, 1]: small text / objects, wants crops
    reasoning: np.ndarray  # (N,) in [0, 1]: wants experts and blocks
    difficulty: np.ndarray  # (N,) intrinsic logit offset
    text_tokens: np.ndarray  # (N,) prompt tokens without image placeholders (BOS included)
    metadata: list[dict]  # the §4.1 metadata dict, as written
    extra: list[dict]  # metric-specific fields (answers, options, answer_idx, captions)
    preds: list[tuple[str, str, str]]  # prediction text for outcome (correct, partial, wrong)
    pred_idx: np.ndarray  # (N, 3) mc predicted_idx per outcome (-1 elsewhere)
    scores: np.ndarray  # (N, 3) score per outcome (cider: unused, drawn per record)
    out_tokens: np.ndarray  # (N, 3) generated tokens incl. EOS per outcome
    partial_prob: np.ndarray  # (N,) P(partial | not correct)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return len(self.metadata)

    @property
    def width(self) -> np.ndarray:
        return self.image_size[self.image_index, 0]

    @property
    def height(self) -> np.ndarray:
        return self.image_size[self.image_index, 1]

    # -- geometry -----------------------------------------------------------------
    def tiling(self, max_crops: int) -> tuple[np.ndarray, np.ndarray]:
        key = ("tiling", max_crops)
        if key not in self._cache:
            self._cache[key] = select_tiling(self.height, self.width, max_crops)
        return self._cache[key]

    def num_crops(self, max_crops: int) -> np.ndarray:
        rows, cols = self.tiling(max_crops)
        return rows * cols

    def vision_tokens(self, max_crops: int) -> np.ndarray:
        """Valid ``image_input_idx`` entries: global 144 + the pooled crop grid without overlaps.

        Never above the theoretical (crops + 1) x 144; equal for a single crop.
        """
        rows, cols = self.tiling(max_crops)
        return TOKENS_PER_CROP + (8 * rows + 4) * (8 * cols + 4)

    def sequence_length(self, max_crops: int) -> np.ndarray:
        """``input_ids.shape[1]``: text + every image placeholder, col and start/end token."""
        rows, cols = self.tiling(max_crops)
        crop_seq = 1 + (8 * rows + 4) * (8 * cols + 5) + 1
        return self.text_tokens + GLOBAL_IMAGE_SEQ_TOKENS + crop_seq

    # -- accuracy -----------------------------------------------------------------
    def p_correct(self, max_crops: int, top_k: int, num_active_blocks: int) -> np.ndarray:
        """P(correct answer) = sigmoid(base + difficulty - sum of need x missing capacity)."""
        key = ("p", max_crops, top_k, num_active_blocks)
        if key not in self._cache:
            n = self.num_crops(max_crops)
            vis = np.log2(1 + n) / np.log2(13.0)  # 1 crop 0.27, 2: 0.43, 6: 0.76, 10: 0.93
            w, h = self.width, self.height
            size = np.clip((w * h / (640.0 * 480.0)) ** 0.25, 0.8, 1.4)  # big images lose more
            logit = (self.profile.base_logit + self.difficulty
                     - A_DETAIL * self.detail * (1 - vis) * size
                     - (A_BLOCK_BASE + A_BLOCK_REASON * self.reasoning) * block_deficit(num_active_blocks)
                     - A_TOPK * (0.3 + self.reasoning) * topk_deficit(top_k))
            self._cache[key] = 1.0 / (1.0 + np.exp(-logit))
        return self._cache[key]

    def outcome_probs(self, max_crops: int, top_k: int, num_active_blocks: int) -> np.ndarray:
        p = self.p_correct(max_crops, top_k, num_active_blocks)
        q = (1 - p) * self.partial_prob
        return np.stack([p, q, 1 - p - q], axis=1)

    def expected_score(self, max_crops: int, top_k: int, num_active_blocks: int,
                       experiment: str = "exp5") -> np.ndarray:
        """E[recorded per-sample score]. Captions: E[per-sample CIDEr] in exp5, 0 in exp6 (D19)."""
        probs = self.outcome_probs(max_crops, top_k, num_active_blocks)
        if self.profile.metric == "cider_score":
            if experiment == "exp6":
                return np.zeros(self.n)
            return probs[:, 0] * np.mean(CIDER_GOOD) + (1 - probs[:, 0]) * np.mean(CIDER_POOR)
        return (probs * self.scores).sum(axis=1)

    def outcomes(self, max_crops: int, top_k: int, num_active_blocks: int, rng: np.random.Generator) -> np.ndarray:
        """Draw one outcome per sample: 0 correct, 1 partial, 2 wrong."""
        u = rng.random(self.n)
        cum = np.cumsum(self.outcome_probs(max_crops, top_k, num_active_blocks), axis=1)
        return (u[:, None] >= cum[:, :2]).sum(axis=1).astype(np.int64)

    # -- latency ------------------------------------------------------------------
    def latency_parts(self, max_crops: int, top_k: int,
                      num_active_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Noise-free (vision, LLM prefill, one decode step incl. head) in ms per sample."""
        n = self.num_crops(max_crops)
        vision = LAT_VISION_BASE + LAT_VISION_PER_IMAGE * (n + 1)
        seq = self.sequence_length(max_crops)
        prefill = num_active_blocks * (LAT_PREFILL_BLOCK + seq * (LAT_PREFILL_TOKEN + LAT_PREFILL_TOKEN_K * top_k))
        step = num_active_blocks * (LAT_DECODE_BLOCK + LAT_DECODE_BLOCK_K * top_k) + LAT_DECODE_HEAD
        return vision, prefill, np.full(self.n, step)

    def expected_latency(self, max_crops: int, top_k: int, num_active_blocks: int) -> np.ndarray:
        """E[T_total_ms] (noise is mean-one; rare slow outliers are not included)."""
        vision, prefill, step = self.latency_parts(max_crops, top_k, num_active_blocks)
        probs = self.outcome_probs(max_crops, top_k, num_active_blocks)
        n_out = (probs * self.out_tokens).sum(axis=1)
        return LAT_OVERHEAD + vision + prefill + (n_out - 1) * step


# -- dataset construction -----------------------------------------------------------

def _pick(rng: np.random.Generator, pool: list[str], exclude: tuple[str, ...] = ()) -> str:
    choices = [x for x in pool if x not in exclude]
    return choices[int(rng.integers(len(choices)))]


def _template(rng: np.random.Generator, name: str, family_weights: dict[str, float] | None) -> int:
    """The index of dataset ``name``'s question template: uniform (the default stream), or drawn by
    ``family_weights`` where they name one of its families."""
    families = QUESTION_FAMILIES[name]
    if not family_weights or not any(f in family_weights for f in families):
        return int(rng.integers(len(families)))
    weights = np.array([float(family_weights.get(f, 1.0)) for f in families])
    if weights.sum() <= 0 or (weights < 0).any():
        msg = f"family weights of {name} must be >= 0 and not all 0, got {dict(zip(families, weights.tolist()))}"
        raise ValueError(msg)
    return int(rng.choice(len(families), p=weights / weights.sum()))


def _vqa_question(name: str, rng: np.random.Generator,
                  family_weights: dict[str, float] | None = None) -> tuple[str, str, list[str], float, float, str]:
    """(question, answer, answer pool, detail mean, reasoning mean, template family) for open-ended VQA."""
    obj, thing = _pick(rng, OBJECTS), _pick(rng, THINGS)
    if name == "coco_2014_vqa":
        kind = _template(rng, name, family_weights)
        q, pool, det, rea = [
            (f"What color is the {obj}?", COLORS, 0.3, 0.15),
            (f"How many {obj}s are in the picture?", NUMBERS, 0.6, 0.35),
            (f"Is there a {obj} in the image?", ["yes", "no"], 0.12, 0.1),
            (f"What is the {_pick(rng, PEOPLE)} holding?", OBJECTS, 0.4, 0.3),
            ("Where was this picture taken?", PLACES, 0.15, 0.45),
            ("What sport is being played?", SPORTS, 0.2, 0.3),
        ][kind]
    elif name == "text_vqa":
        kind = _template(rng, name, family_weights)
        q, pool, det, rea = [
            (f"What brand is the {thing}?", BRANDS, 0.75, 0.2),
            (f"What is written on the {thing}?", WORDS, 0.85, 0.15),
            (f"What number is on the {thing}?", [str(x) for x in rng.integers(2, 9999, 6)], 0.9, 0.15),
            ("What time is shown on the clock?",
             [f"{h}:{m:02d}" for h, m in zip(rng.integers(1, 13, 6), rng.integers(0, 12, 6) * 5)], 0.7, 0.55),
            ("What is the title of the book?",
             [f"the {w} {p}" for w, p in zip(rng.choice(WORDS, 6),
                                             rng.choice(["story", "guide", "diaries", "club"], 6))], 0.85, 0.2),
        ][kind]
    elif name == "okvqa":
        kind = _template(rng, name, family_weights)
        q, pool, det, rea = [
            (f"What is this {obj} used for?", USES, 0.2, 0.7),
            ("Which country is famous for this food?", COUNTRIES, 0.25, 0.8),
            ("What family does this animal belong to?", FAMILIES, 0.2, 0.7),
            (f"In which decade was this type of {obj} popular?", DECADES, 0.3, 0.85),
        ][kind]
    elif name == "doc_qa":
        fld = _pick(rng, DOC_FIELDS)
        by_field = {"date": [f"march {d}, 19{y}" for d, y in zip(rng.integers(1, 29, 6), rng.integers(50, 99, 6))],
                    "total amount": [f"${int(x):,}.00" for x in rng.integers(10, 9999, 6)],
                    "page number": [str(x) for x in rng.integers(1, 40, 6)],
                    "invoice number": [str(x) for x in rng.integers(10000, 99999, 6)]}
        pool = by_field.get(fld, [f"{b} inc." for b in BRANDS])
        q, det, rea = f"What is the {fld} mentioned in the document?", 0.85, 0.45
        kind = 0
    else:
        store = _pick(rng, STORES)
        q, pool, det, rea = f"What is the name of the {store}?", [f"{w} {store}" for w in WORDS], 0.8, 0.25
        kind = 0
    pool = [str(x) for x in pool]
    return q, _pick(rng, pool), pool, det, rea, QUESTION_FAMILIES[name][kind]


def _vqa_answers(rng: np.random.Generator, main: str, alt: str, n_alt: int) -> list[str]:
    """Ten annotator answers: the majority answer, an alternative (0-2 votes), maybe a stray one."""
    stray = 1 if rng.random() < 0.3 else 0
    answers = [main] * (10 - n_alt - stray) + [alt] * n_alt + [main + "s"] * stray
    order = rng.permutation(len(answers))
    return [answers[i] for i in order]


def _science_question(rng: np.random.Generator, seen: set) -> tuple[str, list[str], int, float, float, str]:
    """(question, options, answer index, detail mean, reasoning mean, template family), unique per call."""
    while True:
        kind = int(rng.integers(4))
        if kind == 0:
            d = _pick(rng, ["north", "south", "east", "west"])
            q, opts, det, rea = (f"Which of these states is farthest {d}?",
                                 list(rng.choice(STATES, 4, replace=False)), 0.55, 0.55)
        elif kind == 1:
            env = _pick(rng, ["cold places", "deserts", "water", "snow"])
            q, opts, det, rea = (f"Which animal is also adapted to survive in {env}?",
                                 list(rng.choice(ANIMALS, 2, replace=False)), 0.35, 0.7)
        elif kind == 2:
            trait = _pick(rng, ["brown fur", "curly hair", "red eyes", "long wings"])
            q, opts, det, rea = (f"What is the expected ratio of offspring with {trait} to offspring without it?",
                                 ["0:4", "1:3", "2:2", "3:1", "4:0"], 0.25, 0.9)
        else:
            k = int(rng.integers(2, 5))
            q, opts, det, rea = (f"Which property do these {k} objects have in common?",
                                 list(rng.choice(PROPERTIES, 3, replace=False)), 0.5, 0.55)
        if rng.random() < 0.3:  # D18: the loader replaces the question with "hint\nhint"
            hint = f"Figure: {_pick(rng, PLACE_NAMES)}."
            q = f"{hint}\n{hint}"
        opts = [str(o) for o in opts]
        if (q, tuple(opts)) not in seen:  # ScienceQA has no ids: question + options must identify it
            seen.add((q, tuple(opts)))
            return q, opts, int(rng.integers(len(opts))), det, rea, QUESTION_FAMILIES["science_qa_img"][kind]


def _image_id(profile: DatasetProfile, rng: np.random.Generator, k: int, last: int) -> int | str:
    if profile.coco_images:
        return last + int(rng.integers(1, 5))  # disjoint ranges per dataset, increasing
    if profile.name == "text_vqa":
        return "".join(f"{int(x):x}" for x in rng.integers(0, 16, 16))
    prefix = {"science_qa_img": "sqa", "doc_qa": "doc", "st_qa": "stvqa"}[profile.name]
    return f"{prefix}_{k:06d}"


def build_dataset(name: str, num_samples: int, seed: int, family_weights: dict[str, float] | None = None,
                  write_family: bool = True, image_sizes: str = "profile",
                  prompt_context: bool = False) -> DatasetTruth:
    """Build ``num_samples`` samples of dataset ``name`` in dataset order (images grouped).

    ``family_weights``: relative frequencies of question template families by name (a family not
    named weighs 1, 0 leaves it out; default: every template equally likely, the stream of
    earlier versions). ``write_family``: record each sample's family as ``metadata.family``
    (False: the family shows only in the question's words, as in real profiles).
    ``image_sizes``: ``"profile"`` (the profile's long side and ``ASPECTS``) or a key of
    ``IMAGE_SIZE_MODELS`` (its datasets' sizes drawn from their own stream instead; every other
    draw unchanged). ``prompt_context``: put ``PROMPT_CONTEXT_SENTENCES`` sentences of context
    before each question (their own stream; nothing else changes but the question and its tokens)."""
    if name not in PROFILES:
        msg = f"unsupported synthetic dataset {name!r}; choose from {', '.join(SUPPORTED_DATASETS)}"
        raise ValueError(msg)
    if image_sizes not in IMAGE_SIZES:
        msg = f"image_sizes must be one of {IMAGE_SIZES}, got {image_sizes!r}"
        raise ValueError(msg)
    prof = PROFILES[name]
    rng = stream(seed, name, 1)
    size_model = IMAGE_SIZE_MODELS.get(image_sizes, {}).get(name)
    size_rng = stream(seed, name, 8) if size_model is not None else None
    image_ids: list = []
    image_files: list[str] = []
    sizes: list[tuple[int, int]] = []
    clutter: list[float] = []
    rows: list[dict] = []
    seen_sqa: set = set()
    last_id = prof.id_base
    example_counter = 34602 + int(rng.integers(0, 1000))
    while len(rows) < num_samples:
        k = len(image_ids)
        image_id = _image_id(prof, rng, k, last_id)
        if isinstance(image_id, int):
            last_id = image_id
        long_side = int(rng.integers(prof.long_side[0], prof.long_side[1] + 1))
        aspect = float(rng.choice(ASPECTS, p=ASPECT_P))  # width / height
        if size_model is not None:  # the main stream's two draws above stay, so nothing else moves
            long_side = int(size_rng.integers(size_model.long_side[0], size_model.long_side[1] + 1))
            aspect = float(size_rng.choice(np.array(size_model.aspects), p=np.array(size_model.aspect_p)))
        w, h = ((long_side, max(int(round(long_side / aspect)), 150)) if aspect >= 1
                else (max(int(round(long_side * aspect)), 150), long_side))
        image_ids.append(image_id)
        image_files.append(f"COCO_val2014_{image_id:012d}.jpg" if prof.coco_images else f"{image_id}.{prof.image_ext}")
        sizes.append((w, h))
        clutter.append(float(rng.beta(2, 2)))
        lo, hi = prof.questions_per_image
        for q in range(min(int(rng.integers(lo, hi + 1)), num_samples - len(rows))):
            rows.append(_build_sample(prof, rng, k, image_id, q, example_counter, seen_sqa, family_weights,
                                      write_family))
            example_counter += 1 + int(rng.integers(0, 3))
    if prompt_context:
        _add_prompt_context(rows, stream(seed, name, 7))
    n = len(rows)
    img_ix = np.array([r["image"] for r in rows], dtype=np.int64)
    clutter_arr = np.array(clutter)
    detail = np.clip(np.array([r["det"] for r in rows]) + 0.5 * (clutter_arr[img_ix] - 0.5) + rng.normal(0, 0.12, n),
                     0, 1)
    reasoning = np.clip(np.array([r["rea"] for r in rows]) + rng.normal(0, 0.15, n), 0, 1)
    image_detail = np.bincount(img_ix, weights=detail) / np.bincount(img_ix)
    out_tokens = np.array([[min(count_tokens(p) + 1, MAX_NEW_TOKENS) for p in r["preds"]] for r in rows],
                          dtype=np.int64)
    return DatasetTruth(
        profile=prof, image_ids=image_ids, image_files=image_files, image_size=np.array(sizes, dtype=np.int64),
        image_detail=image_detail, image_index=img_ix, detail=detail, reasoning=reasoning,
        difficulty=rng.normal(0, 0.9, n), text_tokens=np.array([r["text_tokens"] for r in rows], dtype=np.int64),
        metadata=[r["metadata"] for r in rows], extra=[r["extra"] for r in rows],
        preds=[r["preds"] for r in rows], pred_idx=np.array([r["pred_idx"] for r in rows], dtype=np.int64),
        scores=np.array([r["scores"] for r in rows], dtype=np.float64), out_tokens=out_tokens,
        partial_prob=np.array([r["partial"] for r in rows], dtype=np.float64),
    )


def _context_sentence(rng: np.random.Generator) -> str:
    kind = int(rng.integers(6))
    if kind == 0:
        return f"This picture shows a {_pick(rng, COLORS)} {_pick(rng, OBJECTS)} near the {_pick(rng, PLACES)}."
    if kind == 1:
        return f"It was taken by a {_pick(rng, PEOPLE)} in the {_pick(rng, DECADES)}."
    if kind == 2:
        return f"Look carefully at the {_pick(rng, THINGS)} and the {_pick(rng, OBJECTS)} before answering."
    if kind == 3:
        return f"The {_pick(rng, OBJECTS)} and the {_pick(rng, THINGS)} in the background may both matter."
    if kind == 4:
        return f"The image comes from a collection about {_pick(rng, USES)} in {_pick(rng, COUNTRIES)}."
    return "Answer with a single word or a short phrase."


def _add_prompt_context(rows: list[dict], rng: np.random.Generator) -> None:
    """Put context sentences before the questions (``PROMPT_CONTEXT_SENTENCES`` by family); the
    ScienceQA questions the loader replaces with "hint\\nhint" (D18) and rows without a question stay."""
    for row in rows:
        meta = row["metadata"]
        question = meta.get("question")
        count = int(rng.poisson(PROMPT_CONTEXT_SENTENCES.get(row["family"], 0.0)))
        if not count or not isinstance(question, str) or "\n" in question:
            continue
        question = " ".join([_context_sentence(rng) for _ in range(count)] + [question])
        meta["question"] = question
        row["text_tokens"] = count_tokens(question) + 6


def _build_sample(prof: DatasetProfile, rng: np.random.Generator, k: int, image_id, q: int,
                  counter: int, seen_sqa: set, family_weights: dict[str, float] | None = None,
                  write_family: bool = True) -> dict:
    """One sample's texts, metadata (§4.1/§8 key order) and per-outcome pred/score table."""
    row: dict = {"image": k, "pred_idx": (-1, -1, -1), "partial": 0.0}
    name = prof.name
    if prof.metric in ("vqa_score", "anls"):
        question, main, pool, det, rea, family = _vqa_question(name, rng, family_weights)
        others = [x for x in pool if x != main] or ["unanswerable"]
        wrong = _pick(rng, others)
        if prof.metric == "vqa_score":
            n_alt = int(rng.choice([0, 1, 2], p=[0.45, 0.35, 0.2]))
            alt = _pick(rng, others + ["unanswerable"], exclude=(wrong,))
            answers = _vqa_answers(rng, main, alt, n_alt)
            partial_score = min(n_alt / 3.0, 1)  # molmo vqa_score: min(#matches / 3, 1)
            row["partial"] = 0.4 if n_alt else 0.0
        else:  # ANLS: a near miss (last character dropped) scores 1 - 1/len
            answers = [main] if rng.random() < 0.6 else [main, main.title()]
            alt = main[:-1]
            partial_score = 1 - 1 / len(main) if len(main) > 2 else 0.0
            row["partial"] = 0.35 if partial_score > 0 else 0.0
        if name == "coco_2014_vqa":
            meta = {"image_id": image_id, "example_id": image_id * 1000 + q}
        elif name == "text_vqa":
            meta = {"image_id": image_id, "example_id": counter}
        elif name == "okvqa":
            meta = {"example_id": image_id * 10 + q}
        else:
            meta = {"example_id": counter}
        meta.update(answers=answers, question=question)
        row.update(preds=(main, alt, wrong), scores=(1.0, partial_score, 0.0), extra={"answers": answers})
    elif prof.metric == "mc":
        question, options, answer_idx, det, rea, family = _science_question(rng, seen_sqa)
        wrong_idx = (answer_idx + 1 + int(rng.integers(len(options) - 1))) % len(options)
        as_letter = rng.random() < 0.8  # MolmoE usually answers with the letter, sometimes the text
        pred = [chr(65 + i) if as_letter else options[i] for i in (answer_idx, wrong_idx, wrong_idx)]
        meta = {"answer_idx": answer_idx, "options": options, "question": question}
        row.update(preds=tuple(pred), scores=(1.0, 0.0, 0.0), pred_idx=(answer_idx, wrong_idx, wrong_idx),
                   extra={"answer_idx": answer_idx, "options": options})
    elif prof.metric == "em":  # TallyQA: one sample per image, answers of all its questions
        obj = _pick(rng, OBJECTS)
        question = f"How many {obj}s are there?"
        answers = [str(int(x)) for x in rng.integers(0, 7, int(rng.integers(2, 5)))]
        wrong = str(max(int(a) for a in answers) + 1 + int(rng.integers(0, 3)))
        det, rea, family = 0.7, 0.3, QUESTION_FAMILIES[name][0]
        meta = {"image_id": image_id, "answers": answers}
        row.update(preds=(answers[0], answers[0], wrong), scores=(1.0, 1.0, 0.0), extra={"answers": answers})
    else:  # coco_caption
        obj, place = _pick(rng, OBJECTS), _pick(rng, PLACES)
        captions = [f"A {_pick(rng, COLORS)} {obj} {verb} in the {place}." for verb in
                    ("standing", "sitting", "parked", "shown", "seen")]
        good = f"a {obj} in the {place}"
        poor = f"a picture of a {_pick(rng, OBJECTS, exclude=(obj,))}"
        question, det, rea, family = "Caption:", 0.3, 0.2, QUESTION_FAMILIES[name][0]
        meta = {"image_id": image_id, "caption_id": 700_000 + 7 * k + int(rng.integers(0, 7)), "captions": captions}
        row.update(preds=(good, poor, poor), scores=(1.0, 0.0, 0.0), extra={"captions": captions})
    if write_family:
        meta["family"] = family  # last key: the origin's keys keep their order
    row.update(metadata=meta, det=det, rea=rea, text_tokens=count_tokens(question) + 6, family=family)
    return row
