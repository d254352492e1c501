"""The controller on the request path: which knobs a request runs with, decided in two stages.

Stage 1 runs before the vision tower and reads what is known then: the question's language
feature (mean input embedding), the image's tiling at every crops choice (from its size) and
the budget left (the request's budget less the time since it arrived). It picks the crops
and, for an online run, the insertion position and the budget token. Stage 2 runs after the
vision pass at those crops (for an online run, after decoder blocks 0..p-1): it reads the
global crop's image feature from that pass (the feature training reads, the same at every
crop count), plus, for an online run, the latency token, and picks top-K and the block count.

* :class:`OfflineDecider`: an offline run, as ``ctrl export`` writes it
  (:class:`controller.deploy.DeployedController`: its ``stage1`` and ``stage2``, with the table
  fallback). Its stage 2 runs before block 0 (insertion position 0): its top-K applies to
  every block, as in the recorded data it was trained on. Its choice is held to the machine's
  measured cost (its :class:`controller.machine.MachineCost`: the request's own predicted cost, or
  the configuration's median, times the server's latency scale per configuration).
* :class:`OnlineDecider`: an online run's :class:`trainer.two_stage.TwoStageController`
  (greedy at each stage, as ``ctrl evaluate`` measures it), held to the run's latency guard
  (its cost model's grids) where the run measured one.
* :class:`FixedKnobs`: the knobs a request fixed itself (``knobs``), e.g. a benchmark's static
  configuration; the controller does not run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from controller.cost import LatencyScale
from controller.deploy import DeployedController, cost_basis, group_names_of, load_deployed
from controller.latency_guard import LatencyGuard, guarded_stage2, load_run_guard
from controller.machine import CostGrid, MachineCost
from pipeline.errors import CacheMismatchError, CtrlError
from pipeline.knobs import Config
from pipeline.workspace import Workspace
from serve.protocol import RequestError
from serve.startup import check_controller_file
from trainer.fallback import read_fallback
from trainer.policy import ControllerPolicy, read_checkpoint
from trainer.runs import RunDir
from trainer.two_stage import Stage1Output, TwoStageController


@dataclass
class Stage1Choice:
    """What stage 1 decided for one request."""

    max_crops: int
    insertion_position: int  # decoder blocks 0..p-1 run before stage 2 (0: stage 2 before block 0)
    budget_token: torch.Tensor | None
    decided_by: str  # controller | table | cheapest | request
    state: Any = None  # what the decider's stage 2 reuses
    question_group: str | None = None  # the family or cluster the question reads as (the fallback's table)
    guarded_from: str | None = None  # C/K/B stage 2 chose, where the machine's cost made it run another
    #: the deployed cost model's prediction for this request at the configuration it ran (profile ms), and what
    #: it rested on (:func:`controller.deploy.cost_basis`)
    expected_latency_ms: float | None = None
    latency_quantile_ms: float | None = None
    cost_basis: str | None = None
    #: the machine's cost grid the choice was held to (what the cost model compares the served latency with)
    cost_grid: CostGrid | None = None


@dataclass
class Stage2Inputs:
    lang: torch.Tensor  # (Dl,)
    tiling_crops: torch.Tensor  # (C,), NaN without an image
    budget_ms: float
    image_feature: torch.Tensor | None  # (Di,) the global crop's feature; None without an image
    latency_token: torch.Tensor | None  # (d,) after blocks 0..p-1, online runs only
    #: the model time the budget allows (served ms), which an offline controller's choice is held to on the
    #: machine's cost (None: not held, ``--no-config-guard``)
    served_budget_ms: float | None = None
    #: the text tokens of the formatted prompt (NaN: not counted; read by a per-request table)
    prompt_tokens: float = math.nan
    #: per configuration, how much longer than alone the request would take in the batch it joins (a server's
    #: continuous batching: ``serve.batch_cost.BatchCost.factor``); the machine's cost holds it to that too
    batch_factor_of: Callable[[Config], float] | None = None


class RequestDecider(Protocol):
    """Two-stage knob decisions for one request at a time."""

    #: run id (or file name) and phase of the controller, recorded with every request
    controller_run: str
    phase: str
    max_crops_values: tuple[int, ...]
    budget_range_ms: tuple[float, float]
    #: per configuration (max_crops, top_k, blocks), the median latency the controller was trained on
    #: (empty: unknown; the server then cannot measure its latency scale)
    reference_latency_ms: dict[Config, float]
    #: the machine's cost model it decides with; the server records every request it serves there
    cost: MachineCost
    #: whether stage 1 takes ``prompt_tokens=`` (the formatted prompt's text tokens, float)
    reads_prompt_tokens: bool

    def stage1(self, lang: torch.Tensor, tiling_crops: torch.Tensor, budget_ms: float) -> Stage1Choice: ...

    def stage2(self, choice: Stage1Choice, inputs: Stage2Inputs) -> tuple[int, int]: ...


def _image(feature: torch.Tensor | None, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, dim) image feature and (1,) present flag; zeros and False without an image."""
    if feature is None or dim == 0:
        return torch.zeros(1, dim), torch.tensor([feature is not None and dim > 0])
    return feature.reshape(1, -1).float().cpu(), torch.tensor([True])


class OfflineDecider:
    """An offline run's deployed controller (``DeployedController`` or the TorchScript file ``ctrl export`` wrote)."""

    phase = "offline"

    def __init__(self, deployed: Any, controller_run: str, cost: MachineCost | None = None) -> None:
        self.deployed = deployed
        self.controller_run = controller_run
        self.max_crops_values = tuple(int(v) for v in deployed.max_crops_values.tolist())
        self.budget_range_ms = (float(deployed.budget_min_ms), float(deployed.budget_max_ms))
        self.image_dim = int(deployed.image_dim)
        self.reference_latency_ms = reference_latencies(deployed)
        self.cost = cost if cost is not None else MachineCost(LatencyScale(self.reference_latency_ms))
        self.group_names = group_names_of(deployed)
        # a deployed cost model reads the prompt's length (files exported before it was deployed have none);
        # the stages read it where a per-request table answers at some budget or the network reads the cost
        # model (files exported before the network could read it say so by has_request_table alone)
        self.has_cost_model = hasattr(deployed, "expected_latency")
        self.reads_prompt_tokens = bool(getattr(deployed, "has_cost_model", False))
        self.table_reads_prompt = bool(getattr(deployed, "reads_prompt_tokens",
                                               getattr(deployed, "has_request_table", False)))
        self.reads_prompt_tokens = self.reads_prompt_tokens or self.table_reads_prompt
        self._actions = [tuple(int(v) for v in a) for a in deployed.actions.tolist()]

    def _decided_by(self, budget: torch.Tensor, lang: torch.Tensor) -> str:
        return "controller" if bool(self.deployed.network_decides(budget, lang)[0]) else "table"

    def _prompt(self, prompt_tokens: float) -> torch.Tensor | None:
        return torch.tensor([float(prompt_tokens)]) if self.table_reads_prompt else None

    def stage1(self, lang: torch.Tensor, tiling_crops: torch.Tensor, budget_ms: float,
               prompt_tokens: float = math.nan) -> Stage1Choice:
        budget = torch.tensor([float(budget_ms)])
        lang_row, tiling = lang[None].float(), tiling_crops[None].float()
        if self.table_reads_prompt:
            max_crops = int(self.deployed.stage1(lang_row, budget, tiling, self._prompt(prompt_tokens))[0])
        else:
            max_crops = int(self.deployed.stage1(lang_row, budget, tiling)[0])
        group = None
        if self.group_names:
            index = int(self.deployed.question_group(lang_row)[0])
            group = self.group_names[index] if index >= 0 else None
        cost = None
        if self.has_cost_model:  # this request's predicted latency at every configuration (profile ms)
            predicted = self.deployed.expected_latency(lang_row, tiling, torch.tensor([float(prompt_tokens)]))
            # a file exported before the extrapolation flag gives three outputs
            far = predicted[3][0] if len(predicted) > 3 else torch.zeros_like(predicted[2][0])
            cost = (predicted[0][0], predicted[1][0], predicted[2][0], far)
        return Stage1Choice(max_crops, 0, None, self._decided_by(budget, lang_row), state=cost, question_group=group)

    def stage2(self, choice: Stage1Choice, inputs: Stage2Inputs) -> tuple[int, int]:
        image, present = _image(inputs.image_feature, self.image_dim)
        args = (inputs.lang[None].float(), image, present, torch.tensor([float(inputs.budget_ms)]),
                torch.tensor([choice.max_crops], dtype=torch.long), inputs.tiling_crops[None].float())
        if self.table_reads_prompt:
            top_k, blocks = self.deployed.stage2(*args, self._prompt(inputs.prompt_tokens))
        else:
            top_k, blocks = self.deployed.stage2(*args)
        own_cost = None
        if choice.state is not None:
            median, _, own, _ = choice.state
            # the guard holds this request to its own predicted cost where the model made one
            own_cost = {a: float(m) for a, m, o in zip(self._actions, median.tolist(), own.tolist()) if o}
        top_k, blocks = held_to_machine(choice, int(top_k[0]), int(blocks[0]), inputs, self.cost, own_cost or None)
        if choice.state is not None:
            median, quantile, own, far = choice.state
            ran = self._actions.index((choice.max_crops, top_k, blocks)) if (
                (choice.max_crops, top_k, blocks) in self._actions) else None
            if ran is not None:
                choice.expected_latency_ms, choice.latency_quantile_ms = float(median[ran]), float(quantile[ran])
                choice.cost_basis = cost_basis(bool(own[ran]), bool(far[ran]))
        return top_k, blocks


def held_to_machine(choice: Stage1Choice, top_k: int, blocks: int, inputs: Stage2Inputs, cost: MachineCost,
                    request_cost_ms: dict[Config, float] | None = None) -> tuple[int, int]:
    """An offline controller's stage-2 choice held to what this machine does now (``cost``'s grid at the
    model time the budget allows: :meth:`controller.machine.CostGrid.held`); records the grid in
    ``choice.cost_grid`` and the replaced choice in ``choice.guarded_from``. ``request_cost_ms``: this
    request's own predicted latency per configuration (profile ms, the deployed cost model's), read in
    place of the configurations' medians where given."""
    chosen = (choice.max_crops, int(top_k), int(blocks))
    if inputs.served_budget_ms is None:
        return chosen[1], chosen[2]
    choice.cost_grid = cost.grid(inputs.lang, inputs.tiling_crops, inputs.served_budget_ms, request_ms=request_cost_ms,
                                 batch_factor_of=inputs.batch_factor_of)
    run = choice.cost_grid.held(chosen)
    if run != chosen:
        choice.guarded_from = "/".join(str(v) for v in chosen)
    return run[1], run[2]


class OnlineDecider:
    """An online run's two-stage controller, greedy at each stage; held to the run's latency guard
    (``controller.latency_guard``) where the run measured one, as its checks and evaluation were."""

    phase = "online"

    def __init__(self, controller: TwoStageController, controller_run: str,
                 guard: LatencyGuard | None = None, cost: MachineCost | None = None) -> None:
        self.controller = controller.eval()
        self.controller_run = controller_run
        # an online run's budgets were measured on the serving path at training time; nothing records
        # them per configuration, so the scale stays 1 unless --latency-scale pins it
        self.cost = cost if cost is not None else MachineCost(LatencyScale({}), guard)
        self.max_crops_values = tuple(controller.max_crops_values)
        cfg = controller.policy.config
        self.budget_range_ms = (float(cfg.budget_min_ms), float(cfg.budget_max_ms))
        self.image_dim = int(cfg.image_feature_dim)
        self.reference_latency_ms: dict[Config, float] = {}

    @property
    def guard(self) -> LatencyGuard | None:
        return self.cost.guard

    @property
    def reads_prompt_tokens(self) -> bool:
        """Where its guard or its network predicts from the prompt's length too (the request cost model)."""
        return ((self.guard is not None and self.guard.reads_prompt_tokens)
                or self.controller.policy.config.use_request_cost)

    @torch.no_grad()
    def stage1(self, lang: torch.Tensor, tiling_crops: torch.Tensor, budget_ms: float,
               prompt_tokens: float = math.nan) -> Stage1Choice:
        s1 = self.controller.stage1(lang[None].float(), torch.tensor([float(budget_ms)]), tiling_crops[None].float(),
                                    torch.tensor([float(prompt_tokens)]))
        crops_scores = s1.crops_log_probs[0]
        grid = guarded = None
        if self.cost.guard is not None:  # among the crops with a configuration expected to fit
            grid = self.cost.grid(lang, tiling_crops, float(budget_ms), prompt_tokens=prompt_tokens)
            guarded = grid.over((self.controller.max_crops_values, self.controller.top_k_values,
                                 self.controller.num_active_blocks_values))
            crops_scores = crops_scores.masked_fill(~guarded.crops_allowed, float("-inf"))
        c, pi = int(crops_scores.argmax()), int(s1.insertion_log_probs[0].argmax())
        return Stage1Choice(self.controller.max_crops_values[c], self.controller.insertion_positions[pi],
                            s1.budget_token[0], "controller", (s1, c, pi, guarded), cost_grid=grid)

    @torch.no_grad()
    def stage2(self, choice: Stage1Choice, inputs: Stage2Inputs) -> tuple[int, int]:
        s1, c, pi, guarded = choice.state
        assert isinstance(s1, Stage1Output) and inputs.latency_token is not None
        image, present = _image(inputs.image_feature, self.image_dim)
        top_k_lp, blocks_lp = self.controller.stage2(s1, image, present, torch.tensor([c]), torch.tensor([pi]),
                                                     inputs.latency_token[None].float().cpu())
        if guarded is not None:
            k, b = guarded_stage2(top_k_lp[0], blocks_lp[0], guarded.allowed[c], guarded.expected_ms[c])
        else:
            k, b = int(top_k_lp[0].argmax()), int(blocks_lp[0].argmax())
        return self.controller.top_k_values[k], self.controller.num_active_blocks_values[b]


class FixedKnobs:
    """The knobs a request set itself; checked against the model's ranges."""

    phase = "request"
    controller_run = "request"
    reads_prompt_tokens = False

    def __init__(self, knobs: dict[str, int], num_experts: int, num_layers: int, max_crops_limit: int,
                 cost: MachineCost) -> None:
        limits = {"max_crops": max_crops_limit, "top_k": num_experts, "num_active_blocks": num_layers}
        for name, limit in limits.items():
            if not 1 <= knobs[name] <= limit:
                msg = f"`knobs.{name}` must be in 1..{limit} for this model, got {knobs[name]}"
                raise RequestError(400, msg, f"knobs.{name}", "invalid_value")
        self.knobs = knobs
        self.cost = cost  # the server's: its requests still tell the machine's scale
        self.max_crops_values = (knobs["max_crops"],)
        self.budget_range_ms = (0.0, 0.0)
        self.reference_latency_ms: dict[Config, float] = {}

    def stage1(self, lang: torch.Tensor, tiling_crops: torch.Tensor, budget_ms: float) -> Stage1Choice:
        return Stage1Choice(self.knobs["max_crops"], 0, None, "request")

    def stage2(self, choice: Stage1Choice, inputs: Stage2Inputs) -> tuple[int, int]:
        return self.knobs["top_k"], self.knobs["num_active_blocks"]



class CheapestConfig:
    """The configuration with the smallest reference latency, for a budget below all of them: no
    configuration is expected to fit, so the request takes the one that misses by the least. The
    controller is never asked: below its training range its choices are extrapolation."""

    phase = "offline"
    reads_prompt_tokens = False

    def __init__(self, decider: RequestDecider) -> None:
        reference = decider.reference_latency_ms
        self.cost = decider.cost
        self.config = min(reference, key=lambda c: (reference[c], c))
        self.controller_run = decider.controller_run
        self.max_crops_values = (self.config[0],)
        self.budget_range_ms = decider.budget_range_ms
        self.reference_latency_ms = reference
        self.below_ms = reference[self.config]

    def stage1(self, lang: torch.Tensor, tiling_crops: torch.Tensor, budget_ms: float) -> Stage1Choice:
        return Stage1Choice(self.config[0], 0, None, "cheapest")

    def stage2(self, choice: Stage1Choice, inputs: Stage2Inputs) -> tuple[int, int]:
        return self.config[1], self.config[2]



def reference_latencies(deployed: Any) -> dict[Config, float]:
    """The deployed controller's median training latency per configuration (empty for a file without
    ``reference_latency_ms``, or a controller without a table fallback)."""
    reference = getattr(deployed, "reference_latency_ms", None)
    if reference is None or reference.numel() == 0:
        return {}
    return {(int(c), int(k), int(b)): float(ms) for (c, k, b), ms in zip(deployed.actions.tolist(), reference.tolist())
            if ms == ms}  # NaN: never recorded in training


@dataclass(frozen=True)
class ControllerSource:
    """The file a ``--controller`` value names, checked intact."""

    path: Path
    run: RunDir | None  # the run it is a checkpoint of; None for a file named directly


def find_controller(workspace: Workspace, spec: str) -> ControllerSource:
    """The file of ``spec`` (a run id or directory, ``latest``, a checkpoint or exported file): an online
    run's kept controller (``RunDir.controller_checkpoint``), an offline run's best; refused with one
    line when there is none yet or when it fails its CRC check
    (:func:`serve.startup.check_controller_file`). Reads no weights: the server calls it before the
    model loads."""
    path = Path(spec).expanduser()
    if path.is_file():
        check_controller_file(path)
        return ControllerSource(path, None)
    run = RunDir.resolve(workspace, spec, ("offline", "online"))
    if run.phase == "online" and not run.controller_checkpoint.exists():
        msg = f"{run.last_checkpoint} does not exist: the online run saved no checkpoint yet"
        raise CtrlError(msg)
    if run.phase != "online" and not run.best_checkpoint.exists():
        msg = (f"{run.best_checkpoint} does not exist: the run has not finished an epoch\n"
               "Hint: resume it with `ctrl train --offline --resume RUN`.")
        raise CtrlError(msg)
    source = ControllerSource(run.controller_checkpoint, run)
    check_controller_file(source.path)
    return source


def load_decider(source: ControllerSource, model_fingerprint: str) -> OfflineDecider | OnlineDecider:
    """The controller of ``source`` (:func:`find_controller`), refused with one line when it was
    trained on another model's features."""
    if source.run is None:
        return _from_file(source.path, model_fingerprint)
    if source.run.phase == "online":
        return OnlineDecider(TwoStageController.load(source.path, model_fingerprint), source.run.run_id,
                             load_run_guard(source.run.path))
    return _offline(source.path, model_fingerprint, source.run.run_id)


def _offline(checkpoint: Path, model_fingerprint: str, name: str) -> OfflineDecider:
    policy = ControllerPolicy.load(checkpoint, model_fingerprint, offline_only=True)
    return OfflineDecider(DeployedController(policy, read_fallback(checkpoint)), name)


def _from_file(path: Path, model_fingerprint: str) -> OfflineDecider | OnlineDecider:
    try:
        payload = read_checkpoint(path)
    except CtrlError:
        payload = None
    if payload is not None:
        if "two_stage" in payload:
            return OnlineDecider(TwoStageController.load(path, model_fingerprint), path.name)
        return _offline(path, model_fingerprint, path.name)
    if path.suffix == ".pt2":
        msg = (f"{path}: a compiled package (`ctrl export --compiled`) decides both stages in one call\n"
               "Hint: serve the TorchScript file of `ctrl export RUN --out FILE.pt`, or the run itself.")
        raise CtrlError(msg)
    try:
        deployed = load_deployed(path)
    except Exception as exc:  # torch.jit raises many types for a foreign file: one line here
        msg = (f"{path}: neither a ctrl checkpoint nor a file written by `ctrl export` "
               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        raise CtrlError(msg) from None
    exported_for = str(deployed.model_fingerprint)
    if exported_for != model_fingerprint:
        msg = (f"{path}: exported for model {exported_for[:16]}, but the server runs model {model_fingerprint[:16]}\n"
               "Hint: serve the model the controller was trained on (--model, --dtype and, for MolmoE on a GPU, "
               "--float32-attention as its features were extracted), or export a run trained on it.")
        raise CacheMismatchError(msg)
    return OfflineDecider(deployed, path.name)
