"""A supervised outcome model: per configuration, the chance of a correct answer and a latency
quantile, predicted from a sample's cached features.

Every recorded sample is a full-information group (every configuration scored and timed), so
what a configuration will score and how long it will take on a new sample can be learnt by plain
supervised regression, pooling what samples with similar features share: questions of one
family share their sensitivities and their answer lengths. Its decision rule is the
``lut_p95`` rule made per sample: among the allowed configurations whose predicted latency
quantile fits the budget, the highest predicted score (ties -> lower predicted latency); when
none fits, the lowest predicted latency. Two uses:

* the warm start of GRPO (``OfflineTrainConfig.warm_start_target="outcome"``): the policy
  starts from these per-sample choices instead of the budget-only table, and the KL term keeps
  it near them where the sampled rewards do not pay for a change;
* an evaluation decider of its own, ``"outcome"``.

Both heads are small MLPs over the standardised [language features, image features, image
present, log(1 + crops) of the image's tiling per max_crops choice]; the tiling (``image_tilings``)
depends on the image size only and predicts the vision and prefill cost of each crops choice
directly (unknown tilings read as the training mean). Score: binary cross-entropy to the (mean)
recorded score; latency: the pinball loss of ``quantile`` on the recorded latency divided by its
train median. Each head stops on its own
validation loss (``patience`` epochs without improvement) and keeps its best epoch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.baselines import DeterministicDecider, best_candidate, budget_vector, require_allowed_actions
from trainer.data import ActionSpace, OfflineData
from trainer.runs import atomic_torch_save

__all__ = ["OUTCOME_FILE", "OutcomeConfig", "OutcomeDecider", "OutcomeModel", "fit_outcome_model"]

#: the fitted outcome model, in the run directory
OUTCOME_FILE = "outcome.pt"
#: with ``latency_neighbours``, the folds the training latencies are predicted out of
NEIGHBOUR_FOLDS = 5


@dataclass
class OutcomeConfig:
    """How the outcome model is fitted.

    quantile: the latency quantile predicted and compared with the budget (float in (0, 1), default 0.95).
    hidden_dim: width of each head's hidden layer (int, default 64).
    lr, weight_decay: AdamW (default 3e-3, 1e-3).
    batch_size: samples per step (int, default 64).
    max_epochs, patience: each head stops after ``patience`` epochs without a lower validation
        loss (default 300, 20) and keeps its best epoch.
    seed: initialisation and batch order (int, default 0).
    use_tilings: read the image tilings (bool, default True; the data's ``tiling_crops``).
    latency_neighbours: 0 (default): the latency head predicts the quantile. k > 0: a median
        head predicts each configuration's median, and the quantile is that median times the
        ``quantile`` of recorded / predicted latency among the k training samples nearest in
        the inputs (predicted out of fold, :data:`NEIGHBOUR_FOLDS` folds), so that a question
        type whose latency is tight is held to its own spread, not to the pooled one.
    """

    quantile: float = 0.95
    hidden_dim: int = 64
    lr: float = 3e-3
    weight_decay: float = 1e-3
    batch_size: int = 64
    max_epochs: int = 300
    patience: int = 20
    seed: int = 0
    use_tilings: bool = True
    latency_neighbours: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile < 1.0:
            msg = f"`quantile` must be in (0, 1), got {self.quantile!r}"
            raise ValueError(msg)
        if not isinstance(self.use_tilings, bool):
            msg = f"`use_tilings` must be a bool, got {self.use_tilings!r}"
            raise TypeError(msg)
        for name in ("hidden_dim", "batch_size", "max_epochs", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be an integer >= 1, got {value!r}"
                raise ValueError(msg)
        k = self.latency_neighbours
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            msg = f"`latency_neighbours` must be an integer >= 0, got {k!r}"
            raise ValueError(msg)


def _inputs(data: OfflineData, use_tilings: bool) -> torch.Tensor:
    """(N, D) float32 inputs; tiling columns are NaN where the tiling is unknown."""
    parts = [data.lang_features, data.image_features, data.image_present[:, None].float()]
    if use_tilings:
        crops = data.tiling_crops
        if crops is None:
            crops = torch.full((len(data), len(data.action_space.max_crops_values)), float("nan"))
        parts.append(torch.log1p(crops.float()))
    return torch.cat(parts, dim=1)


class OutcomeModel(nn.Module):
    """Per sample and configuration: P(correct) and the latency ``quantile`` in ms."""

    def __init__(self, input_dim: int, action_space: ActionSpace, config: OutcomeConfig) -> None:
        super().__init__()
        self.action_space, self.config = action_space, config
        a, h = len(action_space), config.hidden_dim
        self.register_buffer("input_mean", torch.zeros(input_dim))
        self.register_buffer("input_std", torch.ones(input_dim))
        self.register_buffer("latency_scale_ms", torch.ones(()))
        self.score_head = nn.Sequential(nn.Linear(input_dim, h), nn.GELU(), nn.Linear(h, a))
        self.latency_head = nn.Sequential(nn.Linear(input_dim, h), nn.GELU(), nn.Linear(h, a))
        if config.latency_neighbours:
            # filled by the fit: the training inputs (standardised) and latency / predicted median
            self.register_buffer("neighbour_inputs", torch.zeros(0, input_dim))
            self.register_buffer("neighbour_ratios", torch.zeros(0, a))

    def _standardized(self, data: OfflineData) -> torch.Tensor:
        # an unknown tiling (NaN) reads as the training mean
        return ((_inputs(data, self.config.use_tilings) - self.input_mean) / self.input_std).nan_to_num(0.0)

    @torch.no_grad()
    def predict(self, data: OfflineData) -> tuple[torch.Tensor, torch.Tensor]:
        """(P(correct), latency quantile ms), both float32 (N, A)."""
        if data.action_space != self.action_space:
            msg = "the data's action space differs from the outcome model's (fitted on other data)"
            raise ValueError(msg)
        x = self._standardized(data)
        return torch.sigmoid(self.score_head(x)), self._latency(x)

    @torch.no_grad()
    def latency_before_vision(self, lang: torch.Tensor, tiling_crops: torch.Tensor | None) -> torch.Tensor:
        """(N, A) latency quantile (ms) from what is known before the vision pass: the language
        features ``lang`` (N, Dl) and the image tilings ``tiling_crops`` (N, C) (NaN or None:
        unknown), the image feature and its presence read as their training means. A request's
        crops are chosen before its image is encoded; the tiling carries what the image adds to
        the cost (vision and prefill scale with the crops), the question what decoding adds."""
        dl = lang.shape[1]
        x = torch.zeros(len(lang), self.input_mean.numel())
        x[:, :dl] = (lang.float().cpu() - self.input_mean[:dl]) / self.input_std[:dl]
        if self.config.use_tilings:
            c = len(self.action_space.max_crops_values)
            crops = (torch.full((len(lang), c), float("nan")) if tiling_crops is None
                     else torch.log1p(tiling_crops.float().cpu()))
            x[:, -c:] = (crops - self.input_mean[-c:]) / self.input_std[-c:]
        return self._latency(x.nan_to_num(0.0))  # unknown tilings read as the training mean

    def _latency(self, x: torch.Tensor) -> torch.Tensor:
        """(N, A) latency quantile (ms) of standardised inputs ``x``."""
        latency = self.latency_head(x) * self.latency_scale_ms
        if self.config.latency_neighbours:
            latency = latency * self._neighbour_ratio_quantile(x)
        return latency

    def _neighbour_ratio_quantile(self, x: torch.Tensor) -> torch.Tensor:
        """(N, A): per configuration, the ``quantile`` of latency / predicted median among the
        ``latency_neighbours`` nearest training samples (all of them where none recorded it)."""
        pooled = torch.nanquantile(self.neighbour_ratios, self.config.quantile, dim=0)  # (A,)
        k = min(self.config.latency_neighbours, len(self.neighbour_inputs))
        out = []
        for start in range(0, len(x), 1024):  # bounds the (rows, training samples) distance block
            nearest = torch.cdist(x[start:start + 1024], self.neighbour_inputs).topk(k, largest=False).indices
            local = torch.nanquantile(self.neighbour_ratios[nearest], self.config.quantile, dim=1)
            out.append(torch.where(local.isnan(), pooled, local))
        return torch.cat(out) if out else torch.ones(0, self.neighbour_ratios.shape[1])

    def save(self, path: Path) -> Path:
        return atomic_torch_save(self.to_state(), path)

    def to_state(self) -> dict:
        """What :meth:`from_state` rebuilds the model from (the file :meth:`save` writes)."""
        return {"input_dim": int(self.input_mean.numel()), "action_space": self.action_space.to_json(),
                "config": asdict(self.config), "state_dict": self.state_dict()}

    @classmethod
    def load(cls, path: Path) -> OutcomeModel:
        return cls.from_state(torch.load(path, weights_only=True))

    @classmethod
    def from_state(cls, state: dict) -> OutcomeModel:
        config = OutcomeConfig(**{"use_tilings": False, **state["config"]})  # files written before tilings were read
        model = cls(state["input_dim"], ActionSpace.from_json(state["action_space"]), config)
        if config.latency_neighbours:  # the neighbour buffers' sizes are the fit's
            model.neighbour_inputs = state["state_dict"]["neighbour_inputs"]
            model.neighbour_ratios = state["state_dict"]["neighbour_ratios"]
        model.load_state_dict(state["state_dict"])
        return model.eval()


def fit_outcome_model(train: OfflineData, val: OfflineData, config: OutcomeConfig | None = None) -> OutcomeModel:
    """Fit both heads on ``train`` (its ``score`` and ``latency_ms`` where ``mask``), each stopped
    on its loss on ``val``. Deterministic for a given ``config.seed``."""
    config = config or OutcomeConfig()
    if len(train) == 0 or len(val) == 0:
        msg = "the outcome model needs train and val samples"
        raise ValueError(msg)
    generator = torch.Generator().manual_seed(config.seed)
    x_train = _inputs(train, config.use_tilings)
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = OutcomeModel(x_train.shape[1], train.action_space, config)
    known = ~x_train.isnan()
    count = known.sum(0).clamp(min=1)
    mean = torch.where(known, x_train, 0.0).sum(0) / count
    std = (torch.where(known, x_train - mean, 0.0).square().sum(0) / (count - 1).clamp(min=1)).sqrt()
    model.input_mean.copy_(mean)
    model.input_std.copy_(std + 1e-4)
    latency = train.latency_ms[train.mask]
    model.latency_scale_ms.fill_(float(latency.median()) if latency.numel() else 1.0)
    scale = float(model.latency_scale_ms)
    # with neighbours the head learns the median; the quantile comes from the neighbours' ratios
    q = 0.5 if config.latency_neighbours else config.quantile

    def score_loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.binary_cross_entropy_with_logits(pred, target, reduction="none")
        return (loss * weight).sum() / weight.sum().clamp(min=1.0)

    def latency_loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        error = target - pred
        return (torch.maximum(q * error, (q - 1.0) * error) * weight).sum() / weight.sum().clamp(min=1.0)

    def targets(rows: OfflineData) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per head: (target, weight) (N, A); only the recorded configurations count."""
        weight = rows.mask.float()
        return {"score": (torch.nan_to_num(rows.score, nan=0.0).clamp(0.0, 1.0), weight),
                "latency": (torch.nan_to_num(rows.latency_ms, nan=0.0) / scale, weight)}

    # both heads start at the training means: the per-configuration table before any feature is read
    with torch.no_grad():
        mean_score = (torch.nan_to_num(train.score, nan=0.0) * train.mask).sum(0) / train.mask.sum(0).clamp(min=1)
        model.score_head[2].bias.copy_(torch.logit(mean_score.clamp(0.02, 0.98)))
        model.score_head[2].weight.mul_(0.1)
        quantiles = torch.nanquantile(torch.where(train.mask, train.latency_ms, torch.nan), q, dim=0)
        model.latency_head[2].bias.copy_(torch.nan_to_num(quantiles, nan=0.0) / scale)
        model.latency_head[2].weight.mul_(0.1)
    x_val = model._standardized(val)
    x_fit = model._standardized(train)
    fit_targets, val_targets = targets(train), targets(val)
    initial_latency_head = copy.deepcopy(model.latency_head)
    for head, loss_fn, key in ((model.score_head, score_loss, "score"), (model.latency_head, latency_loss, "latency")):
        _fit_head(head, loss_fn, (x_fit, *fit_targets[key]), (x_val, *val_targets[key]), config, generator)
    if config.latency_neighbours:
        # out of fold: a head's error on the samples it fitted understates its error on new ones,
        # and the ratios must hold both that error and the latency's own spread
        median = torch.empty_like(train.latency_ms)
        fold_of = torch.randperm(len(train), generator=torch.Generator().manual_seed(config.seed)) % NEIGHBOUR_FOLDS
        for fold in range(NEIGHBOUR_FOLDS):
            held, kept = fold_of == fold, fold_of != fold
            if not held.any() or not kept.any():
                continue
            head = copy.deepcopy(initial_latency_head)
            _fit_head(head, latency_loss, (x_fit[kept], *(t[kept] for t in fit_targets["latency"])),
                      (x_val, *val_targets["latency"]), config, generator)
            with torch.no_grad():
                median[held] = head(x_fit[held]) * scale
        model.neighbour_inputs = x_fit.clone()
        model.neighbour_ratios = torch.where(train.mask, train.latency_ms / median.clamp(min=1e-6), torch.nan)
    return model.eval()


Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _fit_head(head: nn.Module, loss_fn: Loss, fit: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              val: tuple[torch.Tensor, torch.Tensor, torch.Tensor], config: OutcomeConfig,
              generator: torch.Generator) -> None:
    """AdamW on ``fit`` = (inputs, target, weight) until ``config.patience`` epochs pass without a
    lower loss on ``val``; the head keeps its best epoch."""
    x_train, y_train, w_train = fit
    x_val, y_val, w_val = val
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    with torch.no_grad():
        best, best_state, stale = float(loss_fn(head(x_val), y_val, w_val)), copy.deepcopy(head.state_dict()), 0
    for _ in range(config.max_epochs):
        head.train()
        order = torch.randperm(len(x_train), generator=generator)
        for start in range(0, len(x_train), config.batch_size):
            index = order[start:start + config.batch_size]
            loss = loss_fn(head(x_train[index]), y_train[index], w_train[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            current = float(loss_fn(head(x_val), y_val, w_val))
        if current < best - 1e-6:
            best, best_state, stale = current, copy.deepcopy(head.state_dict()), 0
        else:
            stale += 1
            if stale >= config.patience:
                break
    head.load_state_dict(best_state)
    head.eval()


class OutcomeDecider(DeterministicDecider):
    """The outcome model's choice (``"outcome"``): per sample, among the allowed configurations
    whose predicted latency quantile fits the budget, the highest predicted score (ties -> lower
    predicted latency); when none fits, the lowest predicted latency."""

    def __init__(self, model: OutcomeModel, name: str = "outcome") -> None:
        self.model, self.name = model, name
        self.action_space = model.action_space

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        require_allowed_actions(data)
        score, latency = self.model.predict(data)
        budget = budget_vector(budget_ms, len(data))
        fits = data.mask & (latency <= budget[:, None])
        best, found = best_candidate(fits, score, latency)
        fastest, _ = best_candidate(data.mask, -latency, torch.zeros_like(latency))
        return torch.where(found, best, fastest)
