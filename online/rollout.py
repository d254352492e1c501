"""Executing sampled knob settings on the real model: one request per group member.

A group is one (sample, budget). A member runs the request's way through the model
(``runtime.request``: stage 1, prefix, stage 2, suffix, decode steps, each timed);
``latency_total_ms`` is the sum of those intervals, from the controller's first operation to
the last token: the controller's time counts inside the budget. Image preprocessing (cropping
on the CPU) is outside, as in exp6's T_total.

Members that share (sample, crops, insertion position) share the stage-1 decision, the
prefix and the stage-2 distribution: the prefix depends on nothing else (blocks before the
insertion point keep the default top-K), so it runs once per group and stage-1 choice, and
its measured time is part of each such member's latency.

**Batched rollouts** (``batch_rows`` of :meth:`RolloutExecutor.run_groups`): the prefixes still
run alone and timed; the members then continue from them together, in passes of many rows
(``ModelRuntime.answer_prefixes``), except those timed alone: every member whose top-K the
latency model (``online.latency_model``) is not ready for, and a seeded share
(:data:`TIMED_SHARE`) of the rest, which keep the model checked against hook measurements. A
batched member's suffix and decode steps are the model's (``latency_modeled``), the rest
of its latency measured. Its tokens are the ones batch 1 would give (the batched decoder's
equality, up to near-ties).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from PIL import Image

from controller.latency_guard import GuardGrid, guarded_stage2
from online.data import OnlineSamples
from online.latency_model import MemberShape, SuffixLatencyModel
from pipeline.errors import CtrlError
from runtime.base import ModelInputs, ModelRuntime, PrefixRequest, PrefixState, RowKnobs
from runtime.images import open_image
from runtime.request import Answer, LatencyParts, RequestExecutor
from runtime.scoring import score_answer
from runtime.timing import RequestTiming, Segment, StageTimer, uncaptured_run
from trainer.two_stage import RolloutBatch, Stage1Output, TwoStageController

if TYPE_CHECKING:
    from controller.latency_guard import LatencyGuard

#: of the batched members whose top-K the latency model is ready for, the share still timed alone
TIMED_SHARE = 0.25


def rollout_rows(setting: str, runtime: ModelRuntime) -> int | None:
    """The ``batch_rows`` of :meth:`RolloutExecutor.run_groups` for a ``--rollout-batch`` setting:
    "auto" is as many rows as fit (None) where the runtime batches, which was faster than every
    rollout alone on a CPU as well (docs/results.md, "Batched rollouts"), else 1; N > 1 needs a
    runtime that batches."""
    if setting == "auto":
        return None if runtime.batches else 1
    rows = int(setting)
    if rows > 1 and not runtime.batches:
        msg = (f"--rollout-batch {rows}: the {runtime.kind} runtime does not run batched generation\n"
               "Hint: --rollout-batch 1 runs every rollout alone.")
        raise CtrlError(msg)
    return rows


@dataclass
class Rollout:
    """One executed group member (configuration, answer, score, measured latencies)."""

    group: int
    member: int
    sample: int
    budget_ms: float
    crops_index: int
    insertion_index: int
    top_k_index: int
    blocks_index: int
    max_crops: int
    insertion_position: int
    top_k: int
    num_active_blocks: int
    active_blocks: tuple[int, ...]
    num_crops: int
    num_vision_tokens: int
    num_text_tokens: int
    num_output_tokens: int
    text: str
    pred: str
    score: float
    log_prob: float
    latency_stage1_ms: float
    latency_stage2_ms: float
    latency_vision_ms: float | None
    latency_prefill_ms: float
    latency_decode_ms: float
    decode_step_ms: list[float]
    latency_total_ms: float
    prefix: int
    rank: int
    #: (name, wall_ms, blocks_ms, blocks_calls) per timed segment, in request order
    segments: list[tuple[str, float, float | None, int]] = field(default_factory=list)
    #: suffix and decode-step latencies from the latency model (a batched rollout); False: all timed alone
    latency_modeled: bool = False

    @property
    def latency_controller_ms(self) -> float:
        return self.latency_stage1_ms + self.latency_stage2_ms


@dataclass
class StepRollouts:
    """This rank's rollouts of one step and the prefixes they ran from (for the loss)."""

    rollouts: list[Rollout] = field(default_factory=list)
    prefix_embeds: list[torch.Tensor] = field(default_factory=list)
    prefix_first_member: list[int] = field(default_factory=list)
    controller_s: float = 0.0
    model_s: float = 0.0
    #: the latency model's relative error on each member timed alone it was ready for
    latency_model_errors: list[float] = field(default_factory=list)

    @property
    def modeled(self) -> int:
        return sum(r.latency_modeled for r in self.rollouts)

    def batch(self, samples: OnlineSamples, device: torch.device,
              tiling_crops: torch.Tensor | None = None) -> RolloutBatch:
        """The loss inputs for :meth:`TwoStageController.forward` (``tiling_crops``: (N, C) of all samples)."""
        rows = torch.tensor([r.sample for r in self.rollouts], dtype=torch.long)

        def ints(name: str) -> torch.Tensor:
            return torch.tensor([getattr(r, name) for r in self.rollouts], dtype=torch.long, device=device)

        return RolloutBatch(
            lang=samples.lang[rows].to(device), image=samples.image[rows].to(device),
            image_present=samples.image_present[rows].to(device),
            budget_ms=torch.tensor([r.budget_ms for r in self.rollouts], dtype=torch.float32, device=device),
            crops_index=ints("crops_index"), insertion_index=ints("insertion_index"),
            top_k_index=ints("top_k_index"), blocks_index=ints("blocks_index"),
            prefix_embeds=self.prefix_embeds, prefix_of_member=ints("prefix"),
            prefix_first_member=torch.tensor(self.prefix_first_member, dtype=torch.long, device=device),
            tiling_crops=None if tiling_crops is None else tiling_crops[rows].to(device),
            prompt_tokens=samples.prompt_tokens[rows].float().to(device))


@dataclass(frozen=True)
class Decisions:
    """How :meth:`RolloutExecutor.run_groups` turns the controller's distributions into choices.

    Sampled by default; ``greedy``: the most probable choice at each stage (evaluation);
    ``insertion_index``: a fixed insertion position (an index into the positions); ``force``:
    fixed knob indices (crops, insertion, top-K, blocks), e.g. for the budget calibration;
    ``guard``: with ``greedy``, the configurations each request may choose from
    (``controller.latency_guard``: crops among those with a configuration expected to fit the
    budget, top-K and blocks among those at its crops).
    """

    greedy: bool = False
    insertion_index: int | None = None
    force: tuple[int, int, int, int] | None = None
    guard: LatencyGuard | None = None


SAMPLED = Decisions()


@dataclass
class _Prefix:
    """A prefill run up to the insertion point, shared by the members with that stage-1 choice."""

    state: PrefixState
    sample: int
    crops_index: int
    insertion_index: int
    max_crops: int
    top_k_log_probs: torch.Tensor  # stage 2's distributions on this prefix: (K,), (B,)
    blocks_log_probs: torch.Tensor
    timing: RequestTiming  # the segments so far (stage 1, prefix, stage 2)
    index: int  # into StepRollouts.prefix_embeds


@dataclass
class _Member:
    """A group member decided on its prefix: stage 2's choice, what it waits on to run."""

    pre: _Prefix
    top_k_index: int
    blocks_index: int
    top_k: int
    num_active_blocks: int
    knobs: RowKnobs  # as the runtime runs it after the prefix
    group: int
    member: int
    budget: float
    log_prob: float

    @property
    def active_blocks(self) -> tuple[int, ...]:
        return self.knobs.blocks

    @property
    def shape(self) -> MemberShape:
        p, state = self.pre.state.insertion_position, self.pre.state
        return MemberShape(self.top_k, sum(b >= p for b in self.active_blocks), len(self.active_blocks),
                           state.seq_len - state.extra_tokens)


class RolloutExecutor:
    """Runs groups of rollouts with a :class:`TwoStageController` on a :class:`ModelRuntime`.

    ``warmup``: before a configuration's first measured run in this process, run it once
    unmeasured (prefix per (max_crops, insertion position); suffix + one decode step per
    full configuration), so one-time costs (allocations, kernel selection) stay out of the
    latencies the reward sees.
    """

    def __init__(self, runtime: ModelRuntime, controller: TwoStageController, samples: OnlineSamples,
                 max_new_tokens: int = 16, warmup: bool = True) -> None:
        self.runtime, self.controller, self.samples = runtime, controller, samples
        self.max_new_tokens = int(max_new_tokens)
        self.warmup = warmup
        self.timer = StageTimer(runtime.vision_module, list(runtime.decoder_layers), runtime.device)
        self.executor = RequestExecutor(runtime, self.timer)
        self._warm: set[tuple] = set()
        self._images: dict[int, Image.Image | None] = {}
        self._inputs: dict[tuple[int, int], ModelInputs] = {}
        self.tiling_crops = samples.tiling_crops(runtime, controller.max_crops_values)
        self.latency_model = SuffixLatencyModel()

    def close(self) -> None:
        self.timer.close()

    # -- inputs
    def _image(self, sample: int) -> Image.Image | None:
        if sample not in self._images:
            if len(self._images) > 256:  # bounded: images are re-read when needed again
                self._images.clear()
                self._inputs.clear()
            path = self.samples.image_path[sample]
            self._images[sample] = open_image(path) if path is not None else None
        return self._images[sample]

    def _model_inputs(self, sample: int, max_crops: int) -> ModelInputs:
        key = (sample, max_crops)
        if key not in self._inputs:
            self._inputs[key] = self.runtime.preprocess(self._image(sample), self.samples.question[sample], max_crops)
        return self._inputs[key]

    # -- execution
    def run_fixed(self, samples: Sequence[int], force: tuple[int, int, int, int],
                  budget_ms: float = 1e9) -> list[Rollout]:
        """One measured rollout per sample with the given knob indices (crops, insertion, top-K,
        blocks) instead of sampled ones; the controller still runs (its time is part of latency)."""
        gen = torch.Generator().manual_seed(0)
        groups = [(s, budget_ms) for s in samples]
        return self.run_groups(groups, 1, gen, gen, decisions=Decisions(force=force)).rollouts

    @torch.no_grad()
    def run_groups(self, groups: Sequence[tuple[int, float]], group_size: int, stage1_generator: torch.Generator,
                   stage2_generator: torch.Generator, rank: int = 0, world_size: int = 1, first_group: int = 0, *,
                   controller: TwoStageController | None = None, decisions: Decisions = SAMPLED,
                   batch_rows: int | None = 1, timed_generator: torch.Generator | None = None) -> StepRollouts:
        """Run this rank's share of the members of ``groups`` ((sample, budget_ms) pairs).

        Stage-1 choices are drawn from ``stage1_generator``, which every rank advances the same
        way (each rank knows every member's stage-1 choice); members go to ranks round-robin
        by their global index. Stage-2 choices use the rank's own ``stage2_generator``.
        ``controller``: decide with this controller instead of the executor's own (same knob
        values), e.g. to interleave two controllers request by request on one timer and warm-up set.
        ``batch_rows``: 1 runs every member alone; N > 1 (None: as many as the runtime fits) runs
        sampled members batched, N rows a pass, with ``timed_generator`` drawing the share timed
        alone (the module docstring); the choices drawn are the same either way.
        """
        ctrl = controller if controller is not None else self.controller
        ctrl.eval()
        out = StepRollouts()
        batched = (batch_rows is None or batch_rows > 1) and not decisions.greedy and decisions.force is None
        if batched and timed_generator is None:
            timed_generator = torch.Generator().manual_seed(0)
        slots: list[Rollout | _Member] = []
        for g, (sample, budget) in enumerate(groups):
            tick = time.perf_counter()
            head = RequestTiming()
            s1, crops_pick, insertion_pick, guarded = self._stage1(ctrl, sample, budget, group_size,
                                                                   stage1_generator, decisions, head)
            by_prefix: dict[tuple[int, int], list[int]] = {}
            for m in range(group_size):
                if (g * group_size + m) % world_size == rank:
                    by_prefix.setdefault((int(crops_pick[m]), int(insertion_pick[m])), []).append(m)
            out.controller_s += time.perf_counter() - tick
            for (c, pi), members in by_prefix.items():
                pre = self._prefix(ctrl, s1, sample, c, pi, head, out, first_member=len(slots))
                for m in members:
                    member = self._decide(ctrl, s1, pre, out, decisions, stage2_generator, guarded,
                                          group=first_group + g, member=m, budget=budget)
                    if batched and not self._timed_alone(member, timed_generator):
                        slots.append(member)
                    else:
                        slots.append(self._run_alone(member, out, decisions, guarded, rank=rank))
        waiting = [s for s in slots if isinstance(s, _Member)]
        done = iter(self._run_batched(waiting, out, batch_rows, rank=rank) if waiting else [])
        out.rollouts = [next(done) if isinstance(s, _Member) else s for s in slots]
        return out

    def _timed_alone(self, member: _Member, generator: torch.Generator) -> bool:
        """Whether a member of a batched step runs alone: its top-K's model not ready yet, or the seeded share."""
        draw = float(torch.rand((), generator=generator))  # drawn for every member: the sequence is the step's own
        return not self.latency_model.ready(member.top_k) or draw < TIMED_SHARE

    def _stage1(self, ctrl: TwoStageController, sample: int, budget: float, group_size: int,
                generator: torch.Generator, decisions: Decisions,
                head: RequestTiming) -> tuple[Stage1Output, torch.Tensor, torch.Tensor, GuardGrid | None]:
        """Stage 1 (timed into ``head``), every member's crops and insertion choices (indices) and, for a
        guarded greedy decision, the guard's view of the request."""
        device = self.runtime.device
        lang = self.samples.lang[sample][None].to(device)
        guarded = None
        with self.timer.segment("stage1", head):
            prompt = self.samples.prompt_tokens[sample]  # NaN where unknown (OnlineSamples fills it)
            s1 = ctrl.stage1(lang, torch.tensor([budget], dtype=torch.float32, device=device),
                             self.tiling_crops[sample][None].to(device), prompt[None].float().to(device))
            crops_probs, insertion_probs = s1.crops_log_probs[0].exp(), s1.insertion_log_probs[0].exp()
            if decisions.greedy and decisions.guard is not None and decisions.force is None:
                # the guard's time is the controller's: inside the request's budget
                guarded = decisions.guard.knob_grid(ctrl, self.samples.lang[sample], self.tiling_crops[sample], budget,
                                                    float(prompt))
        # drawn even when overridden below: the generator advances the same way on every rank and in every mode
        crops_pick = torch.multinomial(crops_probs.cpu(), group_size, replacement=True, generator=generator)
        insertion_pick = torch.multinomial(insertion_probs.cpu(), group_size, replacement=True, generator=generator)
        if decisions.greedy:
            if guarded is not None:  # among the crops with a configuration expected to fit
                crops_probs = crops_probs.cpu().masked_fill(~guarded.crops_allowed, -1.0)
            crops_pick = torch.full((group_size,), int(crops_probs.argmax()))
            insertion_pick = torch.full((group_size,), int(insertion_probs.argmax()))
        if decisions.insertion_index is not None:
            insertion_pick = torch.full((group_size,), int(decisions.insertion_index))
        if decisions.force is not None:
            crops_pick = torch.full((group_size,), decisions.force[0])
            insertion_pick = torch.full((group_size,), decisions.force[1])
        return s1, crops_pick, insertion_pick, guarded

    def _prefix(self, ctrl: TwoStageController, s1: Stage1Output, sample: int, c: int, pi: int, head: RequestTiming,
                out: StepRollouts, *, first_member: int) -> _Prefix:
        """The shared prefix of one (crops, insertion position) choice and stage 2's distributions on it."""
        runtime, device = self.runtime, self.runtime.device
        max_crops, p = ctrl.max_crops_values[c], ctrl.insertion_positions[pi]
        inputs = self._model_inputs(sample, max_crops)
        tick = time.perf_counter()
        if self.warmup and ("prefix", max_crops, p) not in self._warm:
            runtime.prefill_prefix(inputs, p, s1.budget_token[0])
            self._warm.add(("prefix", max_crops, p))
        def timed_prefix() -> tuple[RequestTiming, PrefixState]:
            shared = RequestTiming(segments=list(head.segments))
            return shared, self.executor.prefix(inputs, p, s1.budget_token[0], shared)

        shared, state = uncaptured_run(runtime, timed_prefix)
        out.model_s += time.perf_counter() - tick
        tick = time.perf_counter()
        # the cached global-crop feature, as offline training reads it: it equals the prefix's own
        # (state.image_feature) bit for bit, and the loss batch replays stage 2 from the cache
        with self.timer.segment("stage2", shared):
            top_k_lp, blocks_lp = ctrl.stage2(
                s1, self.samples.image[sample][None].to(device), self.samples.image_present[sample][None].to(device),
                torch.tensor([c], device=device), torch.tensor([pi], device=device), state.latency_token[None])
        out.controller_s += time.perf_counter() - tick
        out.prefix_embeds.append(state.embeds[:, :-1].detach().clone())  # without the budget token
        out.prefix_first_member.append(first_member)
        return _Prefix(state, sample, c, pi, max_crops, top_k_lp[0], blocks_lp[0], shared, len(out.prefix_embeds) - 1)

    def _decide(self, ctrl: TwoStageController, s1: Stage1Output, pre: _Prefix, out: StepRollouts,
                decisions: Decisions, generator: torch.Generator, guarded: GuardGrid | None,
                *, group: int, member: int, budget: float) -> _Member:
        """One member's stage-2 choice on its shared prefix."""
        tick = time.perf_counter()
        if decisions.force is not None:
            k, b = decisions.force[2], decisions.force[3]
        elif decisions.greedy and guarded is not None:
            k, b = guarded_stage2(pre.top_k_log_probs.cpu(), pre.blocks_log_probs.cpu(),
                                  guarded.allowed[pre.crops_index], guarded.expected_ms[pre.crops_index])
        elif decisions.greedy:
            k, b = int(pre.top_k_log_probs.argmax()), int(pre.blocks_log_probs.argmax())
        else:
            k = int(torch.multinomial(pre.top_k_log_probs.exp().cpu(), 1, generator=generator))
            b = int(torch.multinomial(pre.blocks_log_probs.exp().cpu(), 1, generator=generator))
        top_k, blocks = ctrl.top_k_values[k], ctrl.num_active_blocks_values[b]
        out.controller_s += time.perf_counter() - tick
        log_prob = (s1.crops_log_probs[0, pre.crops_index] + s1.insertion_log_probs[0, pre.insertion_index]
                    + pre.top_k_log_probs[k] + pre.blocks_log_probs[b])
        knobs = self.runtime.knobs_after_prefix(pre.state.insertion_position, top_k, blocks)
        return _Member(pre, k, b, top_k, blocks, knobs, group, member, float(budget), float(log_prob))

    def _run_alone(self, member: _Member, out: StepRollouts, decisions: Decisions, guarded: GuardGrid | None,
                   *, rank: int) -> Rollout:
        """A member timed alone from its prefix: the rest of the prefill and decoding (the latency
        model observes it)."""
        pre, top_k, blocks = member.pre, member.top_k, member.num_active_blocks
        p = pre.state.insertion_position
        tick = time.perf_counter()
        if self.warmup and (pre.max_crops, p, top_k, blocks) not in self._warm:
            self.executor.warm_up(pre.state, top_k, blocks)
            self._warm.add((pre.max_crops, p, top_k, blocks))
        def timed_answer() -> tuple[RequestTiming, Answer]:
            timing = RequestTiming(segments=list(pre.timing.segments))
            return timing, self.executor.answer(pre.state, top_k, blocks, timing, max_tokens=self.max_new_tokens)

        timing, answer = uncaptured_run(self.runtime, timed_answer)
        out.model_s += time.perf_counter() - tick
        self.timer.resolve(timing)
        rollout = self._rollout(timing, answer.tokens, member, answer.active_blocks, rank=rank)
        suffix = next(seg for seg in timing.segments if seg.name == "suffix")
        error = self.latency_model.relative_error(member.shape, float(suffix.wall_ms), rollout.decode_step_ms)
        if error is not None:
            out.latency_model_errors.append(error)
        self.latency_model.observe(member.shape, float(suffix.wall_ms), suffix.blocks_ms, rollout.decode_step_ms)
        if guarded is not None:  # the guard follows the machine's speed and tail on the requests it decided
            decisions.guard.observe(float(guarded.base_ms[pre.crops_index, member.top_k_index, member.blocks_index]),
                                    rollout.latency_total_ms,
                                    float(guarded.expected_ms[pre.crops_index, member.top_k_index,
                                                              member.blocks_index]))
        return rollout

    def _run_batched(self, members: list[_Member], out: StepRollouts, batch_rows: int | None,
                     *, rank: int) -> list[Rollout]:
        """Members continued from their prefixes in shared passes; their suffix and decode latencies modeled."""
        tick = time.perf_counter()
        rows = [PrefixRequest(m.pre.state, m.knobs, self.max_new_tokens) for m in members]
        results = self.runtime.answer_prefixes(rows, max_rows=batch_rows)
        out.model_s += time.perf_counter() - tick
        rollouts = []
        for member, result in zip(members, results, strict=True):
            timing = self.timer.resolve(RequestTiming(segments=list(member.pre.timing.segments)))
            modeled = self.latency_model.predict(member.shape)
            steps = len(result.token_ids) - 1
            timing.segments.append(Segment("suffix", blocks_calls=member.shape.suffix_blocks,
                                           wall_ms=modeled.suffix_ms, blocks_ms=modeled.suffix_blocks_ms))
            timing.segments.extend(Segment("decode", blocks_calls=len(member.active_blocks), wall_ms=modeled.step_ms)
                                   for _ in range(steps))
            rollouts.append(self._rollout(timing, result.token_ids, member, member.active_blocks, rank=rank,
                                          latency_modeled=True))
        return rollouts

    def _rollout(self, timing: RequestTiming, tokens: list[int], member: _Member, active: tuple[int, ...], *,
                 rank: int, latency_modeled: bool = False) -> Rollout:
        pre = member.pre
        inputs, sample = pre.state.inputs, pre.sample
        parts = LatencyParts.of(timing)
        text = self.runtime.decode_text(tokens)
        score, pred = score_answer(self.samples.dataset[sample], text, self.samples.answers[sample])
        num_vision = 0 if inputs.image_token_positions is None else int(inputs.image_token_positions.numel())
        return Rollout(
            group=member.group, member=member.member, sample=sample, budget_ms=member.budget,
            crops_index=pre.crops_index, insertion_index=pre.insertion_index, top_k_index=member.top_k_index,
            blocks_index=member.blocks_index, max_crops=pre.max_crops, insertion_position=pre.state.insertion_position,
            top_k=member.top_k, num_active_blocks=member.num_active_blocks, active_blocks=tuple(active),
            num_crops=inputs.num_crops, num_vision_tokens=num_vision, num_text_tokens=inputs.num_text_tokens,
            num_output_tokens=len(tokens), text=text, pred=pred, score=float(score), log_prob=member.log_prob,
            latency_stage1_ms=parts.stage1_ms, latency_stage2_ms=parts.stage2_ms,
            latency_vision_ms=parts.vision_ms, latency_prefill_ms=parts.prefill_ms,
            latency_decode_ms=parts.decode_ms, decode_step_ms=list(parts.decode_step_ms),
            latency_total_ms=parts.measured_ms, prefix=pre.index, rank=rank,
            segments=[(s.name, s.wall_ms, s.blocks_ms, s.blocks_calls) for s in timing.segments],
            latency_modeled=latency_modeled)
