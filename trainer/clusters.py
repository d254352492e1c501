"""Question families found without labels: clusters of the language features, the number of
clusters chosen by the out-of-fold score of the lookup table they give (``lut_by_cluster``).

Real exp5/exp6 trees rarely label a question's family, but the family shows in the question
(VQA's own ``question_type`` is its first words), and so in its language features. Here:

* :func:`kmeans` clusters unit-length language features (k-means++ start and Lloyd steps,
  seeded, so the same data and seed give the same clusters); a cluster smaller than
  ``min_cluster_size`` is dissolved into its neighbours, since a table needs enough samples
  for a 95th percentile;
* :func:`choose_num_clusters` scores every candidate number of clusters by cross-fitting on the
  training samples: cluster the other folds, fit one table per cluster there, read each held-out
  question's cluster from its nearest clustered questions (as a server would), and average the
  reward of that table's decisions over the budget grid. The best mean wins, the smaller count on a
  tie (one cluster is ``lut_p95`` itself). A stricter rule (the smallest count within one standard
  error of the best) chose one cluster where the labelled family table gains, docs/results.md;
  the fallback's per-budget check against ``lut_p95`` guards the other side;
* :func:`cluster_table` fits the chosen clustering on all training samples and returns the
  per-cluster tables as a :class:`trainer.baselines.QuestionFamilyTableDecider`, each cluster
  a family named by its question's most frequent leading words (:func:`cluster_names`), so it is
  exported and served as the labelled family table is.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from trainer.baselines import UNFAMILIAR_QUANTILE, LookupTableDecider, QuestionFamilyTableDecider
from trainer.data import OfflineData
from trainer.reward import RewardConfig, compute_reward

__all__ = ["CLUSTER_TABLE", "NUM_CLUSTERS_CANDIDATES", "ClusterChoice", "choose_num_clusters", "cluster_names",
           "cluster_table", "kmeans", "leading_words"]

#: the name of the per-cluster table decider
CLUSTER_TABLE = "lut_by_cluster"
#: the cluster counts :func:`choose_num_clusters` tries by default
NUM_CLUSTERS_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
#: the smallest cluster kept: fewer samples cannot give a table its 95th percentile
MIN_CLUSTER_SIZE = 20
#: neighbours that read a new question's cluster (as ``lut_by_question`` reads a family)
READ_NEIGHBOURS = 15
#: the most words a cluster's name takes from its questions
NAME_WORDS = 4


def kmeans(features: torch.Tensor, k: int, seed: int = 0, iterations: int = 50,
           min_cluster_size: int = MIN_CLUSTER_SIZE) -> torch.Tensor:
    """(N,) int64 cluster indices in [0, k') for the rows of ``features`` (N, D), k' <= k: k-means on
    the unit-length rows (k-means++ start, ``iterations`` Lloyd steps at most), then every cluster
    under ``min_cluster_size`` dissolved into the nearest remaining ones (smallest first), indices
    renumbered by first appearance. Deterministic in ``seed``."""
    n = features.shape[0]
    if k < 1:
        msg = f"`k` must be >= 1, got {k!r}"
        raise ValueError(msg)
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    x = torch.nn.functional.normalize(features.double(), dim=1)
    k = min(k, max(1, n // max(1, min_cluster_size)))
    if k == 1:
        return torch.zeros(n, dtype=torch.long)
    generator = torch.Generator().manual_seed(int(seed))
    centres = x[torch.randint(n, (1,), generator=generator)]
    for _ in range(1, k):  # k-means++: the next centre drawn by squared distance to the nearest one
        nearest = torch.cdist(x, centres).amin(1).square()
        if float(nearest.sum()) <= 0:
            break
        centres = torch.cat([centres, x[torch.multinomial(nearest, 1, generator=generator)]])
    assign = torch.cdist(x, centres).argmin(1)
    for _ in range(iterations):
        centres = _centres(x, assign, len(centres))
        moved = torch.cdist(x, centres).argmin(1)
        if torch.equal(moved, assign):
            break
        assign = moved
    while len(centres) > 1:
        sizes = torch.bincount(assign, minlength=len(centres))
        smallest = int(sizes.argmin())
        if int(sizes[smallest]) >= min_cluster_size:
            break
        keep = [j for j in range(len(centres)) if j != smallest]
        centres = centres[keep]
        assign = torch.cdist(x, centres).argmin(1)
        centres = _centres(x, assign, len(centres))
    _, first = torch.unique(assign, return_inverse=True)  # drop empty indices
    order = {}
    for j in first.tolist():
        order.setdefault(j, len(order))
    return torch.tensor([order[j] for j in first.tolist()], dtype=torch.long)


def _centres(x: torch.Tensor, assign: torch.Tensor, k: int) -> torch.Tensor:
    """The mean row of each cluster (a cluster left empty keeps a zero centre, which nothing is nearest)."""
    sums = torch.zeros(k, x.shape[1], dtype=x.dtype).index_add_(0, assign, x)
    counts = torch.bincount(assign, minlength=k).clamp(min=1)
    return sums / counts[:, None].to(x.dtype)


_WORD = re.compile(r"[a-z0-9']+")


def leading_words(question: str | None, words: int = NAME_WORDS) -> tuple[str, ...]:
    """The first ``words`` words of ``question``, lower-cased, punctuation dropped (() for None)."""
    return tuple(_WORD.findall((question or "").lower())[:words])


def cluster_names(assign: torch.Tensor, questions: Sequence[str | None] | None) -> list[str]:
    """A readable, unique name per cluster of ``assign``: the longest leading-word phrase that more
    than half of the cluster's questions start with (else its most frequent first two words),
    followed by "..."; ``cluster <j>`` where the data has no question text. A name two clusters
    share is told apart by ``#<j>``."""
    k = int(assign.max()) + 1 if len(assign) else 0
    names = []
    for j in range(k):
        members = (assign == j).nonzero().flatten().tolist()
        texts = [leading_words(questions[i]) for i in members] if questions is not None else []
        texts = [t for t in texts if t]
        name = f"cluster {j}"
        if texts:
            best = None
            for length in range(NAME_WORDS, 0, -1):
                phrase, count = Counter(t[:length] for t in texts if len(t) >= length).most_common(1)[0] \
                    if any(len(t) >= length for t in texts) else ((), 0)
                if count * 2 > len(texts):
                    best = phrase
                    break
            if best is None:
                best = Counter(t[:2] for t in texts).most_common(1)[0][0]
            name = " ".join(best) + " ..."
        names.append(name)
    seen = Counter(names)
    return [f"{name} #{j}" if seen[name] > 1 else name for j, name in enumerate(names)]


def _table(train: OfflineData, assign: torch.Tensor, names: Sequence[str]) -> QuestionFamilyTableDecider:
    labelled = replace(train, family=[names[int(j)] for j in assign])
    return QuestionFamilyTableDecider(labelled, neighbours=READ_NEIGHBOURS, name=CLUSTER_TABLE,
                                      unfamiliar_quantile=UNFAMILIAR_QUANTILE)


@dataclass(frozen=True)
class ClusterChoice:
    """The out-of-fold evidence behind a cluster count.

    num_clusters: the chosen count (clusters may come out fewer, see :func:`kmeans`);
    candidates: the counts tried; mean_reward / reward_se: per candidate, the mean out-of-fold
    reward of its table over samples and budgets, and the standard error of its paired difference
    to the best candidate's.
    """

    num_clusters: int
    candidates: tuple[int, ...]
    mean_reward: tuple[float, ...]
    reward_se: tuple[float, ...]


def choose_num_clusters(train: OfflineData, grid_ms: Sequence[float], reward: RewardConfig, *, seed: int = 0,
                        folds: int = 5, candidates: Sequence[int] = NUM_CLUSTERS_CANDIDATES) -> ClusterChoice:
    """The number of clusters whose table scores best out of fold on ``train`` (the module docstring):
    the best mean reward over samples and budgets, the smaller count on a tie."""
    n = len(train)
    candidates = tuple(sorted({int(c) for c in candidates if int(c) >= 1}))
    if not candidates:
        msg = "`candidates` must hold at least one count >= 1"
        raise ValueError(msg)
    if n < 2 * folds or len(candidates) == 1:
        return ClusterChoice(candidates[0], candidates, (math.nan,) * len(candidates), (math.nan,) * len(candidates))
    fold = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) + 1)) % folds
    knobs = train.action_space.knob_values().float()
    budgets = [float(b) for b in grid_ms]
    rewards = [compute_reward(train.score, train.latency_ms, torch.full((n, 1), b), knobs[None], reward)["reward"]
               .double() for b in budgets]
    per_sample = torch.zeros(len(candidates), n, dtype=torch.float64)
    for f in range(folds):
        inside, held = (fold != f).nonzero().flatten(), (fold == f).nonzero().flatten()
        part, out = train.select(inside), train.select(held)
        for c, k in enumerate(candidates):
            if k == 1:
                table = LookupTableDecider(part)
            else:
                assign = kmeans(part.lang_features, k, seed)
                table = _table(part, assign, [f"c{j}" for j in range(int(assign.max()) + 1)])
            for b, reward_at in zip(budgets, rewards):
                chosen = table.decide(out, b)
                per_sample[c, held] += reward_at[held, :][torch.arange(len(held)), chosen] / len(budgets)
    mean = per_sample.mean(1)
    best = int(mean.argmax())
    se = torch.tensor([float((per_sample[c] - per_sample[best]).std() / math.sqrt(n)) for c in range(len(candidates))])
    return ClusterChoice(candidates[best], candidates, tuple(mean.tolist()), tuple(se.tolist()))


def cluster_table(train: OfflineData, grid_ms: Sequence[float], reward: RewardConfig, *, seed: int = 0,
                  num_clusters: int | None = None,
                  min_cluster_size: int = MIN_CLUSTER_SIZE) -> QuestionFamilyTableDecider:
    """``lut_by_cluster`` fitted on ``train``: its questions clustered (``num_clusters``, or the count
    :func:`choose_num_clusters` picks), one table per cluster, each question's cluster read from its
    nearest clustered training questions. One cluster gives no families (``has_families`` False):
    the ``lut_p95`` table decides every sample. ``min_cluster_size``: see :func:`kmeans`."""
    k = num_clusters
    if k is None:
        k = choose_num_clusters(train, grid_ms, reward, seed=seed).num_clusters
    assign = kmeans(train.lang_features, k, seed, min_cluster_size=min_cluster_size)
    if len(assign) == 0 or int(assign.max()) == 0:
        return QuestionFamilyTableDecider(replace(train, family=None), name=CLUSTER_TABLE)
    return _table(train, assign, cluster_names(assign, train.question))

