"""The controller policy: a small two-stage network over the recorded knob configurations.

Stage 1 (``crops``) runs before the vision tower in the deployed system, so it reads only the
language features and the budget. Stage 2 (``top_k`` and ``num_active_blocks``) reads the
language and image features (plus an image-present flag), the budget and an embedding of the
stage-1 choice. The heads are *factorized*::

    log pi(c, k, b | x) = log p1(c | lang, budget) + log p2(k | x, c) + log p3(b | x, c)

(``top_k`` and ``num_active_blocks`` are conditionally independent given the crops choice
and the context; a joint stage-2 head would not survive the online phase, which adds the
insertion position as another stage-1 factor). Over the joint action space the log-probs are
then renormalised over each sample's mask (masked log-softmax), so only configurations
recorded for that sample get probability; with a full mask over a full product space the
renormalisation is the identity.

The image feature stage 2 reads is the global crop's (``image_features.global_feature``,
``trainer.data.GLOBAL_IMAGE_FEATURE``): stage 1 chooses the crops before the vision tower runs,
so a server has the vision output at the chosen crop count only, and the global crop's tokens
are the same at every crop count. The checkpoint records the feature (``image_feature``); a
policy is applied only to data of that feature.

Both stages may also read the image's *tiling* (``tiling_crops``: per crops choice, the number
of crops the preprocessor tiles this image into; ``image_tilings``). It depends on the image
size alone, so it is known before the vision tower and stage 1 may use it; it is the most
direct per-sample predictor of the vision and prefill cost of each crops choice. Stage 1 reads
the standardised log(1 + crops) of every choice, stage 2 adds a per-choice term. Missing
tilings (no readable image, or a caller without them) read as the training mean.

A policy may also read a per-request cost model (``use_request_cost``,
:class:`trainer.request_cost.RequestCostModel`, fitted on its training split and kept inside the
policy): the standardised log of each request's predicted median latency at every configuration,
from its question, tiling and prompt length (all known before the vision tower), joins the language
features before their projection, so both stages read it. Training passes out-of-fold predictions
for the rows the cost model was fitted on (``OfflineData.request_latency_ms``): in-sample ones would
teach the network to trust the model more than it may on an unseen request.

The budget enters through a sinusoidal encoding followed by an MLP (``docs/origin_format.md``
§7.2), but normalised over the training budget range (never the origin's fixed 50-500 ms,
§9 D22) with frequencies chosen so that every dimension varies over that range; budgets outside
it are clamped to its ends.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import CacheMismatchError, CtrlError
from trainer.data import GLOBAL_IMAGE_FEATURE, IMAGE_FEATURE_COLUMNS, ActionSpace, OfflineData
from trainer.request_cost import RequestCostModel
from trainer.reward import RewardConfig, compute_reward
from trainer.runs import atomic_torch_save

#: bump when the checkpoint layout or what it reads changes (2: tiling inputs; 3: the global-crop
#: image feature, recorded as ``image_feature``: a format-2 policy read the all-crops feature)
CHECKPOINT_FORMAT = 3


def budget_normalization_range(min_ms: float, max_ms: float, margin: float = 0.0) -> tuple[float, float]:
    """The budget encoder's normalisation range: the training budget range widened by ``margin``.

    ``margin`` is a fraction of the range width added on each side. The default, none, makes a
    budget outside the training range read as its nearest end (the encoder clamps): a generous
    budget gets the decision learnt for the range's top, never an encoding the network was not
    trained on (which can spend less where every configuration fits).
    """
    if not max_ms > min_ms:
        msg = f"budget range must have max_ms > min_ms, got min_ms={min_ms!r}, max_ms={max_ms!r}"
        raise ValueError(msg)
    width = max_ms - min_ms
    return max(0.0, min_ms - margin * width), max_ms + margin * width


@dataclass
class PolicyConfig:
    """Architecture of :class:`ControllerPolicy` (saved in every checkpoint).

    > Inputs (set from the data; a checkpoint refuses features of other widths)
    lang_feature_dim: width of ``lang_features.feature`` (int).
    image_feature_dim: width of the image feature (int).
    image_feature: the ``image_features`` column stage 2 reads (``"global_feature"``, the
        global crop's, by default and in deployment; ``"feature"`` only to compare with the
        all-crops reference feature, ``trainer.data.IMAGE_FEATURE_COLUMNS``).
    budget_min_ms, budget_max_ms: budget normalisation range in ms (float). Budgets are mapped
        to [0, 1] over it and clamped outside. Set it from the data's budget range with a
        margin (:func:`budget_normalization_range`); there is deliberately no default
        (origin's fixed 50-500 ms wasted most of the encoding, §9 D22).

    > Budget encoder (origin §7.2, resized)
    budget_encoding_dim: sinusoid width (int, even, default 32): sin and cos of
        ``pi * f_i * position`` for ``budget_encoding_dim / 2`` frequencies f_i spaced
        geometrically from 1 to ``budget_max_frequency``.
    budget_max_frequency: highest frequency (float, default 16): resolves about
        1/32 of the range; the lowest frequency (1) keeps a monotone component.
    budget_hidden_dim: width of the budget MLP (Linear, LayerNorm, GELU, Linear, LayerNorm).

    > Trunk and heads
    hidden_dim: width of every projection and fusion layer (int, default 128; origin used
        256-2048, far more than 64-dim features need; keeps one decision well under 1 ms).
    crops_embedding_dim: width of the stage-1 choice embedding fed to stage 2 (default 16).
    dropout: dropout after each projection (float in [0, 1), default 0.0; origin used 0.1).
        Off by default because the GRPO ratio and KL terms compare the policy with itself
        under sampling, which dropout noise would bias (TRL disables dropout for the same reason).
    use_tilings: read ``tiling_crops`` (bool, default False): the crops each max_crops choice
        gives for this image, in both stages. False = features and budget only (the
        ``tiling_crops`` arguments are then ignored).
    use_request_cost: read a per-request cost model's predicted latency of every configuration
        (bool, default False; the model is attached with :meth:`ControllerPolicy.attach_request_cost`
        and saved in the checkpoint).
    """

    lang_feature_dim: int
    image_feature_dim: int
    budget_min_ms: float
    budget_max_ms: float
    budget_encoding_dim: int = 32
    budget_max_frequency: float = 16.0
    budget_hidden_dim: int = 64
    hidden_dim: int = 128
    crops_embedding_dim: int = 16
    dropout: float = 0.0
    use_tilings: bool = False
    image_feature: str = GLOBAL_IMAGE_FEATURE
    use_request_cost: bool = False

    def __post_init__(self) -> None:
        if self.image_feature not in IMAGE_FEATURE_COLUMNS:
            msg = f"`image_feature` must be one of {IMAGE_FEATURE_COLUMNS}, got {self.image_feature!r}"
            raise ValueError(msg)
        if int(self.image_feature_dim) < 0:  # 0: a workspace without any image features
            msg = f"`image_feature_dim` must be >= 0, got {self.image_feature_dim!r}"
            raise ValueError(msg)
        for name in ("lang_feature_dim", "budget_hidden_dim", "hidden_dim", "crops_embedding_dim"):
            if int(getattr(self, name)) < 1:
                msg = f"`{name}` must be >= 1, got {getattr(self, name)!r}"
                raise ValueError(msg)
        if self.budget_encoding_dim < 2 or self.budget_encoding_dim % 2:
            msg = f"`budget_encoding_dim` must be an even number >= 2, got {self.budget_encoding_dim!r}"
            raise ValueError(msg)
        if not self.budget_max_ms > self.budget_min_ms:
            msg = (f"`budget_max_ms` ({self.budget_max_ms!r}) must be greater than `budget_min_ms` "
                   f"({self.budget_min_ms!r})\nHint: derive both from the data with budget_normalization_range().")
            raise ValueError(msg)
        if not 0.0 <= self.dropout < 1.0:
            msg = f"`dropout` must be in [0, 1), got {self.dropout!r}"
            raise ValueError(msg)
        if self.budget_max_frequency < 1.0:
            msg = f"`budget_max_frequency` must be >= 1, got {self.budget_max_frequency!r}"
            raise ValueError(msg)


class BudgetEncoder(nn.Module):
    """Budget in ms (N,) -> (N, budget_hidden_dim): normalise, sinusoid, MLP (origin §7.2)."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.min_ms, self.max_ms = float(config.budget_min_ms), float(config.budget_max_ms)
        n = config.budget_encoding_dim // 2
        freqs = math.pi * torch.logspace(0.0, math.log10(config.budget_max_frequency), n)
        self.register_buffer("frequencies", freqs, persistent=False)
        self.mlp = nn.Sequential(
            nn.Linear(config.budget_encoding_dim, config.budget_hidden_dim), nn.LayerNorm(config.budget_hidden_dim),
            nn.GELU(), nn.Linear(config.budget_hidden_dim, config.budget_hidden_dim),
            nn.LayerNorm(config.budget_hidden_dim))

    def encode(self, budget_ms: Tensor) -> Tensor:
        """The sinusoid (N, budget_encoding_dim) of the clamped normalised budget."""
        position = ((budget_ms.float() - self.min_ms) / (self.max_ms - self.min_ms)).clamp(0.0, 1.0)
        angles = position[:, None] * self.frequencies[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    def forward(self, budget_ms: Tensor) -> Tensor:
        return apply_sequential(self.mlp, self.encode(budget_ms), self.training)


def apply_sequential(seq: nn.Sequential, x: Tensor, training: bool) -> Tensor:
    """Run a Sequential of Linear/LayerNorm/ReLU/GELU/Dropout through the functional ops.

    Same result as ``seq(x)``, but without ``nn.Module.__call__``, which costs ~8 µs per module
    on the 2-core CPU against ~4 µs for the op itself: it halves a batch-1 decision.
    """
    for m in seq:
        if isinstance(m, nn.Linear):
            x = F.linear(x, m.weight, m.bias)
        elif isinstance(m, nn.LayerNorm):
            x = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
        elif isinstance(m, nn.ReLU):
            x = F.relu(x)
        elif isinstance(m, nn.GELU):
            x = F.gelu(x)
        elif isinstance(m, nn.Dropout):
            x = F.dropout(x, m.p, training) if training and m.p > 0 else x
        else:  # a module this helper does not know: fall back to calling it
            x = m(x)
    return x


def projection(in_dim: int, out_dim: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim), nn.ReLU(), nn.Dropout(dropout))


def mlp_head(in_dim: int, hidden: int, out_dim: int) -> nn.Sequential:
    head = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, out_dim))
    with torch.no_grad():  # start close to uniform, so early samples explore every configuration
        head[-1].weight.mul_(0.01)
        head[-1].bias.zero_()
    return head


# -- the layers by name: what the export (``controller.deploy``) folds into plain tensors

@dataclass(frozen=True)
class Projection:
    """The parts of a :func:`projection`: ``linear`` -> ``norm`` -> ReLU -> dropout."""

    linear: nn.Linear
    norm: nn.LayerNorm


@dataclass(frozen=True)
class Head:
    """The parts of an :func:`mlp_head`: ``hidden`` -> ReLU -> ``out``."""

    hidden: nn.Linear
    out: nn.Linear


@dataclass(frozen=True)
class BudgetMLP:
    """The parts of ``BudgetEncoder.mlp``: ``linear1`` -> ``norm1`` -> GELU (erf) -> ``linear2`` -> ``norm2``."""

    linear1: nn.Linear
    norm1: nn.LayerNorm
    linear2: nn.Linear
    norm2: nn.LayerNorm


@dataclass(frozen=True)
class PolicyParts:
    """Every layer of a :class:`ControllerPolicy` by name (:meth:`ControllerPolicy.parts`).

    Stage 1: ``lang`` (of the standardised language features), ``budget`` (of the sinusoid),
    ``stage1_fusion`` (of [lang, budget, tiling, tiling known]), ``crops_head``. Stage 2: ``image``
    (of [standardised image * present, present]), ``stage2_context`` (of [lang, image, budget]),
    ``stage2_choice`` (of ``crops_embedding``), ``stage2_tiling`` (None without tilings),
    ``stage2_norm`` (then ReLU, dropout), ``top_k_head``, ``blocks_head``.
    """

    lang: Projection
    budget: BudgetMLP
    stage1_fusion: Projection
    crops_head: Head
    image: Projection
    stage2_context: nn.Linear
    stage2_choice: nn.Linear
    crops_embedding: nn.Embedding
    stage2_tiling: nn.Linear | None
    stage2_norm: nn.LayerNorm
    top_k_head: Head
    blocks_head: Head

    def norms(self) -> list[nn.LayerNorm]:
        return [self.lang.norm, self.budget.norm1, self.budget.norm2, self.stage1_fusion.norm, self.image.norm,
                self.stage2_norm]


_PROJECTION = (nn.Linear, nn.LayerNorm, nn.ReLU, nn.Dropout)
_HEAD = (nn.Linear, nn.ReLU, nn.Linear)
_BUDGET_MLP = (nn.Linear, nn.LayerNorm, nn.GELU, nn.Linear, nn.LayerNorm)
_STAGE2_NORM = (nn.LayerNorm, nn.ReLU, nn.Dropout)


def _layers(seq: nn.Sequential, name: str, layout: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The layers of ``seq``, checked against ``layout`` (a TypeError naming both where they differ)."""
    found = tuple(type(m) for m in seq)
    if found != layout:
        msg = (f"policy layers {name} are {[t.__name__ for t in found]}, not {[t.__name__ for t in layout]}: "
               "ControllerPolicy.parts and the export (controller.deploy) read them by name and must change with them")
        raise TypeError(msg)
    return list(seq)


class ControllerPolicy(nn.Module):
    """pi(action | image features, language features, budget) over an :class:`ActionSpace`.

    Inputs (all batched over N): ``image`` float32 (N, Di), zeros where missing;
    ``image_present`` bool (N,); ``lang`` float32 (N, Dl); ``budget_ms`` float (N,) or a
    scalar; ``mask`` bool (N, A), the actions allowed per sample (None = all); optional
    ``tiling_crops`` float (N, C): per ``action_space.max_crops_values`` entry, the crops
    (rows * cols) of this image's tiling, NaN where unknown (None = all unknown); optional
    ``prompt_tokens`` float (N,) (NaN unknown) and ``request_ms`` float (N, A), read only with
    ``use_request_cost``: the prompt's length the cost model reads, or the cost model's prediction
    itself in its place (training rows, out of fold).
    Features are standardised with per-dimension statistics stored as buffers
    (:meth:`set_feature_normalization`, computed on the training split).
    """

    def __init__(self, config: PolicyConfig, action_space: ActionSpace, model_fingerprint: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.action_space = action_space
        self.model_fingerprint = model_fingerprint
        h, d = config.hidden_dim, config.dropout
        num_crops = len(action_space.max_crops_values)
        num_top_k = len(action_space.top_k_values)
        num_blocks = len(action_space.num_active_blocks_values)
        self.register_buffer("knob_indices", action_space.knob_indices().long().clone(), persistent=False)
        ci, ki, bi = self.knob_indices.unbind(1)
        # flat positions of each action's factors in crops (C,), top_k (C*K,) and blocks (C*B,) log-probs
        self.register_buffer("crops_index", ci.clone(), persistent=False)
        self.register_buffer("top_k_index", ci * num_top_k + ki, persistent=False)
        self.register_buffer("blocks_index", ci * num_blocks + bi, persistent=False)
        dims = (("lang", config.lang_feature_dim), ("image", config.image_feature_dim), ("tiling", num_crops))
        for name, dim in dims:
            self.register_buffer(f"{name}_mean", torch.zeros(dim))
            self.register_buffer(f"{name}_std", torch.ones(dim))
        self.budget_encoder = BudgetEncoder(config)
        hb = config.budget_hidden_dim
        # tiling inputs of stage 1: standardised log(1 + crops) per choice + a "known" flag
        self.tiling_dim = num_crops + 1 if config.use_tilings else 0
        # the per-request cost model's prediction joins the language features (attach_request_cost)
        self.request_cost: RequestCostModel | None = None
        self.cost_dim = len(action_space) if config.use_request_cost else 0
        if config.use_request_cost:
            self.register_buffer("cost_mean", torch.zeros(()))
            self.register_buffer("cost_std", torch.ones(()))
        # stage 1: crops, before the vision tower (language + budget + image tiling)
        self.lang_proj = projection(config.lang_feature_dim + self.cost_dim, h, d)
        self.stage1_fusion = projection(h + hb + self.tiling_dim, h, d)
        self.crops_head = mlp_head(h, h, num_crops)
        # stage 2: top_k and blocks, after vision (language + image + budget + stage-1 choice)
        self.image_proj = projection(config.image_feature_dim + 1, h, d)
        self.crops_embedding = nn.Embedding(num_crops, config.crops_embedding_dim)
        # the fusion's first layer is split (context part + choice part) so the context is
        # projected once and each crops choice only adds a (C, H) term
        self.stage2_context = nn.Linear(2 * h + hb, h)
        self.stage2_choice = nn.Linear(config.crops_embedding_dim, h, bias=False)
        # the choice's own tiling (standardised log(1 + crops)) shifts its hidden state
        self.stage2_tiling = nn.Linear(1, h, bias=False) if config.use_tilings else None
        self.stage2_norm = nn.Sequential(nn.LayerNorm(h), nn.ReLU(), nn.Dropout(d))
        self.top_k_head = mlp_head(h, h, num_top_k)
        self.blocks_head = mlp_head(h, h, num_blocks)

    def parts(self) -> PolicyParts:
        """The layers by name: the one place that knows their positions inside each ``Sequential``
        (a changed layout is a TypeError here, not a silently different export)."""

        def proj(name: str, seq: nn.Sequential) -> Projection:
            layers = _layers(seq, name, _PROJECTION)
            return Projection(layers[0], layers[1])

        def head(name: str, seq: nn.Sequential) -> Head:
            layers = _layers(seq, name, _HEAD)
            return Head(layers[0], layers[2])

        budget = _layers(self.budget_encoder.mlp, "budget_encoder.mlp", _BUDGET_MLP)
        if budget[2].approximate != "none":
            msg = f"policy layers budget_encoder.mlp: the export computes the exact (erf) GELU, not {budget[2]!r}"
            raise TypeError(msg)
        return PolicyParts(
            lang=proj("lang_proj", self.lang_proj),
            budget=BudgetMLP(budget[0], budget[1], budget[3], budget[4]),
            stage1_fusion=proj("stage1_fusion", self.stage1_fusion),
            crops_head=head("crops_head", self.crops_head),
            image=proj("image_proj", self.image_proj),
            stage2_context=self.stage2_context, stage2_choice=self.stage2_choice,
            crops_embedding=self.crops_embedding, stage2_tiling=self.stage2_tiling,
            stage2_norm=_layers(self.stage2_norm, "stage2_norm", _STAGE2_NORM)[0],
            top_k_head=head("top_k_head", self.top_k_head), blocks_head=head("blocks_head", self.blocks_head))

    # -- inputs
    def set_feature_normalization(self, image: Tensor, image_present: Tensor, lang: Tensor,
                                  tiling_crops: Tensor | None = None) -> None:
        """Store per-dimension mean/std of the features (training split; images and tilings only where known)."""
        with torch.no_grad():
            if tiling_crops is not None:
                t = torch.log1p(tiling_crops.float())
                known = ~torch.isnan(t).any(-1)
                if bool(known.any()):
                    self.tiling_mean.copy_(t[known].mean(0))
                    self.tiling_std.copy_(t[known].std(0, correction=0).clamp_min(0.1))  # constant columns stay ~0
            self.lang_mean.copy_(lang.float().mean(0))
            self.lang_std.copy_(lang.float().std(0, correction=0).clamp_min(1e-6))
            present = image[image_present.bool()].float()
            if len(present):
                self.image_mean.copy_(present.mean(0))
                self.image_std.copy_(present.std(0, correction=0).clamp_min(1e-6))

    def attach_request_cost(self, model: RequestCostModel, latency_ms: Tensor | None = None) -> None:
        """Keep ``model`` as the policy's cost model (``use_request_cost``); with ``latency_ms`` (N, A), the
        predictions the policy trains on, standardise its input by their log's mean and spread."""
        if not self.config.use_request_cost:
            msg = "this policy was built without use_request_cost: it has no input for a cost model"
            raise ValueError(msg)
        if model.action_space != self.action_space:
            msg = "the request cost model was fitted on another action space than the policy's"
            raise ValueError(msg)
        self.request_cost = model.eval()
        if latency_ms is not None:
            logs = torch.log(latency_ms.float().clamp(min=1.0))
            logs = logs[~logs.isnan()]
            if len(logs):
                with torch.no_grad():
                    self.cost_mean.fill_(float(logs.mean()))
                    self.cost_std.fill_(max(float(logs.std(correction=0)), 1e-3) if len(logs) > 1 else 1.0)

    def _cost_features(self, lang: Tensor, tiling_crops: Tensor | None, prompt_tokens: Tensor | None,
                       request_ms: Tensor | None) -> Tensor:
        """(N, A) the standardised log of each request's predicted median latency per configuration."""
        if request_ms is None:
            if self.request_cost is None:
                msg = "this policy reads a request cost model, and none is attached (attach_request_cost)"
                raise CtrlError(msg)
            n = lang.shape[0]
            tiling = (torch.full((n, len(self.action_space.max_crops_values)), float("nan"), device=lang.device)
                      if tiling_crops is None else torch.as_tensor(tiling_crops, dtype=torch.float32))
            prompt = (torch.full((n,), float("nan"), device=lang.device) if prompt_tokens is None
                      else torch.as_tensor(prompt_tokens, dtype=torch.float32).reshape(n))
            with torch.no_grad():
                request_ms = self.request_cost(lang.float(), tiling, prompt)[0]
        logs = torch.log(request_ms.float().clamp(min=1.0))
        return torch.nan_to_num((logs - self.cost_mean) / self.cost_std, nan=0.0)

    def _check_inputs(self, image: Tensor, lang: Tensor) -> None:
        want = (self.config.image_feature_dim, self.config.lang_feature_dim)
        if image.shape[-1] != want[0] or lang.shape[-1] != want[1]:
            msg = (f"features of width image={image.shape[-1]}, lang={lang.shape[-1]} do not fit this policy "
                   f"(image={want[0]}, lang={want[1]}, model fingerprint {str(self.model_fingerprint)[:16]})\n"
                   "Hint: use features extracted with the model the policy was trained on.")
            raise CacheMismatchError(msg)

    def _tiling(self, tiling_crops: Tensor | None, n: int) -> Tensor:
        """(N, C) standardised log(1 + crops), 0 (the training mean) where unknown."""
        c = len(self.action_space.max_crops_values)
        if tiling_crops is None:
            return torch.zeros(n, c)
        t = torch.as_tensor(tiling_crops, dtype=torch.float32)
        if t.shape != (n, c):
            msg = (f"tiling_crops must have shape ({n}, {c}) (one column per max_crops value "
                   f"{self.action_space.max_crops_values}), got {tuple(t.shape)}")
            raise ValueError(msg)
        return torch.nan_to_num((torch.log1p(t) - self.tiling_mean) / self.tiling_std, nan=0.0)

    # -- the two stages
    def stage1(self, lang: Tensor, budget_ms: Tensor | float, *, tiling_crops: Tensor | None = None,
               prompt_tokens: Tensor | None = None, request_ms: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Stage 1: log p1(crops | lang, budget, tiling) (N, C), the projected language features (N, H)
        and the budget encoding (N, budget_hidden_dim) that stage 2 (offline or online) reuses.

        ``tiling_crops`` (N, C), optional: the crops this image tiles into at each
        ``action_space.max_crops_values`` entry (NaN or None = unknown). ``prompt_tokens``, ``request_ms``:
        as in the class docstring."""
        self._check_lang(lang)
        return self._stage1(lang, self._budget(budget_ms, lang.shape[0]), tiling_crops, prompt_tokens, request_ms)

    def _check_lang(self, lang: Tensor) -> None:
        if lang.shape[-1] != self.config.lang_feature_dim:
            msg = (f"language features of width {lang.shape[-1]} do not fit this policy "
                   f"(lang={self.config.lang_feature_dim}, model fingerprint {str(self.model_fingerprint)[:16]})\n"
                   "Hint: use features extracted with the model the policy was trained on.")
            raise CacheMismatchError(msg)

    def _stage1(self, lang: Tensor, budget: Tensor, tiling_crops: Tensor | None = None,
                prompt_tokens: Tensor | None = None, request_ms: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        t = self.training
        lang_in = (lang.float() - self.lang_mean) / self.lang_std
        if self.cost_dim:
            lang_in = torch.cat([lang_in, self._cost_features(lang, tiling_crops, prompt_tokens, request_ms)], dim=-1)
        lang_h = apply_sequential(self.lang_proj, lang_in, t)
        budget_h = self.budget_encoder.forward(budget)
        parts = [lang_h, budget_h]
        if self.tiling_dim:
            known = torch.zeros(lang.shape[0], 1) if tiling_crops is None else \
                (~torch.isnan(torch.as_tensor(tiling_crops, dtype=torch.float32)).any(-1, keepdim=True)).float()
            parts += [self._tiling(tiling_crops, lang.shape[0]), known]
        logits = apply_sequential(self.crops_head, apply_sequential(self.stage1_fusion, torch.cat(parts, dim=-1), t), t)
        return logits.log_softmax(-1), lang_h, budget_h

    def _stage2(self, image: Tensor, image_present: Tensor, lang_h: Tensor, budget_h: Tensor,
                tiling_crops: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """log p(top_k | x, c) and log p(blocks | x, c) for every crops choice c: (N, C, K), (N, C, B)."""
        hidden = self.stage2_hidden(image, image_present, lang_h, budget_h, tiling_crops=tiling_crops)
        return self.stage2_heads(hidden)

    def stage2_heads(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Stage-2 hidden states (..., H) -> log p(top_k) (..., K), log p(blocks) (..., B)."""
        t = self.training
        top_k = apply_sequential(self.top_k_head, hidden, t).log_softmax(-1)
        return top_k, apply_sequential(self.blocks_head, hidden, t).log_softmax(-1)

    def stage2_hidden(self, image: Tensor, image_present: Tensor, lang_h: Tensor, budget_h: Tensor, *,
                      tiling_crops: Tensor | None = None) -> Tensor:
        """The stage-2 trunk for every crops choice, (N, C, H), before the heads.

        ``lang_h`` and ``budget_h`` come from :meth:`stage1`. The online controller adds its
        latency-token and insertion terms to this hidden state before :meth:`stage2_heads`.
        ``tiling_crops`` (N, C), optional: as in :meth:`stage1` (pass the same tensor).
        """
        present = image_present.float()[:, None]
        image_n = (image.float() - self.image_mean) / self.image_std * present  # a missing image is all zeros
        t = self.training
        image_h = apply_sequential(self.image_proj, torch.cat([image_n, present], dim=-1), t)
        context = F.linear(torch.cat([lang_h, image_h, budget_h], dim=-1), self.stage2_context.weight,
                           self.stage2_context.bias)  # (N, H)
        choice = F.linear(self.crops_embedding.weight, self.stage2_choice.weight)[None, :, :]  # (1, C, H)
        if self.stage2_tiling is not None:
            tiling = self._tiling(tiling_crops, lang_h.shape[0])  # (N, C)
            choice = choice + tiling[:, :, None] * self.stage2_tiling.weight[:, 0]  # Linear(1, H) without the call
        return apply_sequential(self.stage2_norm, context[:, None, :] + choice, t)  # (N, C, H)

    @staticmethod
    def _budget(budget_ms: Tensor | float, n: int) -> Tensor:
        budget = torch.as_tensor(budget_ms, dtype=torch.float32)
        return budget.expand(n) if budget.dim() == 0 else budget.reshape(n)

    def crops_log_probs(self, lang: Tensor, budget_ms: Tensor | float, *, tiling_crops: Tensor | None = None,
                        prompt_tokens: Tensor | None = None, request_ms: Tensor | None = None) -> Tensor:
        """Stage 1 alone: log p1(crops | lang, budget, tiling), (N, C) over ``action_space.max_crops_values``."""
        return self._stage1(lang, self._budget(budget_ms, lang.shape[0]), tiling_crops, prompt_tokens, request_ms)[0]

    def log_probs(self, image: Tensor, image_present: Tensor, lang: Tensor, budget_ms: Tensor | float,
                  mask: Tensor | None = None, *, tiling_crops: Tensor | None = None,
                  prompt_tokens: Tensor | None = None, request_ms: Tensor | None = None) -> Tensor:
        """log pi(a | x) over the joint action space, (N, A): -inf outside ``mask``, rows sum to 1."""
        self._check_inputs(image, lang)
        n = lang.shape[0]
        crops_lp, lang_h, budget_h = self._stage1(lang, self._budget(budget_ms, n), tiling_crops, prompt_tokens,
                                                  request_ms)
        top_k_lp, blocks_lp = self._stage2(image, image_present, lang_h, budget_h, tiling_crops)
        joint = (crops_lp.index_select(1, self.crops_index)  # (N, A); index_select beats fancy indexing
                 + top_k_lp.flatten(1).index_select(1, self.top_k_index)
                 + blocks_lp.flatten(1).index_select(1, self.blocks_index))
        if mask is None:
            return joint.log_softmax(-1)
        if not bool(mask.any(-1).all()):
            empty = int((~mask.any(-1)).sum())
            msg = f"{empty} of {n} rows have an empty action mask: no recorded configuration to choose from"
            raise CtrlError(msg)
        return joint.masked_fill(~mask, float("-inf")).log_softmax(-1)

    # -- checkpoints
    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        """Write a checkpoint (atomic): weights, config, action space, fingerprint, feature dims and
        the image feature read."""
        payload = {
            "format": CHECKPOINT_FORMAT,
            "state_dict": self.state_dict(),
            "config": asdict(self.config),
            "action_space": self.action_space.to_json(),
            "model_fingerprint": self.model_fingerprint,
            "lang_feature_dim": self.config.lang_feature_dim,
            "image_feature_dim": self.config.image_feature_dim,
            "image_feature": self.config.image_feature,
            "budget_range_ms": [self.config.budget_min_ms, self.config.budget_max_ms],
            # how to rebuild the cost model the state_dict's request_cost.* entries fill
            **({"request_cost": self.request_cost.layout()} if self.request_cost is not None else {}),
            **(extra or {}),
        }
        return atomic_torch_save(payload, Path(path))

    @classmethod
    def load(cls, path: str | Path, model_fingerprint: str | None = None, *, offline_only: bool = False
             ) -> ControllerPolicy:
        """Read a checkpoint; with ``model_fingerprint``, refuse features of another model; with
        ``offline_only``, refuse an online run's checkpoint (its offline part alone is not the
        controller the run trained: the online stage-2 heads read the model's hidden states)."""
        payload = read_checkpoint(path)
        if offline_only and "two_stage" in payload:
            msg = (f"{path}: the checkpoint of an online run: its controller needs the model in the loop\n"
                   "Hint: predict and export take offline runs; evaluate an online run with `ctrl evaluate RUN`.")
            raise CtrlError(msg)
        policy = cls(PolicyConfig(**payload["config"]), ActionSpace.from_json(payload["action_space"]),
                     payload["model_fingerprint"])
        if policy.config.use_request_cost:
            policy.attach_request_cost(RequestCostModel.from_layout(payload["request_cost"]))
        policy.load_state_dict(payload["state_dict"], strict=True)  # never strict=False (§9 D25)
        policy.eval()
        if model_fingerprint is not None:
            check_fingerprint(policy, model_fingerprint, path)
        return policy


def read_checkpoint(path: str | Path) -> dict:
    """The raw checkpoint dict; a missing or foreign file is a user error."""
    path = Path(path)
    if not path.is_file():
        msg = (f"checkpoint {str(path)!r} does not exist\n"
               "Hint: pass a run id, a run directory or a .pt file written by `ctrl train --offline`.")
        raise CtrlError(msg)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a foreign or corrupt file: wrap once, here
        msg = f"{path}: not a ctrl checkpoint ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        raise CtrlError(msg) from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        why = (" (its stage 2 read the all-crops image feature, which a server does not have)"
               if found in (1, 2) else "")
        msg = (f"{path}: checkpoint format {found!r}, this ctrl reads format {CHECKPOINT_FORMAT}{why}\n"
               "Hint: checkpoints from an older ctrl cannot be loaded; train a new run with `ctrl train --offline`.")
        raise CtrlError(msg)
    return payload


def check_fingerprint(policy: ControllerPolicy, model_fingerprint: str, where: str | Path = "checkpoint") -> None:
    """Raise :class:`CacheMismatchError` when the policy was trained on another model's features."""
    if policy.model_fingerprint != model_fingerprint:
        msg = (f"{where}: trained on features of model {str(policy.model_fingerprint)[:16]}, "
               f"but these features come from model {str(model_fingerprint)[:16]}\n"
               "Hint: run `ctrl extract-features` with the model the checkpoint was trained on (the same --dtype and, "
               "for MolmoE on a GPU, --float32-attention alike), or train a new run.")
        raise CacheMismatchError(msg)


def check_image_feature(policy: ControllerPolicy, data: OfflineData, where: str | Path = "policy") -> None:
    """Raise :class:`CacheMismatchError` when ``data`` holds another image feature than the policy read in training."""
    if policy.config.image_feature != data.image_feature:
        msg = (f"{where}: trained on the image feature {policy.config.image_feature!r}, "
               f"but the data holds {data.image_feature!r}\n"
               "Hint: load the data with the feature the policy was trained on, or train a new run.")
        raise CacheMismatchError(msg)


def mask_in_policy_space(policy: ControllerPolicy, data: OfflineData) -> tuple[Tensor, Tensor | None]:
    """``data.mask`` mapped into the policy's action space, and the policy->data index map (None = same)."""
    if tuple(policy.action_space.actions) == tuple(data.action_space.actions):
        return data.mask, None
    policy_index = {a: i for i, a in enumerate(policy.action_space.actions)}
    to_data = torch.full((len(policy.action_space.actions),), -1, dtype=torch.long)
    mask = torch.zeros(len(data), len(policy.action_space.actions), dtype=torch.bool)
    for j, action in enumerate(data.action_space.actions):
        if action in policy_index:  # actions the policy never saw cannot be chosen
            to_data[policy_index[action]] = j
            mask[:, policy_index[action]] = data.mask[:, j]
    return mask, to_data


def tilings_in_policy_space(policy: ControllerPolicy, data: OfflineData) -> Tensor | None:
    """``data.tiling_crops`` with one column per crops value of the policy (NaN where the data has none)."""
    tilings = getattr(data, "tiling_crops", None)
    ours, theirs = policy.action_space.max_crops_values, data.action_space.max_crops_values
    if tilings is None or ours == theirs:
        return tilings
    out = torch.full((tilings.shape[0], len(ours)), float("nan"))
    for j, value in enumerate(ours):
        if value in theirs:
            out[:, j] = tilings[:, theirs.index(value)]
    return out


def request_ms_in_policy_space(policy: ControllerPolicy, data: OfflineData) -> Tensor | None:
    """``data.request_latency_ms`` where the policy reads it and it is in the policy's action space (else None:
    the policy's own cost model predicts)."""
    if not policy.config.use_request_cost or tuple(policy.action_space.actions) != tuple(data.action_space.actions):
        return None
    return getattr(data, "request_latency_ms", None)


def data_log_probs(policy: ControllerPolicy, data: OfflineData, budget_ms: Tensor | float) -> Tensor:
    """log pi over ``data.action_space`` (N, A_data) under ``data.mask``; -inf elsewhere."""
    check_image_feature(policy, data)
    mask, to_data = mask_in_policy_space(policy, data)
    lp = policy.log_probs(data.image_features, data.image_present, data.lang_features, budget_ms, mask,
                          tiling_crops=tilings_in_policy_space(policy, data),
                          prompt_tokens=getattr(data, "prompt_tokens", None),
                          request_ms=request_ms_in_policy_space(policy, data))
    if to_data is None:
        return lp
    out = torch.full((len(data), len(data.action_space.actions)), float("-inf"))
    keep = to_data >= 0
    out[:, to_data[keep]] = lp[:, keep]
    return out


@torch.no_grad()
def expected_reward(policy: ControllerPolicy, data: OfflineData, budgets_ms: list[float],
                    reward: RewardConfig, details: bool = False) -> float | dict[str, float]:
    """Exact E_{a~pi}[r(x, a)] = sum_a pi(a|x) r(x, a), averaged over samples x budgets.

    Every allowed configuration is recorded, so no estimator is needed. With ``details``,
    also the expected accuracy and violation rate (latency > budget) under the same policy.
    """
    was_training = policy.training
    policy.eval()
    totals = {"expected_reward": 0.0, "expected_accuracy": 0.0, "expected_violation_rate": 0.0}
    knobs = data.action_space.knob_values().float()
    try:
        for budget in budgets_ms:
            probs = data_log_probs(policy, data, float(budget)).exp()
            b = torch.full((len(data), 1), float(budget))
            r = compute_reward(data.score, data.latency_ms, b, knobs[None], reward)["reward"]
            totals["expected_reward"] += float((probs * torch.where(data.mask, r, 0.0)).sum(-1).mean())
            totals["expected_accuracy"] += float((probs * torch.where(data.mask, data.score, 0.0)).sum(-1).mean())
            viol = torch.where(data.mask, (data.latency_ms > b).float(), 0.0)
            totals["expected_violation_rate"] += float((probs * viol).sum(-1).mean())
    finally:
        policy.train(was_training)
    out = {k: v / max(len(budgets_ms), 1) for k, v in totals.items()}
    return out if details else out["expected_reward"]
