"""Executing sampled knob settings on the real model: one request per group member.

A group is one (sample, budget). The request timeline of a member, every part measured
(``online.timing``)::

    stage 1 (controller: crops, insertion position, budget token)     -> stage1_ms
    embed + vision tower + budget token + blocks 0..p-1 of the prefill -> prefix wall (vision_ms, prefill part 1)
    stage 2 (controller, on the latency token: top-K, block count)    -> stage2_ms
    blocks >= p of the prefill + norm + LM head + first token          -> suffix wall (prefill part 2)
    N-1 decode steps (same knobs, no controller, no extra token)       -> one wall time each

``latency_total_ms`` is the sum of these measured intervals, which partition the request
from the controller's first operation to the last token: the controller's time counts
inside the budget. Image preprocessing (cropping on the CPU) is outside, as in exp6's
T_total. ``latency_prefill_ms`` is the first decoder block's entry to the last block's exit
of the prefill pass (both parts), ``latency_vision_ms`` the vision module's own interval.

Members that share (sample, crops, insertion position) share the stage-1 decision, the
prefix and the stage-2 distribution: the prefix depends on nothing else (blocks before the
insertion point keep the default top-K), so it runs once per group and stage-1 choice, and
its measured time is part of each such member's latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image

from features.images import open_image
from features.model.base import ModelInputs, ModelRuntime
from online.data import OnlineSamples
from online.metrics import score_answer
from online.timing import RequestTiming, StageTimer
from trainer.two_stage import RolloutBatch, TwoStageController


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

    def batch(self, samples: OnlineSamples, device: torch.device, tiling_crops: torch.Tensor | None = None) -> RolloutBatch:
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
            tiling_crops=None if tiling_crops is None else tiling_crops[rows].to(device))


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
        self._warm: set[tuple] = set()
        self._images: dict[int, Image.Image | None] = {}
        self._inputs: dict[tuple[int, int], ModelInputs] = {}
        self.tiling_crops = samples.tiling_crops(runtime, controller.max_crops_values)

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
    def _generate(self, state, timing: RequestTiming | None) -> list[int]:
        """Greedy tokens from a prefilled state: the first from the prefill logits, then N-1 decode steps."""
        runtime, eos = self.runtime, self.runtime.eos_id
        token = int(state.logits.argmax())
        tokens = [token]
        while token != eos and len(tokens) < self.max_new_tokens:
            if timing is None:
                runtime.decode_step(state, token)
                token = int(state.logits.argmax())
            else:
                with self.timer.segment("decode", timing):
                    runtime.decode_step(state, token)
                    token = int(state.logits.argmax())
            tokens.append(token)
        return tokens

    def run_fixed(self, samples: Sequence[int], force: tuple[int, int, int, int], budget_ms: float = 1e9) -> list[Rollout]:
        """One measured rollout per sample with the given knob indices (crops, insertion, top-K,
        blocks) instead of sampled ones; the controller still runs (its time is part of latency)."""
        gen = torch.Generator().manual_seed(0)
        return self.run_groups([(s, budget_ms) for s in samples], 1, gen, gen, force=force).rollouts

    @torch.no_grad()
    def run_groups(self, groups: Sequence[tuple[int, float]], group_size: int, stage1_generator: torch.Generator,
                   stage2_generator: torch.Generator, rank: int = 0, world_size: int = 1,
                   first_group: int = 0, force: tuple[int, int, int, int] | None = None,
                   greedy: bool = False, insertion_index: int | None = None,
                   controller: TwoStageController | None = None) -> StepRollouts:
        """Run this rank's share of the members of ``groups`` ((sample, budget_ms) pairs).

        Stage-1 choices are drawn from ``stage1_generator``, which every rank advances the same
        way (each rank knows every member's stage-1 choice); members go to ranks round-robin
        by their global index. Stage-2 choices use the rank's own ``stage2_generator``.
        ``greedy``: the most probable choice at each stage instead of a sample (evaluation);
        ``insertion_index``: a fixed insertion position (index into the positions);
        ``controller``: decide with this controller instead of the executor's own (same knob
        values), e.g. to interleave two controllers request by request on one timer and warm-up set.
        """
        import time

        ctrl = controller if controller is not None else self.controller
        runtime, timer = self.runtime, self.timer
        device = runtime.device
        ctrl.eval()
        out = StepRollouts()
        num_layers = runtime.num_layers
        for g, (sample, budget) in enumerate(groups):
            tick = time.perf_counter()
            head = RequestTiming()
            lang = self.samples.lang[sample][None].to(device)
            with timer.segment("stage1", head):
                s1 = ctrl.stage1(lang, torch.tensor([budget], dtype=torch.float32, device=device),
                                 self.tiling_crops[sample][None].to(device))
                crops_probs, insertion_probs = s1.crops_log_probs[0].exp(), s1.insertion_log_probs[0].exp()
            crops_pick = torch.multinomial(crops_probs.cpu(), group_size, replacement=True, generator=stage1_generator)
            insertion_pick = torch.multinomial(insertion_probs.cpu(), group_size, replacement=True,
                                               generator=stage1_generator)
            if greedy:
                crops_pick = torch.full((group_size,), int(crops_probs.argmax()))
                insertion_pick = torch.full((group_size,), int(insertion_probs.argmax()))
            if insertion_index is not None:
                insertion_pick = torch.full((group_size,), int(insertion_index))
            if force is not None:
                crops_pick = torch.full((group_size,), force[0])
                insertion_pick = torch.full((group_size,), force[1])
            mine = [m for m in range(group_size) if (g * group_size + m) % world_size == rank]
            by_prefix: dict[tuple[int, int], list[int]] = {}
            for m in mine:
                by_prefix.setdefault((int(crops_pick[m]), int(insertion_pick[m])), []).append(m)
            out.controller_s += time.perf_counter() - tick
            for (c, pi), members in by_prefix.items():
                max_crops, p = ctrl.max_crops_values[c], ctrl.insertion_positions[pi]
                inputs = self._model_inputs(sample, max_crops)
                tick = time.perf_counter()
                if self.warmup and ("prefix", max_crops, p) not in self._warm:
                    runtime.prefill_prefix(inputs, p, s1.budget_token[0])
                    self._warm.add(("prefix", max_crops, p))
                shared = RequestTiming(segments=list(head.segments))
                with timer.segment("prefix", shared):
                    prefix = runtime.prefill_prefix(inputs, p, s1.budget_token[0])
                out.model_s += time.perf_counter() - tick
                tick = time.perf_counter()
                with timer.segment("stage2", shared):
                    top_k_lp, blocks_lp = ctrl.stage2(
                        s1, self.samples.image[sample][None].to(device), self.samples.image_present[sample][None].to(device),
                        torch.tensor([c], device=device), torch.tensor([pi], device=device), prefix.latency_token[None])
                out.controller_s += time.perf_counter() - tick
                prefix_id = len(out.prefix_embeds)
                out.prefix_embeds.append(prefix.embeds[:, :-1].detach().clone())  # without the budget token
                out.prefix_first_member.append(len(out.rollouts))
                for m in members:
                    tick = time.perf_counter()
                    if force is not None:
                        k, b = force[2], force[3]
                    elif greedy:
                        k, b = int(top_k_lp[0].argmax()), int(blocks_lp[0].argmax())
                    else:
                        k = int(torch.multinomial(top_k_lp[0].exp().cpu(), 1, generator=stage2_generator))
                        b = int(torch.multinomial(blocks_lp[0].exp().cpu(), 1, generator=stage2_generator))
                    top_k, blocks = ctrl.top_k_values[k], ctrl.num_active_blocks_values[b]
                    active = runtime.blocks_for(blocks, first_kept=p)
                    out.controller_s += time.perf_counter() - tick
                    tick = time.perf_counter()
                    timing = RequestTiming(segments=list(shared.segments))
                    with runtime.knobs(top_k={i: top_k for i in range(p, num_layers)}):
                        if self.warmup and (max_crops, p, top_k, blocks) not in self._warm:
                            state = runtime.prefill_suffix(prefix, active)
                            runtime.decode_step(state, int(state.logits.argmax()))
                            self._warm.add((max_crops, p, top_k, blocks))
                        with timer.segment("suffix", timing):
                            state = runtime.prefill_suffix(prefix, active)
                        tokens = self._generate(state, timing)
                    out.model_s += time.perf_counter() - tick
                    timer.resolve(timing)
                    out.rollouts.append(self._rollout(
                        timing, tokens, inputs, group=first_group + g, member=m, sample=sample, budget=budget,
                        indices=(c, pi, k, b), knob_values=(max_crops, p, top_k, blocks), active=active,
                        log_prob=float(s1.crops_log_probs[0, c] + s1.insertion_log_probs[0, pi] + top_k_lp[0, k]
                                       + blocks_lp[0, b]), prefix=prefix_id, rank=rank))
        return out

    def _rollout(self, timing: RequestTiming, tokens: list[int], inputs: ModelInputs, *, group: int, member: int,
                 sample: int, budget: float, indices: tuple[int, int, int, int], knob_values: tuple[int, int, int, int],
                 active: tuple[int, ...], log_prob: float, prefix: int, rank: int) -> Rollout:
        seg = {s.name: s for s in timing.segments if s.name != "decode"}
        decode = [s.wall_ms for s in timing.by_prefix("decode")]
        prefill_ms = (seg["prefix"].blocks_ms or 0.0) + (seg["suffix"].blocks_ms or 0.0)
        text = self.runtime.decode_text(tokens)
        score, pred = score_answer(self.samples.dataset[sample], text, self.samples.answers[sample])
        num_vision = 0 if inputs.image_token_positions is None else int(inputs.image_token_positions.numel())
        c, pi, k, b = indices
        max_crops, p, top_k, blocks = knob_values
        return Rollout(
            group=group, member=member, sample=sample, budget_ms=float(budget), crops_index=c, insertion_index=pi,
            top_k_index=k, blocks_index=b, max_crops=max_crops, insertion_position=p, top_k=top_k,
            num_active_blocks=blocks, active_blocks=tuple(active), num_crops=inputs.num_crops,
            num_vision_tokens=num_vision, num_text_tokens=int(inputs.input_ids.shape[1]) - num_vision,
            num_output_tokens=len(tokens), text=text, pred=pred, score=float(score), log_prob=log_prob,
            latency_stage1_ms=seg["stage1"].wall_ms, latency_stage2_ms=seg["stage2"].wall_ms,
            latency_vision_ms=seg["prefix"].vision_ms, latency_prefill_ms=prefill_ms,
            latency_decode_ms=float(sum(decode)), decode_step_ms=decode,
            latency_total_ms=float(sum(s.wall_ms for s in timing.segments)), prefix=prefix, rank=rank,
            segments=[(s.name, s.wall_ms, s.blocks_ms, s.blocks_calls) for s in timing.segments])
