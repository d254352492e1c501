"""The online two-stage controller (``docs/origin_format.md`` §7.3): the offline policy plus what
only the real model can feed it.

Stage 1 runs before the vision tower on the language features and the budget: the offline
crops head, plus an **insertion position** head (p in 1..5: stage 2 runs after the first p
decoder blocks). The same stage also turns the budget encoding into one **budget token** of
the decoder's width, which is appended to the prompt at prefill only.

Stage 2 runs inside the prefill, after block p-1: it reads the **latency token**, the hidden
state of that appended last position (it has attended to the image, the prompt and the
budget), on top of the offline stage-2 trunk, and picks top-K (for blocks p..15) and the
total block count among the options that position p allows (§2.3,
``pipeline.knobs.insertion_block_options``). The factorisation::

    log pi = log p(crops | lang, b) + log p(p | lang, b)
           + log p(top_k | x, crops, p, h_p) + log p(blocks | x, crops, p, h_p)

The new stage-2 terms (latency-token projection, insertion embedding) start at zero, so a
controller continued from an offline run behaves exactly like it at step 0; the budget token
is trained through the frozen decoder blocks 0..p-1 (``ModelRuntime.latency_token``), so both
stages learn from the one shared reward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import knobs
from pipeline.errors import CtrlError
from trainer.policy import ControllerPolicy, PolicyConfig, apply_sequential, mlp_head, read_checkpoint

TWO_STAGE_FORMAT = 1
#: initial logit of insertion position 1 (the others start at ~0): softmax gives it ~0.65 of 5
INITIAL_P1_LOGIT = 2.0


@dataclass(frozen=True)
class TwoStageConfig:
    """What the online modules need besides the offline policy (saved in the checkpoint).

    hidden_size: the decoder's width d (the budget token's and latency token's size).
    token_scale: RMS the budget token is scaled to (the input-embedding table's RMS, so the
        extra token looks like an ordinary input embedding to block 0).
    num_layers: decoder blocks of the model (insertion options depend on it).
    insertion_positions: the insertion positions stage 1 chooses from (default 1..5).
    fixed_insertion_position: a position stage 1 always picks instead of asking its head (None:
        the head chooses). An offline policy deployed as is runs at position 1, where its top-K
        applies to every block as in the recorded profile.
    """

    hidden_size: int
    token_scale: float
    num_layers: int = knobs.NUM_TOTAL_BLOCKS
    insertion_positions: tuple[int, ...] = knobs.INSERTION_POSITIONS
    fixed_insertion_position: int | None = None


@dataclass
class Stage1Output:
    """Stage 1 for N requests: log-probs over crops (N, C) and insertion positions (N, P), the
    budget token (N, d) and the hidden states stage 2 reuses."""

    crops_log_probs: Tensor
    insertion_log_probs: Tensor
    budget_token: Tensor
    lang_h: Tensor
    budget_h: Tensor
    tiling_crops: Tensor | None = None


class TwoStageController(nn.Module):
    """:class:`ControllerPolicy` + insertion head + budget token + latency-token stage 2."""

    def __init__(self, policy: ControllerPolicy, config: TwoStageConfig) -> None:
        super().__init__()
        self.policy = policy
        self.two_stage = config
        h, hb, d = policy.config.hidden_dim, policy.config.budget_hidden_dim, config.hidden_size
        positions = tuple(int(p) for p in config.insertion_positions)
        blocks_values = policy.action_space.num_active_blocks_values
        valid = torch.tensor([[b in knobs.insertion_block_options(p, config.num_layers) for b in blocks_values]
                              for p in positions], dtype=torch.bool)
        if not valid.any():
            msg = (f"no block count of the action space {list(blocks_values)} is allowed after any insertion "
                   f"position {list(positions)} (options: "
                   f"{[knobs.insertion_block_options(p, config.num_layers) for p in positions]})")
            raise CtrlError(msg)
        self.register_buffer("blocks_valid", valid, persistent=False)  # (P, B)
        insertion_valid = valid.any(-1)
        if config.fixed_insertion_position is not None:
            fixed = config.fixed_insertion_position
            if fixed not in positions or not bool(insertion_valid[positions.index(fixed)]):
                msg = (f"fixed insertion position {fixed}: not one of the positions {list(positions)} that allow a "
                       "block count of the action space")
                raise CtrlError(msg)
            insertion_valid = torch.tensor([p == fixed for p in positions])
        self.register_buffer("insertion_valid", insertion_valid, persistent=False)  # (P,)
        self.insertion_head = mlp_head(h + hb, h, len(positions))
        self.budget_token_proj = nn.Linear(hb, d)
        self.latency_norm = nn.LayerNorm(d)
        self.latency_proj = nn.Linear(d, h)
        self.insertion_embedding = nn.Embedding(len(positions), h)
        with torch.no_grad():  # zero: at step 0 stage 2 equals the offline policy's stage 2
            self.latency_proj.weight.zero_()
            self.latency_proj.bias.zero_()
            self.insertion_embedding.weight.zero_()
            if 1 in positions:
                # start at p = 1 (most probable, ~2/3 with 5 positions), the closest to the offline data,
                # whose top-K applied to every block: the greedy controller at step 0 is the offline policy
                self.insertion_head[-1].bias[positions.index(1)] = INITIAL_P1_LOGIT

    # -- knob values
    @property
    def insertion_positions(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.two_stage.insertion_positions)

    @property
    def max_crops_values(self) -> tuple[int, ...]:
        return self.policy.action_space.max_crops_values

    @property
    def top_k_values(self) -> tuple[int, ...]:
        return self.policy.action_space.top_k_values

    @property
    def num_active_blocks_values(self) -> tuple[int, ...]:
        return self.policy.action_space.num_active_blocks_values

    # -- stages
    def stage1(self, lang: Tensor, budget_ms: Tensor | float, tiling_crops: Tensor | None = None,
               prompt_tokens: Tensor | None = None) -> Stage1Output:
        """``tiling_crops`` (N, C): the crops the image tiles into at each max_crops value (NaN:
        no image); read only by policies trained with ``use_tilings``. ``prompt_tokens`` (N,): each
        prompt's text tokens (NaN: unknown), read only by policies that read a request cost model."""
        crops_lp, lang_h, budget_h = self.policy.stage1(lang, budget_ms, tiling_crops=tiling_crops,
                                                        prompt_tokens=prompt_tokens)
        logits = apply_sequential(self.insertion_head, torch.cat([lang_h, budget_h], dim=-1), self.training)
        insertion_lp = logits.masked_fill(~self.insertion_valid, float("-inf")).log_softmax(-1)
        token = F.layer_norm(self.budget_token_proj(budget_h), (self.two_stage.hidden_size,))
        return Stage1Output(crops_lp, insertion_lp, token * self.two_stage.token_scale, lang_h, budget_h, tiling_crops)

    def stage2(self, s1: Stage1Output, image: Tensor, image_present: Tensor, crops_index: Tensor,
               insertion_index: Tensor, latency_token: Tensor) -> tuple[Tensor, Tensor]:
        """log p(top_k) (N, K) and log p(blocks) (N, B) for N requests with the given stage-1
        choices (indices into the value tuples) and latency tokens (N, d)."""
        trunk = self.policy.stage2_hidden(image, image_present, s1.lang_h, s1.budget_h,
                                          tiling_crops=s1.tiling_crops)  # (N, C, H)
        hidden = trunk[torch.arange(len(crops_index)), crops_index]
        latency = F.linear(self.latency_norm(latency_token.float()), self.latency_proj.weight, self.latency_proj.bias)
        hidden = hidden + latency + self.insertion_embedding(insertion_index)
        top_k_lp, blocks_lp = self.policy.stage2_heads(hidden)
        blocks_lp = blocks_lp.masked_fill(~self.blocks_valid[insertion_index], float("-inf")).log_softmax(-1)
        return top_k_lp, blocks_lp

    def forward(self, batch: RolloutBatch, latency_token_fn: Callable[[Tensor, int], Tensor]) -> Tensor:
        """Log-probabilities (M,) of M executed rollouts, with gradients into every module.

        The latency tokens are recomputed with autograd through the decoder's first p blocks
        (``latency_token_fn(embeds, p)``, once per distinct prefix), so the budget token learns
        from stage 2's reward too. This is the one forward per optimiser step that DDP wraps.
        """
        s1 = self.stage1(batch.lang, batch.budget_ms, batch.tiling_crops, batch.prompt_tokens)
        tokens = []
        for u, embeds in enumerate(batch.prefix_embeds):
            m = int(batch.prefix_first_member[u])
            with_budget = torch.cat([embeds, s1.budget_token[m].to(embeds)[None, None]], dim=1)
            tokens.append(latency_token_fn(with_budget, int(self.insertion_positions[int(batch.insertion_index[m])])))
        latency = torch.stack(tokens)[batch.prefix_of_member].to(batch.lang.device)
        top_k_lp, blocks_lp = self.stage2(s1, batch.image, batch.image_present, batch.crops_index,
                                          batch.insertion_index, latency)
        rows = torch.arange(len(batch.crops_index))
        return (s1.crops_log_probs[rows, batch.crops_index] + s1.insertion_log_probs[rows, batch.insertion_index]
                + top_k_lp[rows, batch.top_k_index] + blocks_lp[rows, batch.blocks_index])

    def with_fixed_insertion(self, position: int) -> TwoStageController:
        """A copy whose stage 1 always picks insertion ``position`` (the rest of it unchanged)."""
        pinned = TwoStageController(copy.deepcopy(self.policy), replace(self.two_stage,
                                                                        fixed_insertion_position=position))
        pinned.load_state_dict(self.state_dict())
        return pinned.to(self.blocks_valid.device).train(self.training)

    # -- checkpoints
    def save(self, path, extra: dict | None = None):
        """A policy checkpoint in the offline layout (:meth:`load` reads that part with
        ``ControllerPolicy.load``) plus the online modules under ``two_stage``, whose presence makes
        ``ctrl predict`` and ``ctrl export`` refuse the file."""
        online = {k: v for k, v in self.state_dict().items() if not k.startswith("policy.")}
        payload = {"two_stage": {"format": TWO_STAGE_FORMAT, "config": asdict(self.two_stage), "state_dict": online}}
        return self.policy.save(path, extra={**payload, **(extra or {})})

    @classmethod
    def load(cls, path, model_fingerprint: str | None = None) -> TwoStageController:
        """Read a two-stage checkpoint (written by :meth:`save`)."""
        payload = read_checkpoint(path)
        if "two_stage" not in payload:
            msg = f"{path}: an offline checkpoint; continue it with `ctrl train --online --from RUN`"
            raise CtrlError(msg)
        policy = ControllerPolicy.load(path, model_fingerprint)
        part = payload["two_stage"]
        saved = part["config"]
        config = TwoStageConfig(**{**saved, "insertion_positions": tuple(saved["insertion_positions"])})
        controller = cls(policy, config)
        controller.load_state_dict({**{f"policy.{k}": v for k, v in policy.state_dict().items()},
                                                          **part["state_dict"]}, strict=True)
        controller.eval()
        return controller


@dataclass
class RolloutBatch:
    """The executed rollouts of one step (M members, U distinct prefixes), as the loss reads them.

    lang (M, Dl), image (M, Di), image_present (M,), budget_ms (M,); knob choices as indices:
    crops_index, insertion_index, top_k_index, blocks_index (M,) long; prefix_embeds: U
    detached decoder-input tensors (1, seq, d) without the budget token; prefix_of_member (M,)
    long into them; prefix_first_member (U,) long: a member of each prefix (its stage-1 inputs
    are those of the whole prefix); tiling_crops (M, C) and prompt_tokens (M,) as in
    :meth:`TwoStageController.stage1`.
    """

    lang: Tensor
    image: Tensor
    image_present: Tensor
    budget_ms: Tensor
    crops_index: Tensor
    insertion_index: Tensor
    top_k_index: Tensor
    blocks_index: Tensor
    prefix_embeds: Sequence[Tensor]
    prefix_of_member: Tensor
    prefix_first_member: Tensor
    tiling_crops: Tensor | None = None
    prompt_tokens: Tensor | None = None


def set_budget_range(policy: ControllerPolicy, min_ms: float, max_ms: float) -> None:
    """Re-normalise the policy's budget encoder over a new range (the online machine's).

    The encoder sees budgets as positions in its range, so an offline policy's notion of a
    tight or loose budget carries over to a machine whose latencies differ in scale.
    """
    if not max_ms > min_ms:
        msg = f"budget range must have max > min, got {min_ms!r}..{max_ms!r}"
        raise CtrlError(msg)
    range_ms = {"budget_min_ms": float(min_ms), "budget_max_ms": float(max_ms)}
    policy.config = PolicyConfig(**{**asdict(policy.config), **range_ms})
    policy.budget_encoder.min_ms, policy.budget_encoder.max_ms = float(min_ms), float(max_ms)
