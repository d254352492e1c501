"""The options of ``ctrl train --online`` (and of the evaluation of an online run)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pipeline.execution import ExecutionOptions, check_dtype_name, execution_field
from pipeline.options import auto_or_count, option
from trainer.config import TrainingConfig, check_int
from trainer.reward import RewardConfig


@dataclass
class OnlineTrainConfig(TrainingConfig):
    """Options of ``ctrl train --online``; the shared ones are documented on ``TrainingConfig``.

    Each option's default and one-line help are on its field (``ctrl train --help``, docs/cli.md).
    ``reward`` None = the parent run's reward (fresh: hard mode);
    ``budget_min_ms`` / ``budget_max_ms`` both None = calibrated on this machine
    (``online.calibrate``), or both given; ``model_fingerprint`` is filled in by the run (the
    model being run; its features must be cached).

    > Model and data
    model: "embedded", "testbed", a local model directory or a Hugging Face id (``runtime.registry``).
    device: "cpu", "cuda", "cuda:1", ...
    dtype: the dtype the model's weights are held in (``runtime.precision``; "auto": float32 on a
        CPU, bfloat16 on a GPU). The run records the dtype it resolved to, and its features must be
        those of that dtype (extract-features with the same ``--dtype``); a resumed run and the
        evaluation of a run keep it.
    images_dir: where images are found by image_id (None = the paths recorded by extract-features).
    importance_scores: an importance file (docs/origin_format.md §6) for the block choice (None = the default rule).

    > Start
    from_run: an offline (or online) run id / directory to continue from; "latest" = the most
        recent offline run of the workspace; ignored with ``fresh``.
    fresh: start from an untrained controller (bool).
    parent_run_id: filled in by the run: the run it continued from (None: fresh).

    > Rollouts
    steps: optimizer steps (int). samples_per_step: groups per step.
    max_new_tokens: generation cap per rollout (int).
    calibration_samples: training samples the budget calibration runs on (a draw with ``seed``).
    guard_samples: training samples every configuration runs on once to fit the latency guard
        (``controller.latency_guard``: what each configuration is expected to take on this machine, per request;
        greedy decisions, the held-out checks' and the evaluation's, keep to the configurations
        expected to fit). 0: no guard. Needs a parent offline run with an outcome model.
    warmup: run each configuration once unmeasured before its first measured run.
    rollout_batch: "1" runs each rollout alone; "N" (N > 1) runs a step's rollouts batched, N rows a
        pass after their prefixes, the suffix and decode latencies of those not timed alone from a
        latency model fit on those that were (``online.rollout``, docs/online.md); "auto": as many
        rows as fit where the runtime batches (faster on a CPU too, docs/results.md), else 1.
    threads: torch intra-op threads on CPU: with more threads
        than free cores, spinning threads make measured latencies slow and noisy.
    fast_path, float32_attention: the execution path of the model (``OlmoeDecoderRuntime.set_execution``);
        like the device, a resumed run may change them.

    > Held-out checks (``online.check``)
    check_every: steps between checks of the latest controller against the run's start, paired on
        validation samples; the run keeps (``best.pt``, what ``ctrl serve`` and ``ctrl evaluate``
        take) the start until a check finds a controller that beats it, then the best one found.
        0: no checks, the run's controller is its last step.
    check_samples: validation samples per check. check_budgets: budgets per check, over the range.
    patience: stop once this many checks in a row found nothing better than the kept controller
        (0: run every step).

    > Runs
    evaluate: after the last step, evaluate the run with the model on the test split against its
        offline start (``online.evaluate``).
    eval_max_samples: test samples the final evaluation runs.
    checkpoint_every: steps between checkpoints.

    ``resume`` continues an online run from its last checkpoint: ``steps`` may grow, the device,
    threads and evaluation options may differ, everything else comes from the run's config.json.
    """

    lr: float = option(3e-4, help="AdamW learning rate.")
    reward: RewardConfig | None = option(None, help="Reward mode: hard (the score within the budget, -1 beyond) "
                                                    "or soft (docs/origin_format.md §7.5).",
                                         shown_default="the parent run's (fresh: hard)")
    model: str = option("embedded", help="'embedded', 'testbed' (the trained testbed), a local model directory or "
                                         "a Hugging Face id in the local cache.")
    device: str = execution_field("device")
    dtype: str = execution_field("dtype", more_help="The features must be of the same dtype.")
    images_dir: Path | None = option(None, help="Image directory.", shown_default="the paths extract-features recorded")
    importance_scores: Path | None = option(None, help="Block importance file (docs/origin_format.md §6).",
                                            shown_default="the default rule")
    from_run: str | None = option("latest", help="Offline (or online) run to continue from; 'latest' = the newest "
                                                 "offline run.")
    fresh: bool = option(False, help="Start from an untrained controller instead of a run.")
    parent_run_id: str | None = option(None, help="Filled in by the run: the run it continued from.")
    steps: int = option(20, help="Online optimizer steps (on --resume: train the run longer).")
    samples_per_step: int = option(2, help="(sample, budget) groups per online step.")
    max_new_tokens: int = option(16, help="Generation cap per rollout.")
    calibration_samples: int = option(32, help="Training samples the budget calibration runs on, drawn with --seed "
                                               "(without a given range).")
    guard_samples: int = option(8, help="Training samples every configuration runs on once to fit the latency "
                                        "guard, which holds greedy decisions to the configurations expected to "
                                        "fit the budget on this machine (0 = no guard).")
    warmup: bool = option(True, help="Run each configuration once unmeasured before its first measured run.")
    rollout_batch: str = option("auto", help="Rows of a batched rollout pass: 1 = every rollout alone and timed; "
                                             "N > 1 = a step's rollouts batched after their prefixes, the suffix "
                                             "and decode latencies of those not timed alone from a latency model; "
                                             "auto = as many as fit where the model runs batches, else 1.")
    threads: int = execution_field("threads")
    fast_path: bool = execution_field("fast_path")
    float32_attention: bool = execution_field("float32_attention")
    evaluate: bool = option(True, help="Evaluate with the model on the test split at the end.")
    eval_max_samples: int | None = option(None, help="Test samples of the final evaluation.", shown_default="all")
    checkpoint_every: int = option(5, help="Steps between checkpoints.")
    check_every: int = option(10, help="Steps between held-out checks: the latest controller against the run's start, "
                                       "paired on validation samples; the run keeps the better one (0 = no checks: "
                                       "the last step's controller).")
    check_samples: int = option(16, help="Validation samples per held-out check.")
    check_budgets: int = option(3, help="Budgets per held-out check, evenly spaced over the budget range.")
    patience: int = option(2, help="Stop once this many held-out checks in a row found nothing better than the kept "
                                   "controller (0 = run every step).")

    #: what a resumed run takes from the call instead of the run's config.json (not part of the experiment)
    PER_CALL: ClassVar[tuple[str, ...]] = ("steps", "device", "threads", "evaluate", "eval_max_samples", "report_to",
                                           "fast_path", "float32_attention", "patience", "rollout_batch")
    #: config.json keys of runs written before an option's rename, and their names now
    RENAMED: ClassVar[dict[str, str]] = {"compile": "fast_path"}

    @property
    def execution(self) -> ExecutionOptions:
        return ExecutionOptions.of(self)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("steps", 1), ("samples_per_step", 1), ("max_new_tokens", 1), ("calibration_samples", 1),
                          ("guard_samples", 0),
                          ("checkpoint_every", 1), ("check_every", 0), ("check_samples", 1),
                          ("check_budgets", 1), ("patience", 0)):
            check_int(name, getattr(self, name), low)
        if (self.budget_min_ms is None) != (self.budget_max_ms is None):
            msg = "pass both budget_min_ms and budget_max_ms, or neither (calibrated)"
            raise ValueError(msg)
        check_dtype_name(self.dtype)
        self.rollout_batch = auto_or_count("rollout_batch", self.rollout_batch)
        for name in ("images_dir", "importance_scores"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                setattr(self, name, Path(value))

    def to_json(self) -> dict[str, Any]:
        return {"phase": "online", **super().to_json()}
