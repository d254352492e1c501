"""The deployed controller as one small module: folded weights, one decision in a few dozen ops.

:class:`DeployedController` holds what a serving process needs to decide — the policy
network, the budget encoding, the action space and the table fallback per budget — as plain
tensors, in the two calls a server makes: ``stage1`` (the crops, before the vision tower, from
the language features, the budget and the tiling) and ``stage2`` (top_k and blocks, after the
vision pass at those crops). ``decide`` is the two in sequence: the greedy decision of
:mod:`trainer.greedy` over the policy's whole action space, as
:class:`trainer.fallback.PolicyDecider` makes it (what ``ctrl predict`` writes). For speed:

* the per-feature standardisation is folded into the first ``Linear`` of each projection
  (``W' = W / std``, ``b' = b - W' mean``), and the image-present flag into the image one;
* the log-softmaxes are dropped from the decision: each shifts every choice of its row by the
  same constant, so no argmax moves (the probability, which ``predict`` reports, adds them back);
* the stage-2 choice embedding goes through its ``Linear`` once, at build time, and stage 2 runs
  at the chosen crops only; its two heads run as one pair of matmuls, and over a full product of
  knob values the best top_k and blocks are two separate argmaxes;
* the table fallback becomes lookups: the nearest validation-grid budget says whether the
  network or the table answers, and the table's choice is a step function of the budget (it
  changes only where a configuration's p95 latency starts to fit), one per question family
  where the table is ``lut_by_question`` (the family read by a vote of the nearest reference
  questions: one small matmul);
* where every row of a batch is answered by the table, the network is not run.

The module is TorchScript-compatible and is what ``ctrl export`` writes
(``torch.jit.load(FILE)`` needs torch only) and what ``ctrl predict`` runs.
"""

from __future__ import annotations

import copy
import io
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import CtrlError
from pipeline.workspace import Workspace, write_bytes_atomic
from trainer.baselines import (
    LookupTableDecider,
    QuestionFamilyTableDecider,
    best_candidate,
    closest_similarity,
    nearest_family,
)
from trainer.data import ActionSpace
from trainer.fallback import TableFallback, read_fallback
from trainer.greedy import greedy_crops, greedy_within_crops
from trainer.policy import ControllerPolicy
from trainer.request_cost import RequestCostConfig, RequestCostModel, lookup_cells, question_clusters
from trainer.request_table import request_table_choice
from trainer.runs import resolve_checkpoint

__all__ = ["DeployedController", "ExportReport", "compile_device", "export_controller", "load_compiled",
           "load_deployed", "save_compiled", "save_deployed", "step_lookup", "table_rows", "table_steps"]


def _folded(linear: nn.Linear, mean: Tensor, std: Tensor, columns: int | None = None) -> tuple[Tensor, Tensor]:
    """``linear((x - mean) / std)`` as ``x @ w.T + b``: (w, b) in float64, then float32. With ``columns``, x is
    the first ``columns`` inputs of ``linear`` (the rest are added by the caller)."""
    weight = linear.weight if columns is None else linear.weight[:, :columns]
    w = weight.double() / std.double()[None, :]
    b = linear.bias.double() - w @ mean.double()
    return w.float().contiguous(), b.float().contiguous()


class DeployedController(nn.Module):
    """The controller in the two calls of a serving process, batched over B:

    * ``stage1(lang, budget_ms, tiling_crops=None)`` -> ``max_crops`` (B,) int64, before the
      vision tower;
    * ``stage2(lang, image, image_present, budget_ms, max_crops, tiling_crops=None)`` ->
      ``(top_k, num_active_blocks)``, two (B,) int64, after the vision pass at ``max_crops``;
    * ``decide(lang, image, image_present, budget_ms, tiling_crops=None)`` -> ``(max_crops, top_k,
      num_active_blocks)``: stage 1, then stage 2 at its crops.

    Inputs: ``lang`` float (B, L) language features; ``image`` float (B, I) image features (any
    values where ``image_present`` is False); ``image_present`` bool (B,); ``budget_ms`` float
    (B,); ``tiling_crops`` float (B, C), optional: per entry of ``max_crops_values``, the crops
    the preprocessor tiles this image into (NaN = unknown; read only by policies trained with
    tilings); ``max_crops`` int64 (B,): stage 1's result, one of ``max_crops_values``.

    Where the table fallback answers a budget, stage 1 returns the table's crops and stage 2 the
    table's top_k and blocks for that budget: stage 2 must get the budgets stage 1 got.

    ``reference_latency_ms`` (A,) float64, per row of ``actions``: the median latency of that
    configuration in the training split (NaN: not recorded there; empty without a table
    fallback), the scale the budgets are in.

    ``question_group(lang)`` -> (B,) int64: the question family or cluster each row reads as under
    the fallback's table, an index into the names ``group_names_text`` holds one per line (-1 where the
    table has none; TorchScript keeps a string, not an empty list); ``group_table`` names that table
    (``lut_by_question``, ``lut_by_cluster`` or "").
    """


    def __init__(self, policy: ControllerPolicy, fallback: TableFallback | None) -> None:
        super().__init__()
        policy = policy.eval()
        cfg, space = policy.config, policy.action_space
        with torch.no_grad():
            self.lang_dim, self.image_dim = int(cfg.lang_feature_dim), int(cfg.image_feature_dim)
            self.num_crops_values = len(space.max_crops_values)
            self.uses_tilings = bool(cfg.use_tilings)
            self.model_fingerprint = str(policy.model_fingerprint or "")
            self.register_buffer("actions", torch.tensor(space.actions, dtype=torch.long))  # (A, 3)
            self.register_buffer("max_crops_values", torch.tensor(space.max_crops_values, dtype=torch.long))
            self.register_buffer("crops_index", policy.crops_index.clone())
            self.register_buffer("top_k_index", policy.top_k_index.clone())
            self.register_buffer("blocks_index", policy.blocks_index.clone())
            parts = policy.parts()
            # stage 1
            lin = parts.lang.linear
            w, b = _folded(lin, policy.lang_mean, policy.lang_std, columns=self.lang_dim)
            self._build_network_cost(policy, lin)
            if self.reads_request_cost:  # ((log m - centre) / spread) Wc.T: the centre's part moves into the bias
                b = b - self.cost_center * self.cost_w.sum(0)
            self.register_buffer("lang_w", w.t().contiguous())
            self.register_buffer("lang_b", b)
            self._norm("lang_ln", parts.lang.norm)
            # one epsilon for every LayerNorm of the module
            eps = {float(norm.eps) for norm in parts.norms()}
            if len(eps) != 1:
                msg = f"the policy's LayerNorms have different eps {sorted(eps)}: the export applies one"
                raise ValueError(msg)
            self.eps = eps.pop()
            enc = policy.budget_encoder
            self.budget_min_ms, self.budget_max_ms = float(enc.min_ms), float(enc.max_ms)
            self.register_buffer("frequencies", enc.frequencies[None, :].clone())  # (1, F)
            mlp = parts.budget
            self._linear("b1", mlp.linear1)
            self._norm("b1_ln", mlp.norm1)
            self._linear("b2", mlp.linear2, scale=0.5)  # GELU's 0.5 moves into the next Linear (exact: a power of two)
            self._norm("b2_ln", mlp.norm2)
            self._linear("fuse", parts.stage1_fusion.linear)
            self._norm("fuse_ln", parts.stage1_fusion.norm)
            self._linear("crops1", parts.crops_head.hidden)
            self._linear("crops2", parts.crops_head.out)
            self.register_buffer("tiling_mean", policy.tiling_mean.clone())
            self.register_buffer("tiling_std", policy.tiling_std.clone())
            # stage 2: image_proj(cat[present * (image - mean) / std, present])
            #        = b + present * (W' image + (w_present - W' mean))
            ip = parts.image.linear
            di = self.image_dim
            w_img = ip.weight[:, :di].double() / policy.image_std.double()[None, :]
            self.register_buffer("image_w", w_img.t().float().contiguous())
            self.register_buffer("image_c", (ip.weight[:, di].double() - w_img @ policy.image_mean.double()).float())
            self.register_buffer("image_b", ip.bias.detach().clone())
            self._norm("image_ln", parts.image.norm)
            self._linear("context", parts.stage2_context)
            self.register_buffer("choice", F.linear(parts.crops_embedding.weight, parts.stage2_choice.weight))
            tiling_w = parts.stage2_tiling.weight[:, 0] if parts.stage2_tiling is not None else torch.zeros(
                cfg.hidden_dim)
            self.register_buffer("choice_tiling_w", tiling_w.detach().clone())
            self._norm("s2_ln", parts.stage2_norm)
            # both stage-2 heads in one pair of matmuls: first layers stacked, second layers block-diagonal
            tk, bl = parts.top_k_head, parts.blocks_head
            self.num_top_k = tk.out.out_features
            self.register_buffer("heads1_w", torch.cat([tk.hidden.weight, bl.hidden.weight]).t().detach().contiguous())
            self.register_buffer("heads1_b", torch.cat([tk.hidden.bias, bl.hidden.bias]).detach().clone())
            self.register_buffer("heads2_w", torch.block_diag(tk.out.weight, bl.out.weight).t().detach().contiguous())
            self.register_buffer("heads2_b", torch.cat([tk.out.bias, bl.out.bias]).detach().clone())
            self.num_blocks = bl.out.out_features
            # a full product of knob values in sorted order: the flattened (C, K, B) grid is the action index
            product = [(c, k, b) for c in space.max_crops_values for k in space.top_k_values
                       for b in space.num_active_blocks_values]
            self.full_product = list(space.actions) == product
            crops_of, top_k_of, blocks_of = policy.knob_indices.unbind(1)
            self.register_buffer("action_crops", crops_of.clone())
            self.register_buffer("action_top_k", top_k_of.clone())
            self.register_buffer("action_blocks", blocks_of.clone())
            # max_crops value -> its column (-1: not a value of the space); the last entry stands for
            # every value above the largest
            column = torch.full((max(space.max_crops_values) + 2,), -1, dtype=torch.long)
            column[torch.tensor(space.max_crops_values)] = torch.arange(self.num_crops_values)
            self.register_buffer("crops_column", column)
            self.max_crops_text = ", ".join(str(v) for v in space.max_crops_values)
            self._build_fallback(fallback)
            # the decision reads each prompt's length where a per-request table answers or the network reads
            # the cost model
            self.reads_prompt_tokens = bool(self.has_request_table or self.reads_request_cost)

    def _linear(self, name: str, linear: nn.Linear, scale: float = 1.0) -> None:
        """Buffers ``<name>_w`` (the weight transposed, (in, out), times ``scale``) and ``<name>_b``."""
        self.register_buffer(f"{name}_w", (linear.weight * scale).t().detach().contiguous())
        self.register_buffer(f"{name}_b", linear.bias.detach().clone())

    def _norm(self, name: str, norm: nn.LayerNorm) -> None:
        """Buffers ``<name>_w`` and ``<name>_b``: a LayerNorm's scale and shift."""
        self.register_buffer(f"{name}_w", norm.weight.detach().clone())
        self.register_buffer(f"{name}_b", norm.bias.detach().clone())

    def _build_network_cost(self, policy: ControllerPolicy, lang_linear: nn.Linear) -> None:
        """The network's own request cost model (``network_cost``) and its input's columns of the language
        projection, standardisation folded in (``cost_w`` (A, H), ``cost_center``); a network that reads none
        keeps a cost model without coefficients that is never called (TorchScript keeps one type)."""
        self.reads_request_cost = policy.request_cost is not None
        if policy.request_cost is None:
            self.network_cost = RequestCostModel(policy.action_space, RequestCostConfig(), self.lang_dim, 1,
                                                 max(policy.action_space.max_crops_values))
            self.register_buffer("cost_w", torch.zeros(len(policy.action_space), lang_linear.out_features))
            self.register_buffer("cost_center", torch.zeros(()))
            return
        self.network_cost = copy.deepcopy(policy.request_cost).eval()
        spread = float(policy.cost_std)
        self.register_buffer("cost_w", (lang_linear.weight[:, self.lang_dim:].double() / spread).t().float()
                             .contiguous().detach())
        self.register_buffer("cost_center", policy.cost_mean.detach().clone().float())

    def _build_fallback(self, fallback: TableFallback | None) -> None:
        # per action, the median latency of the training split (NaN: unseen there; empty: unknown), the
        # latencies the budgets are in: a server measures its own against them (controller.cost.LatencyScale)
        reference = torch.zeros(0, dtype=torch.float64)
        table = None if fallback is None else fallback.lookup_table()
        budget_table = None if fallback is None else fallback.budget_table()
        if budget_table is not None and budget_table.latency_median_ms is not None:
            median = dict(zip(budget_table.action_space.actions, budget_table.latency_median_ms.tolist()))
            reference = torch.tensor([median.get(tuple(a), math.nan) for a in self.actions.tolist()],
                                     dtype=torch.float64)
        self.register_buffer("reference_latency_ms", reference)
        # a cluster table keeps questions unlike every training question from the network, whose answers
        # for a kind of question it never saw are a guess (TableFallback.network_allowed)
        self.guards_network = fallback is not None and fallback.guards_network
        # a fallback that keeps the controller at every budget (and every question) is no fallback
        self.has_fallback = fallback is not None and (not all(fallback.use_controller) or self.guards_network)
        # the question-family (or cluster) tables: each row's family is read from its nearest reference
        # questions (none: one table for every row); read also to name a request's question group
        self.family_neighbours = 1
        self.num_groups = 0
        self.group_names_text = ""
        self.group_table = ""
        self.register_buffer("family_references", torch.zeros(0, self.lang_dim))
        self.register_buffer("family_of_reference", torch.zeros(0, dtype=torch.long))
        # a question less similar than this to every reference reads as no family (the global table)
        self.family_min_similarity = -2.0
        if isinstance(table, QuestionFamilyTableDecider) and table.has_families:
            self.num_groups = len(table.families)
            self.group_names_text = "\n".join(table.families)
            self.group_table = str(table.name)
            self.family_neighbours = table.neighbours
            self.family_references = table.reference_features.clone()
            self.family_of_reference = table.reference_family.clone()
            self.family_min_similarity = float(table.min_similarity)
        self._build_request_table(fallback, budget_table)
        if fallback is None or not self.has_fallback:
            self.register_buffer("grid_midpoints", torch.zeros(0, dtype=torch.float64))
            self.register_buffer("use_controller", torch.ones(1, dtype=torch.bool))
            self.register_buffer("family_table_at", torch.ones(1, dtype=torch.bool))
            self.register_buffer("table_thresholds", torch.zeros(1, 0))
            self.register_buffer("table_choices", torch.zeros(1, 1, dtype=torch.long))
            self.table_tolerance = 0.0
            return
        grid = torch.tensor(fallback.grid_ms, dtype=torch.float64)
        # the nearest grid point (the lower one on a tie) is the number of midpoints below the budget
        self.register_buffer("grid_midpoints", (grid[:-1] + grid[1:]) / 2)
        self.register_buffer("use_controller", torch.tensor(fallback.use_controller, dtype=torch.bool))
        # per grid point: the families' tables answer (True) or the global one (False)
        family_at = fallback.family_table_at or [True] * len(fallback.grid_ms)
        self.register_buffer("family_table_at", torch.tensor(family_at, dtype=torch.bool))
        tables = [budget_table]
        if self.num_groups:
            # row 0: the global table; row j + 1: family j's
            tables += [table.tables.table_for(family) for family in table.families]
        thresholds, choices = table_rows([table_steps(t) for t in tables])
        self.register_buffer("table_thresholds", thresholds)
        self.register_buffer("table_choices", choices)
        self.table_tolerance = float(budget_table.tolerance)

    def _build_request_table(self, fallback: TableFallback | None, budget_table: LookupTableDecider | None) -> None:
        """The fallback's per-request table: its cost model (a submodule, what ``expected_latency`` reads and
        a server's guard holds a request to) and its score cells (read where it answers at some budget,
        ``has_request_table``). Without one, a cost model without coefficients (a TorchScript module keeps
        one type per attribute) that answers every request with the budget table's median and latency
        statistic of the configuration (NaN without a table)."""
        request = None if fallback is None else fallback.request_decider()
        if request is not None and [tuple(a) for a in self.actions.tolist()] != list(request.action_space.actions):
            warnings.warn("the per-request table was fitted on another action space than the controller's; the "
                          "export leaves it out", stacklevel=3)
            request = None
        self.has_cost_model = request is not None
        self.has_request_table = (request is not None and self.has_fallback and fallback.request_table_at is not None
                                  and any(fallback.request_table_at))
        if request is None:
            space = ActionSpace(tuple(tuple(a) for a in self.actions.tolist()))
            self.request_cost = RequestCostModel(space, RequestCostConfig(), self.lang_dim, 1,
                                                 max(space.max_crops_values))
            self.request_cost.coef.fill_(math.nan)  # no request's own cost: every row on the profile's basis
            spread = (self.reference_latency_ms.float() if self.reference_latency_ms.numel()
                      else torch.full((len(self.actions),), math.nan))
            self.request_cost.profile_median_ms.copy_(spread)
            if budget_table is not None:
                stat = dict(zip(budget_table.action_space.actions, budget_table.latency_stat_ms.tolist()))
                spread = torch.tensor([stat.get(tuple(a), math.nan) for a in self.actions.tolist()])
            self.request_cost.profile_quantile_ms.copy_(spread)
            self.register_buffer("request_cells", torch.zeros(1, 1, 1))
            self.register_buffer("request_by_action", torch.zeros(1, len(self.actions)))
            self.register_buffer("request_table_at", torch.zeros(1, dtype=torch.bool))
            return
        self.request_cost = request.model
        self.register_buffer("request_cells", request.scores.cells.clone())
        self.register_buffer("request_by_action", request.scores.by_action.clone())
        at = fallback.request_table_at if self.has_request_table else [False] * len(fallback.grid_ms)
        self.register_buffer("request_table_at", torch.tensor(at, dtype=torch.bool))

    # -- pieces, written for TorchScript (no Python containers of modules, explicit types); weight
    # matrices are stored transposed, (in, out), for addmm: F.linear would transpose them per call
    def _layer_norm(self, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return F.layer_norm(x, [x.shape[-1]], w, b, self.eps)

    def _stage1_features(self, lang: Tensor, budget_ms: Tensor, tiling_crops: Tensor | None,
                         prompt_tokens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What both stages read: the projected language features (B, H), the budget encoding (B, Hb),
        the standardised tiling (B, C) (0 where unknown) and the tiling-known flag (B, 1). A network that
        reads the request cost model adds its input: the log of each configuration's predicted median."""
        n = lang.shape[0]
        lang_pre = torch.addmm(self.lang_b, lang.float(), self.lang_w)
        if self.reads_request_cost:
            tiling_in, prompt_in = self._request_inputs(lang, tiling_crops, prompt_tokens)
            median = self.network_cost(lang.float(), tiling_in, prompt_in)[0]
            logs = torch.log(median.clamp(min=1.0))
            logs = torch.where(torch.isnan(logs), self.cost_center.expand_as(logs), logs)  # unknown: standardised 0
            lang_pre = torch.addmm(lang_pre, logs, self.cost_w)
        lang_h = F.relu(self._layer_norm(lang_pre, self.lang_ln_w, self.lang_ln_b))
        position = ((budget_ms.float() - self.budget_min_ms) / (self.budget_max_ms - self.budget_min_ms)).clamp(0, 1)
        angles = position.unsqueeze(1) * self.frequencies
        enc = torch.cat([angles.sin(), angles.cos()], dim=-1)
        x = self._layer_norm(torch.addmm(self.b1_b, enc, self.b1_w), self.b1_ln_w, self.b1_ln_b)
        # 2 GELU(x) = x (1 + erf(x / sqrt 2)): on a small row aten's gelu costs as much as five such ops
        x = (x * 0.7071067811865476).erf_().add_(1.0).mul_(x)
        budget_h = self._layer_norm(torch.addmm(self.b2_b, x, self.b2_w), self.b2_ln_w, self.b2_ln_b)
        if self.uses_tilings and tiling_crops is not None:
            t = tiling_crops.float()
            known = (~torch.isnan(t).any(-1, keepdim=True)).float()
            tiling = torch.nan_to_num((torch.log1p(t) - self.tiling_mean) / self.tiling_std, nan=0.0)
        else:
            known = lang.new_zeros((n, 1), dtype=torch.float32)
            tiling = lang.new_zeros((n, self.num_crops_values), dtype=torch.float32)
        return lang_h, budget_h, tiling, known

    def _crops_logits(self, lang_h: Tensor, budget_h: Tensor, tiling: Tensor, known: Tensor) -> Tensor:
        """Stage 1: log p1(crops) up to a per-row constant, (B, C)."""
        if self.uses_tilings:
            fused_in = torch.cat([lang_h, budget_h, tiling, known], dim=-1)
        else:
            fused_in = torch.cat([lang_h, budget_h], dim=-1)
        fused = F.relu(self._layer_norm(torch.addmm(self.fuse_b, fused_in, self.fuse_w), self.fuse_ln_w,
                                        self.fuse_ln_b))
        crops_hidden = torch.addmm(self.crops1_b, fused, self.crops1_w).relu_()
        return torch.addmm(self.crops2_b, crops_hidden, self.crops2_w)

    def _stage2_context(self, lang_h: Tensor, budget_h: Tensor, image: Tensor, image_present: Tensor) -> Tensor:
        """The stage-2 fusion's context part, the same for every crops choice, (B, H)."""
        present = image_present.float().unsqueeze(1)
        image_pre = self.image_b + present * torch.addmm(self.image_c, image.float(), self.image_w)
        image_h = F.relu(self._layer_norm(image_pre, self.image_ln_w, self.image_ln_b))
        return torch.addmm(self.context_b, torch.cat([lang_h, image_h, budget_h], dim=-1), self.context_w)

    def _stage2_heads(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Stage-2 hidden states (R, H) before their norm -> top_k and blocks logits (R, K), (R, Bk)."""
        hidden = F.relu(self._layer_norm(hidden, self.s2_ln_w, self.s2_ln_b))
        heads = torch.addmm(self.heads2_b, torch.addmm(self.heads1_b, hidden, self.heads1_w).relu_(), self.heads2_w)
        return heads.narrow(1, 0, self.num_top_k), heads.narrow(1, self.num_top_k, self.num_blocks)

    def _stage2_action(self, context: Tensor, tiling: Tensor, crops: Tensor) -> Tensor:
        """Stage 2 at the crops columns ``crops`` (B,): the greedy action index (B,) among their actions."""
        hidden = context + self.choice.index_select(0, crops)
        if self.uses_tilings:
            hidden = torch.addcmul(hidden, tiling.gather(1, crops.unsqueeze(1)), self.choice_tiling_w)
        top_k, blocks = self._stage2_heads(hidden)
        if self.full_product:  # every (top_k, blocks) pair is an action: the best of each head
            return (crops * self.num_top_k + top_k.argmax(-1)) * self.num_blocks + blocks.argmax(-1)
        candidates = self.action_crops.unsqueeze(0) == crops.unsqueeze(1)
        return greedy_within_crops(top_k, blocks, self.action_top_k, self.action_blocks, candidates)

    def _network_crops(self, lang: Tensor, budget_ms: Tensor, tiling_crops: Tensor | None,
                       prompt_tokens: Tensor | None = None) -> Tensor:
        """The network's stage-1 choice, (B,) crops columns. Every crops value of the space has an action
        (the values are read off the actions), so the argmax ranges over all of them."""
        lang_h, budget_h, tiling, known = self._stage1_features(lang, budget_ms, tiling_crops, prompt_tokens)
        return greedy_crops(self._crops_logits(lang_h, budget_h, tiling, known))

    def _network_stage2(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
                        tiling_crops: Tensor | None, crops: Tensor, prompt_tokens: Tensor | None = None) -> Tensor:
        """The network's stage-2 choice at the crops columns ``crops``, (B,) action indices."""
        lang_h, budget_h, tiling, _ = self._stage1_features(lang, budget_ms, tiling_crops, prompt_tokens)
        return self._stage2_action(self._stage2_context(lang_h, budget_h, image, image_present), tiling, crops)

    def _network_actions(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
                         tiling_crops: Tensor | None, prompt_tokens: Tensor | None = None) -> Tensor:
        """Both stages of the network in one pass (the features stage 1 computes serve stage 2), (B,) actions."""
        lang_h, budget_h, tiling, known = self._stage1_features(lang, budget_ms, tiling_crops, prompt_tokens)
        crops = greedy_crops(self._crops_logits(lang_h, budget_h, tiling, known))
        return self._stage2_action(self._stage2_context(lang_h, budget_h, image, image_present), tiling, crops)

    def _network_scores(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
                        tiling_crops: Tensor | None, prompt_tokens: Tensor | None = None) -> Tensor:
        """Per action, the joint log-probability up to a per-row constant (B, A)."""
        n = lang.shape[0]
        lang_h, budget_h, tiling, known = self._stage1_features(lang, budget_ms, tiling_crops, prompt_tokens)
        crops_logits = self._crops_logits(lang_h, budget_h, tiling, known)
        hidden = self._stage2_context(lang_h, budget_h, image, image_present).unsqueeze(1) + self.choice
        if self.uses_tilings:
            hidden = torch.addcmul(hidden, tiling.unsqueeze(2), self.choice_tiling_w)
        top_k, blocks = self._stage2_heads(hidden.flatten(0, 1))
        top_k = top_k.log_softmax(-1).view(n, self.num_crops_values, -1)  # (B, C, K)
        blocks = blocks.log_softmax(-1).view(n, self.num_crops_values, -1)  # (B, C, Bk)
        if self.full_product:
            return (crops_logits.view(n, -1, 1, 1) + top_k.unsqueeze(3) + blocks.unsqueeze(2)).flatten(1)
        return (crops_logits.index_select(1, self.crops_index)
                + top_k.flatten(1).index_select(1, self.top_k_index)
                + blocks.flatten(1).index_select(1, self.blocks_index))

    def _request_inputs(self, lang: Tensor, tiling_crops: Tensor | None,
                        prompt_tokens: Tensor | None) -> tuple[Tensor, Tensor]:
        """The tilings (B, C) and prompt lengths (B,) the cost model reads, NaN where not given."""
        n = lang.shape[0]
        tiling = (torch.full((n, self.num_crops_values), float("nan"), device=lang.device) if tiling_crops is None
                  else tiling_crops.float())
        prompt = (torch.full((n,), float("nan"), device=lang.device) if prompt_tokens is None
                  else prompt_tokens.float())
        return tiling, prompt

    def _request_choice(self, lang: Tensor, budget_ms: Tensor, tiling_crops: Tensor | None,
                        prompt_tokens: Tensor | None) -> Tensor:
        """The per-request table's action (B,): the highest expected score whose predicted quantile fits."""
        tiling, prompt = self._request_inputs(lang, tiling_crops, prompt_tokens)
        median, quantile, _, _ = self.request_cost(lang, tiling, prompt)
        crops = tiling.index_select(1, self.request_cost.crops_column)
        cluster = question_clusters(lang, self.request_cost.centres)
        score = lookup_cells(self.request_cells, self.request_by_action, cluster, self.request_cost.group, crops)
        return request_table_choice(median, quantile, score, budget_ms)

    @torch.jit.export
    def expected_latency(self, lang: Tensor, tiling_crops: Tensor | None = None,
                         prompt_tokens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per request and action (B, A): the cost model's predicted median and quantile latency (ms, in the
        profile's units), True where the request's own tiling answered (False: its configuration's
        spread over the profile), and True where its crops or prompt lie beyond what the fit saw (the
        prediction extrapolated along the fitted line). Without a cost model, the configuration's spread
        everywhere and nothing extrapolated."""
        tiling, prompt = self._request_inputs(lang, tiling_crops, prompt_tokens)
        median, quantile, basis, extrapolated = self.request_cost(lang, tiling, prompt)
        if not self.has_cost_model:
            basis = torch.zeros_like(basis)
            extrapolated = torch.zeros_like(extrapolated)
        return median, quantile, basis, extrapolated

    def _table_choice(self, lang: Tensor, budget_ms: Tensor, tiling_crops: Tensor | None = None,
                      prompt_tokens: Tensor | None = None, branch_free: bool = False) -> Tensor:
        """The fallback table's action (B,): the global table's, or the table of the family each
        question reads as where the families answer at this budget, or the per-request table's where
        it answers at this budget."""
        row = torch.zeros(budget_ms.shape[0], dtype=torch.long, device=budget_ms.device)
        if self.num_groups > 0:
            nearest = torch.searchsorted(self.grid_midpoints, budget_ms.double(), right=False)
            families = self.family_table_at.index_select(0, nearest)
            group = self.question_group(lang)
            row = torch.where(families & (group >= 0), 1 + group, row)
        # the thresholds at or below the budget, counted per row (the padding is +inf)
        scaled = budget_ms.float() * (1.0 + self.table_tolerance)
        steps = (self.table_thresholds.index_select(0, row) <= scaled[:, None]).sum(1, keepdim=True)
        choice = self.table_choices.index_select(0, row).gather(1, steps).squeeze(1)
        if self.has_request_table:
            nearest = torch.searchsorted(self.grid_midpoints, budget_ms.double(), right=False)
            at = self.request_table_at.index_select(0, nearest)
            if branch_free or bool(at.any()):
                choice = torch.where(at, self._request_choice(lang, budget_ms, tiling_crops, prompt_tokens), choice)
        return choice

    @torch.jit.export
    def question_group(self, lang: Tensor) -> Tensor:
        """(B,) int64: the question family or cluster each row reads as, an index into the lines of
        ``group_names_text``; -1 for every row where the fallback's table has none, and for a question
        unlike every reference (the table's global choice answers it)."""
        if self.num_groups == 0:
            return torch.full((lang.shape[0],), -1, dtype=torch.long, device=lang.device)
        group = nearest_family(lang, self.family_references, self.family_of_reference, self.num_groups,
                               self.family_neighbours)
        familiar = closest_similarity(lang, self.family_references) >= self.family_min_similarity
        return torch.where(familiar, group, torch.full_like(group, -1))

    def group_names(self) -> list[str]:
        """The names :meth:`question_group` indexes (a family's label, a cluster's leading words)."""
        return group_names_of(self)

    def _use_network(self, lang: Tensor, budget_ms: Tensor) -> Tensor:
        nearest = torch.searchsorted(self.grid_midpoints, budget_ms.double(), right=False)
        use = self.use_controller.index_select(0, nearest)
        if self.guards_network:
            use = use & (closest_similarity(lang, self.family_references) >= self.family_min_similarity)
        return use

    def _crops_columns(self, max_crops: Tensor) -> Tensor:
        """``max_crops`` values (B,) -> their columns in ``max_crops_values``; an error for any other value."""
        columns = self.crops_column.index_select(0, max_crops.long().clamp(0, self.crops_column.shape[0] - 1))
        if columns.numel() > 0 and int(columns.min()) < 0:
            bad = int(max_crops.masked_select(columns < 0)[0])
            raise ValueError("max_crops " + str(bad) + " is not in the controller's action space (max_crops values "
                             + self.max_crops_text + "): pass the value stage1 returned")
        return columns

    @torch.jit.export
    def network_decides(self, budget_ms: Tensor, lang: Tensor | None = None) -> Tensor:
        """(B,) bool: True where the network decides at this budget (and, with ``lang``, for this question),
        False where the table fallback does. Without ``lang`` the budget alone: a question unlike every
        training question goes to the table even where this says True."""
        if not self.has_fallback:
            return torch.ones(budget_ms.shape[0], dtype=torch.bool, device=budget_ms.device)
        if lang is None:
            nearest = torch.searchsorted(self.grid_midpoints, budget_ms.double(), right=False)
            return self.use_controller.index_select(0, nearest)
        return self._use_network(lang, budget_ms)

    def decide_actions(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
                       tiling_crops: Tensor | None = None,
                       prompt_tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B,) action indices of :meth:`decide` and (B,) bool: True where the network decided, False
        where the table did."""
        if not self.has_fallback:
            return (self._network_actions(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens),
                    torch.ones(lang.shape[0], dtype=torch.bool, device=lang.device))
        use = self._use_network(lang, budget_ms)
        if bool(use.all()):
            return self._network_actions(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens), use
        table = self._table_choice(lang, budget_ms, tiling_crops, prompt_tokens)
        if not bool(use.any()):
            return table, use
        network = self._network_actions(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens)
        return torch.where(use, network, table), use

    @torch.jit.export
    def stage1(self, lang: Tensor, budget_ms: Tensor, tiling_crops: Tensor | None = None,
               prompt_tokens: Tensor | None = None) -> Tensor:
        """Stage 1, before the vision tower: ``max_crops`` (B,) int64. ``prompt_tokens`` (B,) float, optional:
        the text tokens of each formatted prompt (NaN = unknown), read by a per-request table and by a network
        that reads the request cost model (``reads_prompt_tokens``)."""
        if not self.has_fallback:
            crops = self._network_crops(lang, budget_ms, tiling_crops, prompt_tokens)
            return self.max_crops_values.index_select(0, crops)
        use = self._use_network(lang, budget_ms)
        if bool(use.all()):
            crops = self._network_crops(lang, budget_ms, tiling_crops, prompt_tokens)
            return self.max_crops_values.index_select(0, crops)
        table = self.actions.index_select(0, self._table_choice(lang, budget_ms, tiling_crops,
                                                                prompt_tokens)).select(1, 0)
        if not bool(use.any()):
            return table
        network = self.max_crops_values.index_select(0, self._network_crops(lang, budget_ms, tiling_crops,
                                                                             prompt_tokens))
        return torch.where(use, network, table)

    @torch.jit.export
    def stage2(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor, max_crops: Tensor,
               tiling_crops: Tensor | None = None, prompt_tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Stage 2, after the vision pass at ``max_crops`` (stage 1's result): ``(top_k, num_active_blocks)``,
        two (B,) int64. Raises for a ``max_crops`` value that is not in the action space."""
        crops = self._crops_columns(max_crops)
        if not self.has_fallback:
            action = self._network_stage2(lang, image, image_present, budget_ms, tiling_crops, crops, prompt_tokens)
        else:
            use = self._use_network(lang, budget_ms)
            if bool(use.all()):
                action = self._network_stage2(lang, image, image_present, budget_ms, tiling_crops, crops, prompt_tokens)
            else:
                action = self._table_choice(lang, budget_ms, tiling_crops, prompt_tokens)
                if bool(use.any()):
                    network = self._network_stage2(lang, image, image_present, budget_ms, tiling_crops, crops,
                                                   prompt_tokens)
                    action = torch.where(use, network, action)
        knobs = self.actions.index_select(0, action)
        return knobs.select(1, 1), knobs.select(1, 2)

    def forward(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
                tiling_crops: Tensor | None = None,
                prompt_tokens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        action, _ = self.decide_actions(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens)
        max_crops, top_k, num_active_blocks = self.actions.index_select(0, action).unbind(1)
        return max_crops, top_k, num_active_blocks

    @torch.jit.export
    def decide(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
               tiling_crops: Tensor | None = None,
               prompt_tokens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``stage1`` and then ``stage2`` at its crops, in one call (the same as calling the module)."""
        return self.forward(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens)

    @torch.jit.export
    def probabilities(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
                      tiling_crops: Tensor | None = None, prompt_tokens: Tensor | None = None) -> Tensor:
        """pi(a | x, budget) of the network over the action space (B, A), ignoring the fallback: the
        policy's joint distribution (the decision is its sequential greedy choice, not its mode)."""
        scores = self._network_scores(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens)
        return scores.softmax(-1)


def cost_basis(own_cost: bool, extrapolated: bool) -> str:
    """What a cost-model prediction rests on, as a record names it: ``request`` (this request's own tiling,
    prompt length and question, within what the fit saw), ``extrapolated`` (its own, with crops or a
    prompt beyond the fit's range: read along the fitted line) or ``configuration`` (the configuration's
    spread over the profile: no tiling known, or no cost model deployed)."""
    if not own_cost:
        return "configuration"
    return "extrapolated" if extrapolated else "request"


def group_names_of(module: Any) -> list[str]:
    """The question-group names of a deployed controller: a :class:`DeployedController` or the
    TorchScript module ``ctrl export`` wrote (which keeps them as ``group_names_text``)."""
    text = str(getattr(module, "group_names_text", ""))
    return text.split("\n") if text else []


def step_lookup(thresholds: Tensor, choices: Tensor, budget_ms: Tensor, tolerance: float) -> Tensor:
    """``choices[i]`` where ``i`` counts the thresholds at or below ``budget_ms * (1 + tolerance)`` (float32,
    as the table compares)."""
    steps = torch.searchsorted(thresholds, budget_ms.float() * (1.0 + tolerance), right=True)
    return choices.index_select(0, steps)


def table_rows(steps: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Several tables' steps (:func:`table_steps`) as rows of two tensors: thresholds (R, T), padded
    with +inf, and choices (R, T + 1), padded with each row's last choice; row r's choice for a
    budget is ``choices[r, number of thresholds[r] at or below it]``."""
    width = max(len(thresholds) for thresholds, _ in steps)
    thresholds = torch.full((len(steps), width), math.inf)
    choices = torch.zeros(len(steps), width + 1, dtype=torch.long)
    for r, (t, c) in enumerate(steps):
        thresholds[r, :len(t)] = t
        choices[r] = c[-1]
        choices[r, :len(c)] = c
    return thresholds, choices


def table_steps(table: LookupTableDecider) -> tuple[Tensor, Tensor]:
    """The table's choice as a step function of the budget: (sorted thresholds (T,), choices (T + 1,)).

    ``step_lookup(thresholds, choices, budget, table.tolerance)`` equals ``table.choose(budget)``: the
    set of configurations that fit grows only where the budget
    reaches another configuration's latency statistic."""
    stat = table.latency_stat_ms.float()
    seen = ~torch.isnan(stat)
    thresholds = torch.unique(stat[seen])  # sorted ascending
    score = table.mean_score.float()
    choices = []
    for j in range(len(thresholds) + 1):
        fits = (seen & (stat <= thresholds[j - 1])) if j else torch.zeros_like(seen)
        best, found = best_candidate(fits[None, :], score[None, :], stat[None, :])
        if not bool(found[0]):  # nothing fits: the lowest statistic
            best, _ = best_candidate(seen[None, :], -torch.nan_to_num(stat, nan=1e30)[None, :],
                                     torch.zeros_like(stat)[None, :])
        choices.append(int(best[0]))
    return thresholds.contiguous(), torch.tensor(choices, dtype=torch.long)


def save_deployed(module: DeployedController, path: Path) -> Path:
    """Write ``module`` as a TorchScript file (atomic) that ``torch.jit.load`` reads with torch alone."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # torch 2.13 marks TorchScript deprecated; it is still the fastest loader of a small module (docs/export.md)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(module), buffer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, buffer.getvalue())
    return path


def load_deployed(path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location="cpu")



class _BranchFree(nn.Module):
    """The decision without data-dependent branches, for ``torch.export``: the network and the table
    both run and ``where`` picks (compiled, the network costs little more than the branch did). Its
    ``forward`` takes exactly the inputs the package is called with (an optional input left at its
    default would still be counted as one): :class:`_BranchFreeTiled` and :class:`_BranchFreeRequest`
    take the tilings, and the prompts' lengths too."""

    def __init__(self, deployed: DeployedController) -> None:
        super().__init__()
        self.deployed = deployed

    def decide(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
               tiling_crops: Tensor | None, prompt_tokens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        d = self.deployed
        action = d._network_actions(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens)
        if d.has_fallback:
            table = d._table_choice(lang, budget_ms, tiling_crops, prompt_tokens, branch_free=True)
            action = torch.where(d._use_network(lang, budget_ms), action, table)
        max_crops, top_k, num_active_blocks = d.actions.index_select(0, action).unbind(1)
        return max_crops, top_k, num_active_blocks

    def forward(self, lang: Tensor, image: Tensor, image_present: Tensor,
                budget_ms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.decide(lang, image, image_present, budget_ms, None, None)


class _BranchFreeTiled(_BranchFree):
    def forward(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor,
                tiling_crops: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.decide(lang, image, image_present, budget_ms, tiling_crops, None)


class _BranchFreeRequest(_BranchFree):
    def forward(self, lang: Tensor, image: Tensor, image_present: Tensor, budget_ms: Tensor, tiling_crops: Tensor,
                prompt_tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.decide(lang, image, image_present, budget_ms, tiling_crops, prompt_tokens)


# Inductor's own C++ matrix products rather than calls into aten, whose per-call cost exceeds a batch-1
# product's arithmetic (docs/export.md); aten where a CPU has no C++ template. Autotuning against aten
# too would double the compile for the same choice. Precompiled headers pay off over many compiles only.
COMPILE_OPTIONS = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "CPP", "autotune_fallback_to_aten": True,
                   "aot_inductor.precompile_headers": False}
CUDA_COMPILE_OPTIONS = {"aot_inductor.precompile_headers": False}


def compile_device(device: str) -> torch.device:
    """The device a compiled package is built for: cpu, or cuda[:N] where CUDA is available."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        msg = f"--device {device}: not a device to compile the controller for\nHint: cpu, cuda or cuda:N."
        raise CtrlError(msg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        msg = f"--device {device}: CUDA is not available here\nHint: compile on the GPU machine, or leave --device out."
        raise CtrlError(msg)
    return dev


def save_compiled(module: DeployedController, path: Path, device: str = "cpu") -> Path:
    """Write ``module`` compiled ahead of time (AOTInductor, for this kind of CPU, or for CUDA with
    ``device="cuda"``) as a ``.pt2`` package that ``torch._inductor.aoti_load_package`` reads with
    torch alone (atomic). The package runs on the device it was compiled for.

    The batch size stays free; a run trained with tilings, or deployed with a per-request table, takes
    ``tiling_crops`` as a fifth, required input (NaN = unknown), and with a per-request table or a network
    that reads the request cost model ``prompt_tokens`` (B,) as a sixth. Compiling needs a C++ compiler and
    takes a minute or two.
    """
    from torch._inductor import aoti_compile_and_package

    dev = compile_device(device)
    module = module.eval().to(dev)
    n = 2  # an example batch of 1 would fix the batch size at 1
    example = (torch.zeros(n, module.lang_dim), torch.zeros(n, module.image_dim), torch.ones(n, dtype=torch.bool),
               torch.full((n,), module.budget_min_ms))
    if module.uses_tilings or module.reads_prompt_tokens:
        example = (*example, torch.ones(n, module.num_crops_values))
    if module.reads_prompt_tokens:
        example = (*example, torch.full((n,), 16.0))
    example = tuple(t.to(dev) for t in example)
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        msg = (f"{path}: no C++ compiler to compile the controller with (CXX, c++, g++, clang++)\n"
               "Hint: install g++ or clang, or export without --compiled (TorchScript needs none).")
        raise CtrlError(msg)
    batch = torch.export.Dim("batch", min=1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.pt2")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torch's own: export meets the TorchScript decorators, inductor uses deprecated pytree calls
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)  # the autotuner's
            wrapper = {4: _BranchFree, 5: _BranchFreeTiled, 6: _BranchFreeRequest}[len(example)](module)
            program = torch.export.export(wrapper, example,
                                          dynamic_shapes=tuple({0: batch} for _ in example))
            aoti_compile_and_package(program, package_path=str(tmp),
                                     inductor_configs=COMPILE_OPTIONS if dev.type == "cpu" else CUDA_COMPILE_OPTIONS)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_compiled(path: Path) -> Any:
    """The package :func:`save_compiled` wrote, callable as ``(lang, image, image_present, budget_ms[,
    tiling_crops[, prompt_tokens]])``; ``.loader.boxed_run([...])`` skips the wrapper's per-call argument parsing."""
    from torch._inductor import aoti_load_package

    return aoti_load_package(str(path))


@dataclass
class ExportReport:
    """What ``ctrl export`` wrote: the file, its size, and what a caller needs to know to call it."""

    path: Path
    size_bytes: int
    checkpoint: Path
    model_fingerprint: str
    lang_feature_dim: int
    image_feature_dim: int
    max_crops_values: tuple[int, ...]
    num_actions: int
    uses_tilings: bool
    fallback_budgets_ms: list[float]
    compiled: bool = False
    uses_prompt_tokens: bool = False  # a per-request table answers at some budget, or the network reads the cost model
    has_cost_model: bool = False  # expected_latency predicts each request's own cost


def export_controller(workspace: Workspace | str | Path | None, run_or_checkpoint: str | Path,
                      out: str | Path, compiled: bool = False, device: str = "cpu",
                      force: bool = False) -> ExportReport:
    """Write the deployed controller of an offline run (a run id, ``latest``, a run directory or a
    checkpoint file) as a TorchScript file that ``torch.jit.load`` reads with torch alone, or with
    ``compiled`` as an AOTInductor package (:func:`save_compiled`). An existing ``out`` is replaced
    only with ``force``."""
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    out = Path(out)
    if ws.owns(out):
        msg = (f"{out}: refusing to write the exported controller over the workspace's own files\n"
               f"Hint: write it outside the workspace's tables, features, fragments and runs ({ws.root}).")
        raise CtrlError(msg)
    if out.is_dir():
        msg = f"{out}: is a directory\nHint: --out FILE, e.g. controller.pt"
        raise CtrlError(msg)
    if (out.exists() or out.is_symlink()) and not force:
        msg = f"{out}: exists; refusing to replace it\nHint: add --force to replace it, or pick another --out."
        raise CtrlError(msg)
    if not compiled and device != "cpu":
        msg = (f"--device {device}: only a compiled package is built for a device\n"
               f"Hint: add --compiled, or load the TorchScript file with "
               f"torch.jit.load(FILE, map_location={device!r}).")
        raise CtrlError(msg)
    if compiled:
        compile_device(device)  # before the checkpoint is read: a bad device fails at once
    checkpoint = resolve_checkpoint(ws, run_or_checkpoint)
    policy = ControllerPolicy.load(checkpoint, offline_only=True)
    fallback = read_fallback(checkpoint)
    module = DeployedController(policy, fallback).eval()
    if compiled:
        save_compiled(module, out, device)
    else:
        save_deployed(module, out)
    return ExportReport(path=out, size_bytes=out.stat().st_size, checkpoint=checkpoint,
                        model_fingerprint=module.model_fingerprint, lang_feature_dim=module.lang_dim,
                        image_feature_dim=module.image_dim,
                        max_crops_values=tuple(policy.action_space.max_crops_values),
                        num_actions=len(policy.action_space.actions), uses_tilings=module.uses_tilings,
                        fallback_budgets_ms=[] if fallback is None else fallback.fallback_budgets_ms,
                        compiled=compiled, uses_prompt_tokens=module.reads_prompt_tokens,
                        has_cost_model=module.has_cost_model)
