"""What one request costs and what it gets at each configuration, from its own tiling, prompt and question.

A configuration's latency is not one number: MolmoE's tiling turns one ``max_crops`` into 1-12 crops
by the image's shape, the prompt's length adds prefill tokens and the answer's length adds decode
steps. :class:`RequestCostModel` predicts each request's latency at every configuration from what is
known before the vision pass, with a structure that follows the work:

    latency(request, C/K/B) = fixed(K, B) + image(K, B) * (crops + 1) + prompt(K, B) * prompt_tokens
                              + per_token(K, B) * answer_tokens(question, C/K/B)

``crops`` is the number of crops this image tiles into at ``max_crops`` C (``image_tilings``; the +1 is
the global crop), so two configurations that differ only in C but give the image the same crops get
the same prediction, and a tiling the profile never saw is extrapolated along the fitted line (and
flagged), never clamped. ``answer_tokens`` is the median of the request's predicted answer length: a
multinomial logistic regression (a linear probe, L2 chosen on held-out samples) from its language
features to the generated lengths the profile recorded for it, plus the configuration's mean shift
of the length (no family labels needed; it tells short and long answers apart far better than the
question clusters do, docs/results.md). The four coefficients per (top-K, blocks) are a median
regression (iteratively reweighted least absolute deviations) on the profile's per-sample latencies
with the recorded answer lengths.

The quantile is conformalized quantile regression (Romano et al., 2019): the same formula at the
``quantile`` of the request's predicted answer length gives a first bound, and the ``quantile`` of the
held-out excesses ``(latency - bound) / median`` over out-of-fold predictions (``folds`` folds by sample)
widens it: ``quantile_ms = bound + q * median``. A question whose answers are one word is held to a
tight bound, one whose answers run long or vary to a wide one, and the share covered is the level
asked for on requests like the profile's.

A request whose tiling is unknown (no readable image) is costed from its configuration's spread over
the profile (``cost_basis`` "configuration"); an unknown prompt length reads as the profile's median.

:class:`RequestScoreTable` estimates what a configuration gives a request the same way: the mean
score per (question cluster, top-K, blocks, crops used), shrunk toward the pooled (top-K, blocks,
crops used) mean plus the cluster's offset. Deciders built on both are in :mod:`trainer.request_table`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from trainer.clusters import kmeans
from trainer.data import ActionSpace, OfflineData

__all__ = ["REQUEST_COST_CHECK", "REQUEST_COST_FILE", "CostQuality", "RequestCostConfig",
           "RequestCostModel", "RequestScoreTable",
           "cost_quality", "crops_used", "fit_request_cost", "fit_request_cost_out_of_fold",
           "lookup_cells", "question_clusters"]

#: the run's cost model (fitted on the train split) and its check on the val split, in the run directory
REQUEST_COST_FILE = "request_cost.pt"
REQUEST_COST_CHECK = "request_cost.json"
#: the design columns of the latency regression, in order
TERMS = ("fixed", "image", "prompt", "decode")


@dataclass
class RequestCostConfig:
    """How the per-request cost model is fitted.

    quantile: the latency quantile a budget is compared with (float in (0, 1), default 0.95).
    clusters: question clusters whose answer lengths and scores are pooled (int >= 1, default 8;
        fewer where the training data is small).
    prior_samples: shrinkage of a cell's mean toward its parent, in samples (float >= 0, default 5).
    folds: folds by sample of the out-of-fold predictions that calibrate the quantile (int >= 2, default 5).
    seed: the clusters' k-means and the folds (int, default 0).
    """

    quantile: float = 0.95
    clusters: int = 8
    prior_samples: float = 5.0
    folds: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile < 1.0:
            msg = f"`quantile` must be in (0, 1), got {self.quantile!r}"
            raise ValueError(msg)
        for name, low in (("clusters", 1), ("folds", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                msg = f"`{name}` must be an integer >= {low}, got {value!r}"
                raise ValueError(msg)
        if not self.prior_samples >= 0:
            msg = f"`prior_samples` must be >= 0, got {self.prior_samples!r}"
            raise ValueError(msg)



def crops_used(action_space: ActionSpace, tiling_crops: Tensor | None, n: int) -> Tensor:
    """(N, A) float32: the crops each request's image tiles into at each configuration's ``max_crops``
    (``tiling_crops`` (N, C) per ``max_crops_values`` entry; NaN where unknown, all NaN without tilings)."""
    if tiling_crops is None:
        return torch.full((n, len(action_space)), float("nan"))
    column = action_space.knob_indices()[:, 0]
    return tiling_crops.float()[:, column]


def question_clusters(lang: Tensor, centres: Tensor) -> Tensor:
    """(N,) int64: the cluster whose unit-length centre is most similar (cosine) to each row of ``lang``."""
    if centres.shape[0] <= 1:
        return torch.zeros(lang.shape[0], dtype=torch.long)
    return torch.mm(nn.functional.normalize(lang.float(), dim=1), centres.t()).argmax(1)


def _cluster_centres(lang: Tensor, wanted: int, seed: int) -> Tensor:
    """(K, L) unit-length centres of the k-means clusters of ``lang``'s rows."""
    assign = kmeans(lang, wanted, seed=seed)
    k = int(assign.max()) + 1 if len(assign) else 1
    unit = nn.functional.normalize(lang.double(), dim=1)
    centres = torch.zeros(k, lang.shape[1], dtype=torch.float64).index_add_(0, assign, unit)
    return nn.functional.normalize(centres, dim=1).float()


class _CellMeans:
    """A mean per (cluster, group, crops used), shrunk toward (group, crops used) plus the cluster's offset,
    and per (cluster, action) for requests whose crops are unknown.

    ``values`` (N, A) float with ``weight`` (N, A) bool saying which count; ``cluster`` (N,) in [0, K);
    ``group`` (A,) in [0, G); ``crops`` (N, A) float (NaN unknown). ``max_crops`` bounds the crops axis.
    """

    def __init__(self, values: Tensor, weight: Tensor, cluster: Tensor, group: Tensor, crops: Tensor,
                 num_clusters: int, num_groups: int, max_crops: int, prior: float) -> None:
        n, a = values.shape
        v = torch.where(weight, values.double(), 0.0)
        w = weight.double()
        known = weight & ~crops.isnan()
        k, g, c = num_clusters, num_groups, max_crops + 1
        cell = (cluster[:, None] * g + group[None, :]) * c + crops.nan_to_num(0).long().clamp(0, max_crops)
        cell = torch.where(known, cell, 0)
        kw = known.double()
        sums = torch.zeros(k * g * c, dtype=torch.float64).index_add_(0, cell.flatten(), (v * kw).flatten())
        counts = torch.zeros(k * g * c, dtype=torch.float64).index_add_(0, cell.flatten(), kw.flatten())
        sums, counts = sums.view(k, g, c), counts.view(k, g, c)
        group_sum = torch.zeros(g, dtype=torch.float64).index_add_(0, group, (v * kw).sum(0))
        group_count = torch.zeros(g, dtype=torch.float64).index_add_(0, group, kw.sum(0))
        group_mean = group_sum / group_count.clamp(min=1)
        # (group, crops): toward the group's mean; a crops count never seen takes the nearest seen one
        pooled_sum, pooled_count = sums.sum(0), counts.sum(0)
        pooled = (pooled_sum + prior * group_mean[:, None]) / (pooled_count + prior).clamp(min=1e-12)
        for j in range(g):
            seen = (pooled_count[j] > 0).nonzero().flatten()
            if len(seen):
                nearest = (torch.arange(c)[:, None] - seen[None, :]).abs().argmin(1)
                pooled[j] = torch.where(pooled_count[j] > 0, pooled[j], pooled[j, seen[nearest]])
        # the cluster's offset from the pooled cells, shrunk toward none
        residual = (sums - counts * pooled[None]).sum(2)  # (K, G)
        offset = residual / (counts.sum(2) + prior).clamp(min=1e-12)
        parent = pooled[None] + offset[:, :, None]
        self.cells = ((sums + prior * parent) / (counts + prior).clamp(min=1e-12)).float()  # (K, G, C)
        # unknown crops: per (cluster, action), toward the action's mean
        action_mean = v.sum(0) / w.sum(0).clamp(min=1)
        ka_sum = torch.zeros(k, a, dtype=torch.float64).index_add_(0, cluster, v)
        ka_count = torch.zeros(k, a, dtype=torch.float64).index_add_(0, cluster, w)
        self.by_action = ((ka_sum + prior * action_mean[None]) / (ka_count + prior).clamp(min=1e-12)).float()


def lookup_cells(cells: Tensor, by_action: Tensor, cluster: Tensor, group: Tensor, crops: Tensor) -> Tensor:
    """(N, A): ``cells[cluster, group, crops]`` where the crops are known (beyond the axis: its last
    entry), ``by_action[cluster, action]`` where they are not."""
    last = cells.shape[2] - 1
    index = crops.nan_to_num(0.0).long().clamp(0, last)
    known = cells[cluster[:, None], group[None, :], index]
    return torch.where(crops.isnan(), by_action[cluster], known)


#: longest answer the length probe keeps apart (longer ones count in its last bin)
MAX_ANSWER_TOKENS = 512


def _fit_length_probe(lang: Tensor, tokens: Tensor, counted: Tensor, bins: int, seed: int,
                      l2: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """A multinomial logistic regression from the standardised language features to each sample's answer
    length (its histogram over the configurations it ran, ``bins`` bins, the last holding every longer
    answer): (mean (L,), std (L,), weight (L, T), bias (T,), the L2 weight chosen). The L2 weight is
    chosen among a few by the cross-entropy of a fifth of the samples held out, unless given."""
    value = tokens.nan_to_num(0.0).round().long().clamp(0, bins - 1)
    target = torch.zeros(len(lang), bins, dtype=torch.float64).scatter_add_(1, value, counted.double())
    keep = target.sum(1) > 0
    if int(keep.sum()) < 2:  # nothing to learn the length from: every request reads as the lengths' mode
        bias = torch.full((bins,), -30.0)
        bias[int(target.sum(0).argmax())] = 0.0
        return (torch.zeros(lang.shape[1]), torch.ones(lang.shape[1]), torch.zeros(lang.shape[1], bins), bias,
                l2 if l2 is not None else 0.0)
    x_all, target = lang[keep].double(), target[keep] / target[keep].sum(1, keepdim=True)
    mean, std = x_all.mean(0), x_all.std(0).nan_to_num(1.0) + 1e-6
    x_all = (x_all - mean) / std
    prior = target.mean(0).clamp(min=1e-6)

    def fit(x: Tensor, y: Tensor, weight: float) -> tuple[Tensor, Tensor]:
        w = torch.zeros(x.shape[1], bins, dtype=torch.float64, requires_grad=True)
        b = prior.log().clone().requires_grad_(True)
        optimizer = torch.optim.LBFGS([w, b], max_iter=100, line_search_fn="strong_wolfe")

        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = -(y * torch.log_softmax(x @ w + b, dim=1)).sum(1).mean() + weight * w.square().sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        return w.detach(), b.detach()

    held = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(seed)) % 5 == 0
    if l2 is None and (not bool(held.any()) or bool(held.all())):
        l2 = 1e-2  # too few samples to hold any out
    if l2 is None:
        losses = {}
        for weight in (1e-4, 1e-3, 1e-2, 1e-1):
            w, b = fit(x_all[~held], target[~held], weight)
            losses[weight] = float(-(target[held] * torch.log_softmax(x_all[held] @ w + b, dim=1)).sum(1).mean())
        l2 = min(losses, key=losses.__getitem__)
    w, b = fit(x_all, target, l2)
    return mean.float(), std.float(), w.float(), b.float(), l2


def _probe_quantiles(lang: Tensor, mean: Tensor, std: Tensor, weight: Tensor, bias: Tensor,
                     levels: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """(B,) each: the answer length at the two ``levels`` of each request's predicted distribution."""
    cdf = torch.softmax(((lang.float() - mean) / std) @ weight + bias, dim=1).cumsum(1)
    return (cdf < levels[0] - 1e-6).sum(1).float(), (cdf < levels[1] - 1e-6).sum(1).float()


def _median_regression(x: Tensor, y: Tensor, iterations: int = 30) -> Tensor:
    """Coefficients (D,) minimising sum |y - x @ b| (IRLS), float64; a tiny ridge keeps a constant
    column (e.g. one crops count only) solvable."""
    scale = x.abs().amax(0).clamp(min=1e-9)
    xs = x / scale
    ridge = 1e-8 * torch.eye(x.shape[1], dtype=torch.float64) * max(1, len(y))
    beta = torch.linalg.solve(xs.t() @ xs + ridge, xs.t() @ y)
    for _ in range(iterations):
        w = 1.0 / (y - xs @ beta).abs().clamp(min=1e-3 * float(y.abs().median()) + 1e-9)
        xw = xs * w[:, None]
        beta = torch.linalg.solve(xw.t() @ xs + ridge, xw.t() @ y)
    return beta / scale


class RequestCostModel(nn.Module):
    """Per request and configuration: the predicted median latency and its calibrated quantile, in ms.

    ``forward(lang (B, L), tiling_crops (B, C) NaN unknown, prompt_tokens (B,) NaN unknown)`` ->
    ``(median_ms (B, A), quantile_ms (B, A), request_basis (B, A) bool, extrapolated (B, A) bool)``;
    ``request_basis`` False: the configuration's spread over the profile answered (tiling unknown);
    ``extrapolated``: the request's crops or prompt lie beyond what the fit saw. TorchScript-compatible.
    Built by :func:`fit_request_cost`.
    """

    __jit_unused_properties__ = ["unmodelled"]

    def __init__(self, action_space: ActionSpace, config: RequestCostConfig, lang_dim: int, num_clusters: int,
                 max_crops: int, length_bins: int = 1) -> None:
        super().__init__()
        self.action_space, self.config = action_space, config
        self.config_quantile = float(config.quantile)
        knobs = action_space.knob_indices()
        groups = sorted({(int(k), int(b)) for _, k, b in knobs.tolist()})
        group = torch.tensor([groups.index((int(k), int(b))) for _, k, b in knobs.tolist()], dtype=torch.long)
        a, g = len(action_space), len(groups)
        self.register_buffer("crops_column", knobs[:, 0].clone())
        self.register_buffer("group", group)
        self.register_buffer("coef", torch.zeros(g, len(TERMS)))
        self.register_buffer("centres", torch.zeros(num_clusters, lang_dim))
        self.max_crops = int(max_crops)
        # the answer length: the language features' multinomial probe of it, per request, plus each
        # configuration's mean shift of it
        self.register_buffer("length_mean", torch.zeros(lang_dim))
        self.register_buffer("length_std", torch.ones(lang_dim))
        self.register_buffer("length_weight", torch.zeros(lang_dim, length_bins))
        self.register_buffer("length_bias", torch.zeros(length_bins))
        self.register_buffer("length_shift", torch.zeros(a))
        self.register_buffer("profile_median_ms", torch.zeros(a))
        self.register_buffer("profile_quantile_ms", torch.zeros(a))
        self.register_buffer("default_prompt_tokens", torch.zeros(()))
        self.register_buffer("fit_max_crops", torch.zeros(()))
        self.register_buffer("fit_max_prompt_tokens", torch.zeros(()))
        self.register_buffer("conformal_score", torch.zeros(()))
        # the probe's two levels as :func:`_probe_quantiles` compares them (derived from the config, not stored)
        self.register_buffer("length_levels", torch.tensor([0.5 - 1e-6, self.config_quantile - 1e-6]),
                             persistent=False)
        self.unmodelled_text = ""  # one name per line: TorchScript keeps a string, not an empty list

    @property
    def unmodelled(self) -> list[str]:
        """What the profile could not model: ``"tilings"``, ``"prompt lengths"``, ``"answer lengths"``."""
        return [line for line in self.unmodelled_text.split("\n") if line]

    @unmodelled.setter
    def unmodelled(self, names: list[str]) -> None:
        self.unmodelled_text = "\n".join(names)

    def _crops(self, tiling_crops: Tensor) -> Tensor:
        return tiling_crops.float().index_select(1, self.crops_column)

    def parts(self, lang: Tensor, tiling_crops: Tensor, prompt_tokens: Tensor) -> dict[str, Tensor]:
        """The median's terms per request and configuration (B, A): ``fixed``, ``image`` (vision and the
        image tokens' prefill), ``prompt`` (the prompt tokens' prefill) and ``decode``; plus ``answer_tokens``
        (the median generated length), ``answer_tokens_high`` (its ``quantile``) and ``decode_high`` (the
        decode term at that length), and ``crops`` (the crops the image gets). NaN where the tiling is unknown."""
        crops = self._crops(tiling_crops)
        prompt = torch.where(prompt_tokens.isnan(), self.default_prompt_tokens, prompt_tokens.float())
        coef = self.coef.index_select(0, self.group)  # (A, 4)
        median_tokens, high_tokens = _probe_quantiles(lang, self.length_mean, self.length_std, self.length_weight,
                                                      self.length_bias, (0.5, self.config_quantile))
        tokens = (median_tokens[:, None] + self.length_shift[None, :]).clamp(min=0.0)
        high = (high_tokens[:, None] + self.length_shift[None, :]).clamp(min=0.0)
        return {"fixed": coef[:, 0].expand_as(crops), "image": coef[:, 1][None, :] * (crops + 1.0),
                "prompt": coef[:, 2][None, :] * prompt[:, None], "decode": coef[:, 3][None, :] * tokens,
                "answer_tokens": tokens, "answer_tokens_high": high, "decode_high": coef[:, 3][None, :] * high,
                "crops": crops}

    def forward(self, lang: Tensor, tiling_crops: Tensor, prompt_tokens: Tensor) -> tuple[Tensor, Tensor, Tensor,
                                                                                          Tensor]:
        # the terms of :meth:`parts`, in as few ops as TorchScript runs them: a batch-1 call is the ops' dispatch
        crops = tiling_crops.float().index_select(1, self.crops_column)  # (B, A)
        prompt_in = prompt_tokens.float()
        prompt = torch.where(prompt_in.isnan(), self.default_prompt_tokens, prompt_in).unsqueeze(1)  # (B, 1)
        # the probe's logits as _probe_quantiles computes them (addmm rounds differently and can move a length)
        logits = torch.mm((lang.float() - self.length_mean) / self.length_std, self.length_weight) + self.length_bias
        below = logits.softmax(1).cumsum(1).unsqueeze(2) < self.length_levels  # (B, T, 2)
        lengths = below.sum(1, dtype=torch.float32)  # (B, 2): the median and the quantile of the answer length
        fixed, image, per_prompt, per_token = self.coef.index_select(0, self.group).t().unbind(0)  # (A,) each
        before_decode = torch.addcmul(torch.addcmul(fixed, image, crops + 1.0), per_prompt, prompt)
        tokens, high = (lengths.unsqueeze(2) + self.length_shift).clamp_(min=0.0).unbind(1)  # (B, A) each
        median = torch.addcmul(before_decode, per_token, tokens)
        quantile = torch.addcmul(torch.addcmul(before_decode, per_token, high), self.conformal_score, median)
        request = ~median.isnan()
        median = torch.where(request, median, self.profile_median_ms)
        quantile = torch.where(request, quantile, self.profile_quantile_ms)
        extrapolated = (request & (crops > self.fit_max_crops)) | (prompt_in > self.fit_max_prompt_tokens).unsqueeze(1)
        return median, quantile, request, extrapolated

    @torch.no_grad()
    def predict(self, data: OfflineData) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`forward` on the requests of ``data`` (its tilings and prompt lengths where it has them)."""
        if data.action_space != self.action_space:
            msg = "the data's action space differs from the request cost model's (fitted on other data)"
            raise ValueError(msg)
        n = len(data)
        tiling = (torch.full((n, len(self.action_space.max_crops_values)), float("nan")) if data.tiling_crops is None
                  else data.tiling_crops)
        prompt = torch.full((n,), float("nan")) if data.prompt_tokens is None else data.prompt_tokens
        return self(data.lang_features, tiling, prompt)

    def latency_before_vision(self, lang: Tensor, tiling_crops: Tensor | None,
                              prompt_tokens: Tensor | None = None) -> Tensor:
        """(N, A) each request's latency quantile at every configuration from what is known before the vision
        pass (the question, the image's tiling and the prompt's length; an unknown one read as the profile's
        median): what an online run's latency guard predicts with (``controller.latency_guard``)."""
        n = lang.shape[0]
        if tiling_crops is None:
            tiling_crops = torch.full((n, len(self.action_space.max_crops_values)), float("nan"))
        prompt = torch.full((n,), float("nan")) if prompt_tokens is None else prompt_tokens.float().reshape(n)
        with torch.no_grad():
            _, quantile, _, _ = self.forward(lang.float(), tiling_crops.float(), prompt)
        return quantile

    def clusters_of(self, lang: Tensor) -> Tensor:
        """(N,) int64: the question cluster each row of language features reads as."""
        return question_clusters(lang, self.centres)

    def layout(self) -> dict:
        """Everything but the tensors (plain values): what :meth:`from_layout` builds an empty model of, for a
        holder whose state_dict carries the tensors (a policy that reads the model)."""
        return {"action_space": self.action_space.to_json(), "config": asdict(self.config),
                "lang_dim": int(self.centres.shape[1]), "num_clusters": int(self.centres.shape[0]),
                "max_crops": self.max_crops, "unmodelled": list(self.unmodelled),
                "length_bins": int(self.length_bias.shape[0])}

    def to_state(self) -> dict:
        """What :meth:`from_state` rebuilds the model from: its layout and its tensors."""
        return {**self.layout(), "state_dict": {k: v.clone() for k, v in self.state_dict().items()}}

    @classmethod
    def from_layout(cls, layout: dict) -> RequestCostModel:
        """A model of ``layout``'s shape with zero coefficients (load a state_dict into it)."""
        model = cls(ActionSpace.from_json(layout["action_space"]), RequestCostConfig(**layout["config"]),
                    int(layout["lang_dim"]), int(layout["num_clusters"]), int(layout["max_crops"]),
                    int(layout.get("length_bins", 1)))
        model.unmodelled = list(layout.get("unmodelled", []))
        return model.eval()

    @classmethod
    def from_state(cls, state: dict) -> RequestCostModel:
        model = cls.from_layout(state)
        model.load_state_dict(state["state_dict"])
        return model


def _eligible(data: OfflineData) -> Tensor:
    """(N, A) bool: measurements the latency fit may read (a per-sample latency of an allowed action)."""
    return data.mask & data.latency_is_sample & ~data.latency_ms.isnan()


def _fit_coefficients(design: Tensor, latency: Tensor, rows: Tensor, group: Tensor, num_groups: int,
                      terms: Tensor) -> Tensor:
    """(G, 4) float64 median-regression coefficients per group on the ``rows`` (N, A) bool; the terms
    ``terms`` (4,) bool leaves out stay 0."""
    coef = torch.zeros(num_groups, len(TERMS), dtype=torch.float64)
    for j in range(num_groups):
        cells = rows & (group == j)[None, :]
        if int(cells.sum()) < int(terms.sum()):
            continue
        x = design[cells][:, terms]
        coef[j, terms] = _median_regression(x, latency[cells].double())
    return coef


def fit_request_cost(train: OfflineData, config: RequestCostConfig | None = None) -> RequestCostModel:
    """Fit :class:`RequestCostModel` on ``train``'s per-sample latencies (pass the train split)."""
    return fit_request_cost_out_of_fold(train, config)[0]


def fit_request_cost_out_of_fold(train: OfflineData, config: RequestCostConfig | None = None
                                 ) -> tuple[RequestCostModel, Tensor]:
    """:func:`fit_request_cost`, and (N, A) each training request's predicted median latency from the fit of
    the folds without it (the folds that calibrate the quantile): what a model that learns from the cost
    model's predictions may read for these rows. A request whose tiling is unknown reads its configuration's
    median over the profile, as :meth:`RequestCostModel.forward` answers it."""
    config = config or RequestCostConfig()
    if len(train) == 0:
        msg = "the request cost model needs training samples"
        raise ValueError(msg)
    space = train.action_space
    n, a = len(train), len(space)
    crops = crops_used(space, train.tiling_crops, n)
    known_crops = ~crops.isnan()
    max_crops = int(crops[known_crops].max()) if bool(known_crops.any()) else max(space.max_crops_values)
    max_crops = max(max_crops, max(space.max_crops_values))
    prompt = torch.full((n,), float("nan")) if train.prompt_tokens is None else train.prompt_tokens.float()
    centres = _cluster_centres(train.lang_features, min(config.clusters, max(1, n // 10)), config.seed)
    output = torch.full((n, a), float("nan")) if train.output_tokens is None else train.output_tokens.float()
    longest = int(output[~output.isnan()].max()) if bool((~output.isnan()).any()) else 0
    bins = min(max(longest, 0), MAX_ANSWER_TOKENS) + 1
    model = RequestCostModel(space, config, train.lang_features.shape[1], len(centres), max_crops, bins)
    model.centres.copy_(centres)  # the score table's question clusters
    group = model.group

    eligible = _eligible(train)
    latency = torch.where(eligible, train.latency_ms, float("nan"))
    model.profile_median_ms.copy_(torch.nanquantile(latency, 0.5, dim=0).nan_to_num(0.0))
    model.profile_quantile_ms.copy_(torch.nanquantile(latency, config.quantile, dim=0).nan_to_num(0.0))

    output = torch.full((n, a), float("nan")) if train.output_tokens is None else train.output_tokens.float()
    unmodelled = []
    if not bool(known_crops.any()):
        unmodelled.append("tilings")
    if bool(prompt.isnan().all()):
        unmodelled.append("prompt lengths")
    if bool((output.isnan() | ~eligible).all()):
        unmodelled.append("answer lengths")
    model.unmodelled = unmodelled
    model.default_prompt_tokens.fill_(float(prompt.nanmedian()) if not bool(prompt.isnan().all()) else 0.0)
    model.fit_max_crops.fill_(float(crops[known_crops].max()) if bool(known_crops.any()) else 0.0)
    model.fit_max_prompt_tokens.fill_(float(prompt.nan_to_num(0.0).max()) if not bool(prompt.isnan().all())
                                      else float("inf"))
    prompt = prompt.nan_to_num(float(model.default_prompt_tokens))
    terms = torch.tensor([True, "tilings" not in unmodelled, "prompt lengths" not in unmodelled,
                          "answer lengths" not in unmodelled])
    fit_rows = eligible & known_crops & (~output.isnan() | ~terms[3])
    num_groups = int(group.max()) + 1

    probe_l2: list[float] = []

    def answer_lengths(rows: Tensor) -> tuple[Tensor, Tensor]:
        """(N, A) each: every sample's median answer length and its ``quantile``, the probe and shifts
        fitted on ``rows``' samples (into the model when ``rows`` is every sample)."""
        counted = eligible & rows[:, None] & ~output.isnan()
        mean, std, weight, bias, l2 = _fit_length_probe(train.lang_features[rows], output[rows], counted[rows], bins,
                                                        config.seed, probe_l2[0] if probe_l2 else None)
        probe_l2.append(l2)
        w = counted.double()
        overall = float((output.nan_to_num(0.0) * w).sum() / w.sum().clamp(min=1))
        shift = ((output.nan_to_num(0.0) * w).sum(0) / w.sum(0).clamp(min=1) - overall).float()
        shift = torch.where(w.sum(0) > 0, shift, torch.zeros_like(shift))
        median_tokens, high_tokens = _probe_quantiles(train.lang_features, mean, std, weight, bias,
                                                      (0.5, config.quantile))
        if rows.all():
            model.length_mean.copy_(mean)
            model.length_std.copy_(std)
            model.length_weight.copy_(weight)
            model.length_bias.copy_(bias)
            model.length_shift.copy_(shift)
        return ((median_tokens[:, None] + shift[None, :]).clamp(min=0.0),
                (high_tokens[:, None] + shift[None, :]).clamp(min=0.0))

    def design(tokens: Tensor) -> Tensor:
        return torch.stack([torch.ones(n, a, dtype=torch.float64), (crops + 1).double().nan_to_num(0.0),
                            prompt.double()[:, None].expand(n, a), tokens.double().nan_to_num(0.0)], dim=2)

    measured = design(output)
    everyone = torch.ones(n, dtype=torch.bool)
    coef = _fit_coefficients(measured, train.latency_ms, fit_rows, group, num_groups, terms)
    model.coef.copy_(coef.float())
    answer_lengths(everyone)  # the probe's weights into the model

    # out of fold: each held-out sample's median and first bound from a fit without its fold
    fold = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed)) % config.folds
    scores = []
    out_of_fold = torch.full((n, a), float("nan"))
    for f in range(config.folds):
        held = fold == f
        if not bool(held.any()) or bool(held.all()):
            continue
        kept = ~held
        fold_coef = _fit_coefficients(measured, train.latency_ms, fit_rows & kept[:, None], group, num_groups, terms)
        fold_tokens, fold_high = answer_lengths(kept)
        median = (design(fold_tokens) * fold_coef[group][None]).sum(2)
        bound = (design(fold_high) * fold_coef[group][None]).sum(2)
        out_of_fold[held] = median[held].float()
        rows = held[:, None] & eligible & known_crops
        scores.append(((train.latency_ms.double() - bound) / median.clamp(min=1e-9))[rows])
    score = torch.cat(scores) if scores else torch.zeros(0, dtype=torch.float64)
    if score.numel():
        # the split-conformal rank: the ceil((n + 1) q)-th smallest score
        rank = min(score.numel(), math.ceil((score.numel() + 1) * config.quantile))
        model.conformal_score.fill_(float(score.sort().values[rank - 1]))
    model.eval()
    if bool(out_of_fold.isnan().any()):  # no fold answered (too few samples): the whole fit's prediction
        out_of_fold = torch.where(out_of_fold.isnan(), model.predict(train)[0], out_of_fold)
    out_of_fold = torch.where(known_crops, out_of_fold, model.profile_median_ms[None, :].expand(n, a))
    return model, out_of_fold


@dataclass(frozen=True)
class CostQuality:
    """How well a cost model predicted held-out measurements: ``median_abs_error`` (relative to the measured
    latency), ``coverage`` (the share at or below the predicted quantile), over ``num_measurements``."""

    median_abs_error: float
    coverage: float
    num_measurements: int
    quantile: float


def cost_quality(model: RequestCostModel, data: OfflineData) -> CostQuality:
    """The model's error and coverage on ``data``'s per-sample latencies whose tiling is known."""
    median, quantile, request, _ = model.predict(data)
    rows = _eligible(data) & request
    measured = data.latency_ms[rows].double()
    if measured.numel() == 0:
        return CostQuality(float("nan"), float("nan"), 0, model.config.quantile)
    error = ((median[rows].double() - measured).abs() / measured).median()
    covered = (measured <= quantile[rows].double()).double().mean()
    return CostQuality(float(error), float(covered), int(measured.numel()), model.config.quantile)


class RequestScoreTable:
    """The expected score of each configuration for a request: the mean training score per (question
    cluster of ``model``, top-K, blocks, crops used), shrunk toward the pooled (top-K, blocks, crops used)
    mean plus the cluster's offset (``prior_samples`` of the model's config); per (cluster, configuration)
    where the crops are unknown. Two configurations that give a request the same crops get the same score."""

    def __init__(self, train: OfflineData, model: RequestCostModel, score_kind: str = "mean") -> None:
        space = model.action_space
        if train.action_space != space:
            msg = "the data's action space differs from the request cost model's"
            raise ValueError(msg)
        self.model = model
        n = len(train)
        crops = crops_used(space, train.tiling_crops, n)
        cluster = model.clusters_of(train.lang_features)
        score = train.scores(score_kind)
        weight = train.mask & ~score.isnan()
        cells = _CellMeans(score.nan_to_num(0.0), weight, cluster, model.group, crops, model.centres.shape[0],
                           int(model.group.max()) + 1, model.max_crops, model.config.prior_samples)
        self.cells, self.by_action = cells.cells, cells.by_action

    @classmethod
    def from_cells(cls, model: RequestCostModel, cells: Tensor, by_action: Tensor) -> RequestScoreTable:
        """A table of stored cells (``cells`` (K, G, C), ``by_action`` (K, A)) for ``model``'s clusters."""
        table = cls.__new__(cls)
        table.model, table.cells, table.by_action = model, cells, by_action
        return table

    def expected_score(self, lang: Tensor, tiling_crops: Tensor | None) -> Tensor:
        """(N, A) float32 expected scores of the requests with language features ``lang`` and tilings."""
        crops = crops_used(self.model.action_space, tiling_crops, len(lang))
        return lookup_cells(self.cells, self.by_action, self.model.clusters_of(lang), self.model.group, crops)
