"""``ctrl train --online``: GRPO with the real model in the loop (``origin_formats.md`` §7.3-7.7).

Each step draws ``samples_per_step`` training samples, each with a budget drawn uniformly from
the budget range; per (sample, budget) group the controller samples ``group_size`` knob
settings, the model runs them (``online.rollout``), the answers are scored
(``online.metrics``), the measured latencies and scores become rewards (``trainer.reward``,
the same definition as offline: one request's total latency, here with the controller's
own time inside), and the controller takes one GRPO step with group-relative advantages
(``trainer.grpo.group_advantages``).

A run lives in ``workspace/runs/<run_id>/``::

    config.json                       the resolved OnlineTrainConfig (phase "online")
    run.parquet                       one row (view ``runs``)
    online_steps.parquet              one row per step (view ``online_steps``)
    rollouts/step-NNNNNN.parquet      every rollout (views ``rollouts`` and ``measurements``)
    checkpoints/last.pt               controller + optimizer + step (``--resume``)

Budget range: the latencies of this machine, not the offline data's. Unless given, it is
calibrated at the start (``calibrate_budget_range``): the fastest and the slowest configuration
run on a few training samples; continuing an offline run, each end of that run's range is
scaled by the median ratio of measured to recorded latency of its configuration on those
samples, else the range is [p95 of the fastest, p95 of the slowest]. The controller's budget
encoder is re-normalised over it, so an offline policy's "tight" and "loose" budgets keep
their meaning.

Distributed (``torchrun``; gloo on CPU, nccl on CUDA): every rank samples the same stage-1
choices, runs the members m with m % world_size == rank, the rollouts are all-gathered so
every rank computes the same advantages, and DDP averages the gradients.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from online.distributed import init_distributed_from_env
from pipeline.errors import CtrlError
from pipeline.workspace import Workspace, atomic_path, write_bytes_atomic
from trainer.reward import RewardConfig

LAST = "last.pt"
_PARTS = ("acc_term", "lat_pen", "viol_pen", "complexity", "bonus")


@dataclass
class OnlineTrainConfig:
    """Options of ``ctrl train --online``.

    > Model and data
    workspace: workspace directory (None = ``$CTRL_WORKSPACE`` or ``./workspace``); its samples
        need features of ``model`` (``ctrl extract-features``).
    model: "embedded" or a local model directory. device: "cpu", "cuda", "cuda:1", ...
    images_dir: where images are found by image_id (None = the paths recorded by extract-features).
    importance_scores: a §6 importance file for the block choice (None = the default rule).

    > Start
    from_run: an offline (or online) run id / directory to continue from; "latest" = the most
        recent offline run of the workspace (default); ignored with ``fresh``.
    fresh: start from an untrained controller (bool, default False).

    > Rollouts
    steps: optimizer steps (int, default 20). samples_per_step: groups per step (default 2).
    group_size: rollouts per group, G (int >= 2, default 5, origin).
    max_new_tokens: generation cap per rollout (int, default 16, exp5's cap).
    budget_min_ms, budget_max_ms: budget range on this machine (None = calibrated, see module doc).
    calibration_samples: training samples the calibration runs on (default 16).
    warmup: run each configuration once unmeasured before its first measured run (default True).
    threads: torch intra-op threads on CPU (default 1; 0 = torch's setting): with more threads
        than free cores, spinning threads make measured latencies slow and noisy.

    > Optimisation and reward
    lr: AdamW learning rate (default 3e-4). weight_decay: 1e-5. max_grad_norm: 1.0 (None = off).
    scale_rewards: "group" | "batch" | "none" (``trainer.grpo.group_advantages``; default "batch").
    reward: a RewardConfig or dict; None = the offline run's reward (fresh: hard mode).
    seed: seeds the controller init, sample order, budgets and sampling (default 42).

    > Runs
    evaluate: after the last step, evaluate the run with the model on the test split against its
        offline start (``online.evaluate``; default True).
    eval_max_samples: test samples the final evaluation runs (default None: all of the test split).
    checkpoint_every: steps between checkpoints (default 5; the last step always saves).
    run_id: run directory name (None = timestamp + random suffix).
    resume: an online run to continue from its last checkpoint (``steps`` may grow; the device
        and the evaluation options may differ, everything else comes from the run's config.json).
    """

    workspace: Path | None = None
    model: str = "embedded"
    device: str = "cpu"
    images_dir: Path | None = None
    importance_scores: Path | None = None
    from_run: str | None = "latest"
    fresh: bool = False
    steps: int = 20
    samples_per_step: int = 2
    group_size: int = 5
    max_new_tokens: int = 16
    budget_min_ms: float | None = None
    budget_max_ms: float | None = None
    calibration_samples: int = 16
    warmup: bool = True
    threads: int = 1
    lr: float = 3e-4
    weight_decay: float = 1e-5
    max_grad_norm: float | None = 1.0
    scale_rewards: str = "batch"
    reward: RewardConfig | dict | None = None
    seed: int = 42
    evaluate: bool = True
    eval_max_samples: int | None = None
    checkpoint_every: int = 5
    run_id: str | None = None
    resume: str | None = None
    # filled in by the run (config.json records them)
    parent_run_id: str | None = field(default=None, repr=False)
    model_fingerprint: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("samples_per_step", 1), ("group_size", 2), ("max_new_tokens", 1),
                          ("calibration_samples", 1), ("checkpoint_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"`lr` must be > 0, got {self.lr!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"`max_grad_norm` must be > 0 or None, got {self.max_grad_norm!r}")
        if (self.budget_min_ms is None) != (self.budget_max_ms is None):
            raise ValueError("pass both budget_min_ms and budget_max_ms, or neither (calibrated)")
        if self.budget_min_ms is not None and not self.budget_max_ms > self.budget_min_ms > 0:
            raise ValueError(f"budget range must satisfy 0 < min < max, got {self.budget_min_ms!r}..{self.budget_max_ms!r}")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"`scale_rewards` must be 'group', 'batch' or 'none', got {self.scale_rewards!r}")
        if isinstance(self.reward, dict):
            self.reward = RewardConfig.from_json(self.reward)
        for name in ("workspace", "images_dir", "importance_scores"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                setattr(self, name, Path(value))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reward"] = self.reward.to_json() if isinstance(self.reward, RewardConfig) else None
        for name in ("workspace", "images_dir", "importance_scores"):
            out[name] = None if out[name] is None else str(out[name])
        return {"phase": "online", **out}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> OnlineTrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class OnlineRunResult:
    run_id: str
    run_dir: Path
    checkpoint: Path
    steps: Any  # polars.DataFrame of online_steps
    budget_range_ms: tuple[float, float]
    controller: Any = None  # the trained TwoStageController (this rank's copy)
    evaluation: Any = None  # polars.DataFrame of the final evaluation (rank 0, with evaluate)


# -- helpers ----------------------------------------------------------------------------------

def _seeded(*parts: int) -> torch.Generator:
    """A generator seeded from integers: every step's randomness is a function of (seed, step),
    so a resumed run draws exactly what the uninterrupted one would have."""
    value = 0
    for p in parts:
        value = (value * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def _step_groups(train_rows: list[int], step: int, samples_per_step: int, seed: int,
                 budget_range: tuple[float, float]) -> list[tuple[int, float]]:
    """The (sample, budget) groups of a step: epochs over a seeded permutation of the train rows."""
    n = len(train_rows)
    groups = []
    budgets = torch.rand(samples_per_step, generator=_seeded(seed, 2, step))
    lo, hi = budget_range
    for j in range(samples_per_step):
        i = (step - 1) * samples_per_step + j
        perm = torch.randperm(n, generator=_seeded(seed, 1, i // n))
        groups.append((train_rows[int(perm[i % n])], float(lo + (hi - lo) * budgets[j])))
    return groups


def _write_table(rows: list[dict], schema: Any, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{c: r.get(c) for c in schema.column_names} for r in rows], schema=schema.arrow_schema())
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _steps_frame(rows: list[dict]) -> Any:
    import polars as pl
    import pyarrow as pa

    from pipeline.schema import ONLINE_STEPS

    return pl.from_arrow(pa.Table.from_pylist([{c: r.get(c) for c in ONLINE_STEPS.column_names} for r in rows],
                                              schema=ONLINE_STEPS.arrow_schema()))


# -- the run ----------------------------------------------------------------------------------

def _build_controller(config: OnlineTrainConfig, workspace: Workspace, runtime: Any, samples: Any,
                      budget_range: tuple[float, float]) -> tuple[Any, RewardConfig, str | None]:
    """The controller to train (from an offline/online run, or fresh), its reward and parent run id."""
    from trainer.offline import resolve_checkpoint, resolve_run_dir
    from trainer.policy import (
        ControllerPolicy,
        PolicyConfig,
        budget_normalization_range,
    )
    from trainer.two_stage import TwoStageConfig, TwoStageController, set_budget_range

    two_stage = TwoStageConfig(hidden_size=runtime.hidden_size, token_scale=runtime.embedding_rms(),
                               num_layers=runtime.num_layers)
    reward = config.reward if isinstance(config.reward, RewardConfig) else None
    parent: str | None = None
    run_dir = None
    if not config.fresh:
        try:
            run_dir = resolve_run_dir(workspace, config.from_run or "latest")
        except CtrlError as err:
            if (config.from_run or "latest") != "latest":
                raise
            raise CtrlError(f"workspace {workspace.root} has no offline run to continue from\n"
                            "Hint: run `ctrl train --offline` first, or pass --fresh.") from err
    if run_dir is not None:
        parent = run_dir.name
        run_cfg = json.loads((run_dir / "config.json").read_text())
        if run_cfg.get("phase") == "online":
            checkpoint = run_dir / "checkpoints" / LAST
            controller = TwoStageController.load(checkpoint, runtime.fingerprint)
        else:
            checkpoint = resolve_checkpoint(workspace, run_dir)
            policy = ControllerPolicy.load(checkpoint, runtime.fingerprint)
            controller = TwoStageController(policy, two_stage)
        if reward is None and isinstance(run_cfg.get("reward"), dict):
            reward = RewardConfig.from_json(run_cfg["reward"])
    else:
        from trainer.data import ActionSpace

        torch.manual_seed(config.seed)
        lo, hi = budget_normalization_range(*budget_range)
        policy_config = PolicyConfig(lang_feature_dim=samples.lang.shape[1], image_feature_dim=samples.image.shape[1],
                                     budget_min_ms=lo, budget_max_ms=hi)
        import itertools

        from pipeline import knobs

        sweep = itertools.product(knobs.BALANCED_MAX_CROPS, knobs.BALANCED_TOP_K, knobs.BALANCED_NUM_ACTIVE_BLOCKS)
        policy = ControllerPolicy(policy_config, ActionSpace(tuple(sweep)), runtime.fingerprint)
        train = samples.rows("train") or list(range(len(samples)))
        policy.set_feature_normalization(samples.image[train], samples.image_present[train], samples.lang[train])
        controller = TwoStageController(policy, two_stage)
    set_budget_range(controller.policy, *budget_normalization_range(*budget_range))
    return controller, reward or RewardConfig(mode="hard"), parent


def calibration_configs(controller: Any) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Knob indices (crops, insertion, top-K, blocks) of the fastest and the slowest configuration."""
    c_lo, c_hi = 0, len(controller.max_crops_values) - 1
    positions = controller.insertion_positions
    valid = controller.blocks_valid
    fastest_p = next(i for i in range(len(positions)) if bool(valid[i, 0])) if bool(valid[:, 0].any()) else 0
    b_lo = int(valid[fastest_p].float().argmax())
    fastest = (c_lo, fastest_p, 0, b_lo)
    slowest_p = next(i for i in range(len(positions)) if bool(valid[i, -1]))
    slowest = (c_hi, slowest_p, len(controller.top_k_values) - 1, valid.shape[1] - 1)
    return fastest, slowest


def calibrate_budget_range(executor: Any, controller: Any, rows: list[int],
                           reference: BudgetReference | None = None) -> tuple[float, float]:
    """The budget range on this machine, measured with the fastest and the slowest configuration on ``rows``.

    Each configuration runs twice per sample, the two configurations alternating so that they see
    the same machine. With a ``reference`` (the parent offline run's range and the recorded
    latencies of these samples), each end of that offline range is scaled by its own
    configuration's speed ratio here: the median over ``rows`` of measured / recorded latency of
    the same sample and configuration (the low end by the fastest configuration's, the high end
    by the slowest's: the offline ends are statistics of those two). The pairing cancels what
    makes samples differ (answer length above all), so a few samples suffice; a ratio per end,
    not one for both, because the two-stage request adds a roughly constant cost (controller,
    split prefill) that weighs more on fast configurations (~25 % at the fastest, ~5 % at the
    slowest on the testbed). Without a reference (fresh runs, nothing recorded): [p95 of the
    fastest, p95 of the slowest].
    """
    import numpy as np

    configs = dict(zip(("fastest", "slowest"), calibration_configs(controller)))
    # medians of all runs, not minima: the range must hold for typical requests, and this
    # shared 2-core VM drifts by up to ~20 % within seconds
    runs: dict[str, list] = {name: [] for name in configs}
    for _ in range(2):
        for name, force in configs.items():
            runs[name].extend(executor.run_fixed(rows, force))
    lat, ratio = {}, {}
    for name, out in runs.items():
        lat[name] = np.array([r.latency_total_ms for r in out])
        if reference is not None:
            knobs = (out[0].max_crops, out[0].top_k, out[0].num_active_blocks)
            recorded = np.array([reference.recorded_ms(row, knobs) for row in rows] * 2)
            ok = np.isfinite(recorded) & (recorded > 0)
            if ok.any():
                ratio[name] = float(np.median(lat[name][ok] / recorded[ok]))
    if len(ratio) == 2:
        lo, hi = reference.range_ms[0] * ratio["fastest"], reference.range_ms[1] * ratio["slowest"]
    else:
        lo, hi = float(np.quantile(lat["fastest"], 0.95)), float(np.quantile(lat["slowest"], 0.95))
    if not hi > lo * 1.05:  # the knobs barely move latency here: still give the budget some range
        hi = lo * 1.5
    return round(lo, 1), round(hi, 1)


@dataclass
class BudgetReference:
    """What the calibration compares with: an offline run's budget range and the recorded latencies.

    range_ms: the offline run's training budget range (its config.json). ``recorded_ms(row,
    (max_crops, top_k, num_active_blocks))``: the ``groups`` view's latency of online sample
    ``row`` under that configuration (NaN where not recorded).
    """

    range_ms: tuple[float, float]
    latency_ms: dict[tuple[str, str, int, int, int], float]
    keys: list[tuple[str, str]]

    def recorded_ms(self, row: int, knobs: tuple[int, int, int]) -> float:
        return self.latency_ms.get((*self.keys[row], *knobs), float("nan"))


def budget_reference(workspace: Workspace, runtime: Any, samples: Any, parent_config: dict) -> BudgetReference | None:
    """The reference for an offline parent run (None when the workspace recorded no latencies)."""
    from trainer.data import load_offline_data

    try:
        data = load_offline_data(workspace, runtime.fingerprint)
    except CtrlError:
        return None
    actions = data.action_space.actions
    latency: dict[tuple[str, str, int, int, int], float] = {}
    wanted = set(zip(samples.dataset, samples.sample_key))
    for i, key in enumerate(zip(data.dataset, data.sample_key)):
        if key in wanted:
            row = data.latency_ms[i].tolist()
            for a, knobs in enumerate(actions):
                latency[(*key, *knobs)] = row[a]
    if not latency:
        return None
    return BudgetReference(range_ms=(float(parent_config["budget_min_ms"]), float(parent_config["budget_max_ms"])),
                           latency_ms=latency, keys=list(zip(samples.dataset, samples.sample_key)))


def train_online(config: OnlineTrainConfig, progress: Callable[[dict], None] | None = None, *,
                 runtime: Any = None) -> OnlineRunResult:
    """Run (or resume) an online training run; returns its directory and per-step metrics."""
    from online.timing import cpu_threads

    with cpu_threads(config.threads, config.device):
        return _train_online(config, progress, runtime)


def _train_online(config: OnlineTrainConfig, progress: Callable[[dict], None] | None, runtime: Any) -> OnlineRunResult:
    import polars as pl

    from features.model import load_runtime
    from online.data import load_online_samples
    from online.rollout import RolloutExecutor
    from pipeline.schema import ONLINE_STEPS, ROLLOUTS
    from trainer.grpo import group_advantages
    from trainer.offline import new_run_id, resolve_run_dir
    from trainer.reward import compute_reward
    from trainer.two_stage import TwoStageController

    dist = init_distributed_from_env(config.device)
    if config.samples_per_step * config.group_size < dist.world_size:
        raise CtrlError(f"{config.samples_per_step} groups x {config.group_size} rollouts per step leave some of the "
                        f"{dist.world_size} ranks without work\nHint: raise --samples-per-step or --group-size.")
    workspace = Workspace(config.workspace)
    started = time.perf_counter()
    created_at = datetime.now(timezone.utc)
    resume_state: dict | None = None
    if config.resume is not None:
        run_dir = resolve_run_dir(workspace, config.resume)
        saved = json.loads((run_dir / "config.json").read_text())
        if saved.get("phase") != "online":
            raise CtrlError(f"--resume {run_dir.name}: not an online run\nHint: offline runs resume with "
                            "`ctrl train --offline --resume`; `--from RUN` starts an online run from one.")
        # everything but the step count comes from the run's config.json (the run stays one experiment)
        # (device, threads and the final evaluation are not part of the experiment: taken from this call)
        keep = {k: getattr(config, k) for k in ("steps", "device", "threads", "evaluate", "eval_max_samples")}
        config = OnlineTrainConfig.from_json(saved)
        for k, v in keep.items():
            setattr(config, k, v)
        config.resume = str(run_dir)
        checkpoint = run_dir / "checkpoints" / LAST
        if not checkpoint.exists():
            raise CtrlError(f"{checkpoint} does not exist: the run saved no checkpoint yet\nHint: start it again.")
        resume_state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        run_id = run_dir.name
    else:
        run_id = dist.broadcast(config.run_id or new_run_id())
        run_dir = workspace.runs_dir / run_id
        if (run_dir / "config.json").exists():
            raise CtrlError(f"run {run_id} already exists in {workspace.runs_dir}\nHint: --resume {run_id} continues it.")

    runtime = runtime if runtime is not None else load_runtime(config.model, config.device, config.importance_scores)
    device = runtime.device
    samples = load_online_samples(workspace, runtime.fingerprint, config.images_dir)
    train_rows = samples.rows("train") or list(range(len(samples)))

    if resume_state is not None:
        controller = TwoStageController.load(run_dir / "checkpoints" / LAST, runtime.fingerprint)
        budget_range = (float(config.budget_min_ms), float(config.budget_max_ms))
        reward = config.reward if isinstance(config.reward, RewardConfig) else RewardConfig.from_json(config.reward)
        parent = config.parent_run_id
    else:
        budget_range = (config.budget_min_ms, config.budget_max_ms)
        controller = None
        if budget_range[0] is None:
            # a provisional controller, only to run forced configurations for the calibration
            provisional, _, parent_id = _build_controller(config, workspace, runtime, samples, (1.0, 2.0))
            reference = None
            if parent_id is not None:
                parent_cfg = json.loads((resolve_run_dir(workspace, parent_id) / "config.json").read_text())
                if parent_cfg.get("phase", "offline") == "offline":
                    reference = budget_reference(workspace, runtime, samples, parent_cfg)
            executor = RolloutExecutor(runtime, provisional, samples, config.max_new_tokens, config.warmup)
            try:
                if progress:
                    progress({"phase": "calibrate", "samples": min(config.calibration_samples, len(train_rows))})
                budget_range = dist.broadcast(calibrate_budget_range(executor, provisional,
                                                                     train_rows[: config.calibration_samples],
                                                                     reference))
            finally:
                executor.close()
        controller, reward, parent = _build_controller(config, workspace, runtime, samples, budget_range)
        config = OnlineTrainConfig.from_json({**config.to_json(), "budget_min_ms": budget_range[0],
                                              "budget_max_ms": budget_range[1], "reward": reward.to_json(),
                                              "parent_run_id": parent, "model_fingerprint": runtime.fingerprint,
                                              "run_id": run_id, "resume": None})
        if dist.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(run_dir / "config.json", (json.dumps(config.to_json(), indent=2) + "\n").encode())
        dist.barrier()

    controller.to(device)
    controller.train()
    model: Any = controller
    if dist.active:
        model = torch.nn.parallel.DistributedDataParallel(controller)  # every parameter takes part in the loss
    optimizer = torch.optim.AdamW(controller.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    rows: list[dict] = []
    start_step = 1
    if resume_state is not None:
        optimizer.load_state_dict(resume_state["optimizer"])
        rows = list(resume_state["metrics_rows"])
        start_step = int(resume_state["step"]) + 1
        created_at = datetime.fromisoformat(resume_state["created_at"])
        if dist.rank == 0:  # rollouts written after the checkpoint are redone
            for path in (run_dir / "rollouts").glob("step-*.parquet"):
                if int(path.stem.split("-")[1]) >= start_step:
                    path.unlink()

    run_row = {"run_id": run_id, "phase": "online", "parent_run_id": parent, "created_at": created_at,
               "status": "running", "steps": start_step - 1, "loss_type": "grpo", "seed": config.seed,
               "model_fingerprint": runtime.fingerprint, "workspace": str(workspace.root),
               "num_train_samples": len(train_rows), "budget_min_ms": budget_range[0], "budget_max_ms": budget_range[1]}
    if dist.rank == 0:
        _write_run_row(run_dir, run_row)
    executor = RolloutExecutor(runtime, controller, samples, config.max_new_tokens, config.warmup)
    def knob_tensor(r: dict) -> list[float]:
        return [float(r["max_crops"]), float(r["top_k"]), float(r["num_active_blocks"])]
    step = start_step - 1
    try:
        for step in range(start_step, config.steps + 1):
            groups = _step_groups(train_rows, step, config.samples_per_step, config.seed, budget_range)
            first_group = (step - 1) * config.samples_per_step
            local = executor.run_groups(groups, config.group_size, _seeded(config.seed, 3, step),
                                        _seeded(config.seed, 4, step, dist.rank), dist.rank, dist.world_size,
                                        first_group=first_group)
            tick = time.perf_counter()
            mine = [_rollout_row(r, samples, run_id, step, dist.world_size, runtime.num_layers) for r in local.rollouts]
            parts_by_rank = dist.all_gather((mine, len(local.prefix_embeds)))
            gathered = [row for rows_of_rank, _ in parts_by_rank for row in rows_of_rank]
            num_prefixes = sum(n for _, n in parts_by_rank)
            gathered.sort(key=lambda r: (r["group_index"], r["member"]))
            parts = compute_reward(torch.tensor([r["score"] for r in gathered]),
                                   torch.tensor([r["latency_total_ms"] for r in gathered]),
                                   torch.tensor([r["budget_ms"] for r in gathered]),
                                   torch.tensor([knob_tensor(r) for r in gathered]), reward)
            rewards = parts["reward"].reshape(len(groups), config.group_size)
            advantages, valid = group_advantages(rewards, config.scale_rewards)
            for i, r in enumerate(gathered):
                r["reward"] = float(parts["reward"][i])
            bookkeeping = time.perf_counter() - tick

            tick = time.perf_counter()
            log_probs = model(local.batch(samples, device, executor.tiling_crops), runtime.latency_token)
            own = torch.tensor([[r.group - first_group, r.member] for r in local.rollouts], dtype=torch.long)
            own_adv = advantages[own[:, 0], own[:, 1]].to(device)
            own_valid = valid[own[:, 0]].to(device)
            denom = max(int(valid.sum()) * config.group_size, 1)
            # DDP averages gradients over ranks: scale so the result is the mean over all valid members
            loss = -(own_adv * log_probs * own_valid).sum() * dist.world_size / denom
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(controller.parameters(),
                                                       config.max_grad_norm or float("inf"))
            optimizer.step()
            update = time.perf_counter() - tick

            tick = time.perf_counter()
            # each rank's loss is scaled by world_size for DDP's gradient averaging: their mean is the loss
            total_loss = sum(dist.all_gather(float(loss.detach()))) / dist.world_size
            row = {"run_id": run_id, "step": step, "loss": total_loss,
                   "reward/mean": float(parts["reward"].mean()),
                   **{f"reward/{p}": float(parts[p].mean()) for p in _PARTS},
                   "accuracy": float(torch.tensor([r["score"] for r in gathered]).mean()),
                   "latency_ms_mean": float(torch.tensor([r["latency_total_ms"] for r in gathered]).mean()),
                   "violation_rate": float(torch.tensor([r["violated"] for r in gathered], dtype=torch.float).mean()),
                   "controller_ms_mean": float(torch.tensor([r["latency_controller_ms"] for r in gathered]).mean()),
                   "groups": len(groups), "zero_variance_groups": int((~valid).sum()), "rollouts": len(gathered),
                   "prefixes": num_prefixes, "grad_norm": float(grad_norm),
                   "time_model_s": local.model_s, "time_controller_s": local.controller_s, "time_update_s": update}
            if dist.rank == 0:
                _write_table(gathered, ROLLOUTS, run_dir / "rollouts" / f"step-{step:06d}.parquet")
            row["time_bookkeeping_s"] = bookkeeping + time.perf_counter() - tick
            row["wall_time_s"] = time.perf_counter() - started
            rows.append(row)
            if dist.rank == 0 and (step % config.checkpoint_every == 0 or step == config.steps):
                _save_last(run_dir / "checkpoints" / LAST, controller, optimizer, step, rows, created_at)
                # the metrics file always matches the checkpoint (a resumed run rewrites it consistently)
                _write_table(rows, ONLINE_STEPS, run_dir / "online_steps.parquet")
                run_row.update(steps=step, wall_time_s=time.perf_counter() - started)
                _write_run_row(run_dir, run_row)
                row["time_bookkeeping_s"] = bookkeeping + time.perf_counter() - tick  # the checkpoint included
            if progress:
                progress({"phase": "step", "step": step, "steps": config.steps, **row})
    except BaseException as err:
        if dist.rank == 0:
            run_row.update(status="interrupted" if isinstance(err, KeyboardInterrupt) else "failed",
                           finished_at=datetime.now(timezone.utc), wall_time_s=time.perf_counter() - started)
            _write_run_row(run_dir, run_row)
        raise
    finally:
        executor.close()
    if dist.rank == 0:
        _write_table(rows, ONLINE_STEPS, run_dir / "online_steps.parquet")
        run_row.update(status="completed", steps=step, finished_at=datetime.now(timezone.utc),
                       wall_time_s=time.perf_counter() - started)
        _write_run_row(run_dir, run_row)
    evaluation = None
    if config.evaluate and dist.rank == 0:
        from online.evaluate import evaluate_online_run

        if progress:
            progress({"phase": "evaluate"})
        evaluation = evaluate_online_run(workspace, run_dir, max_samples=config.eval_max_samples, runtime=runtime)
    dist.barrier()
    return OnlineRunResult(run_id=run_id, run_dir=run_dir, checkpoint=run_dir / "checkpoints" / LAST,
                           steps=_steps_frame(rows) if rows else pl.DataFrame(), budget_range_ms=budget_range,
                           controller=controller, evaluation=evaluation)


def _rollout_row(r: Any, samples: Any, run_id: str, step: int, world_size: int, num_layers: int) -> dict:
    """A rollout as a ``rollouts`` row (measurements columns + online columns)."""
    return {
        "experiment": "online", "dataset": samples.dataset[r.sample], "split": samples.split[r.sample],
        "sample_key": samples.sample_key[r.sample], "max_crops": r.max_crops, "top_k": r.top_k,
        "num_active_blocks": r.num_active_blocks, "tier": None, "num_crops": r.num_crops,
        "num_total_blocks": num_layers, "active_block_indices": list(r.active_blocks),
        "score": r.score, "pred": r.pred, "latency_total_ms": r.latency_total_ms,
        "latency_prefill_ms": r.latency_prefill_ms, "latency_decode_ms": r.latency_decode_ms,
        "latency_vision_ms": r.latency_vision_ms, "latency_prefill_raw_ms": None,
        "num_vision_tokens": r.num_vision_tokens, "num_text_tokens": r.num_text_tokens,
        "num_output_tokens": r.num_output_tokens, "world_size": world_size,
        "source_file": f"runs/{run_id}/rollouts/step-{step:06d}.parquet", "source_kind": "online", "num_copies": 1,
        "flag_prefill_invalid": False, "flag_prefill_partial": False, "flag_text_tokens_derived": False,
        "flag_decode_missing": False, "flag_partial_config": False, "flag_copies_disagree": False,
        "run_id": run_id, "step": step, "group_index": r.group, "member": r.member, "rank": r.rank,
        "insertion_position": r.insertion_position, "budget_ms": r.budget_ms,
        "latency_controller_ms": r.latency_controller_ms, "latency_stage1_ms": r.latency_stage1_ms,
        "latency_stage2_ms": r.latency_stage2_ms, "latency_decode_step_ms": list(r.decode_step_ms),
        "reward": None, "violated": bool(r.latency_total_ms > r.budget_ms), "log_prob": r.log_prob,
        "generated_text": r.text,
    }


def _save_last(path: Path, controller: Any, optimizer: Any, step: int, rows: list[dict], created_at: datetime) -> None:
    controller.save(path, extra={"optimizer": optimizer.state_dict(), "step": step, "metrics_rows": rows,
                                 "created_at": created_at.isoformat()})


def _write_run_row(run_dir: Path, row: dict) -> None:
    from pipeline.schema import RUNS

    _write_table([row], RUNS, run_dir / "run.parquet")
