"""The options of ``ctrl train --online`` (and of the evaluation of an online run)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from runtime.precision import check_dtype_name
from trainer.config import TrainingConfig, check_int


@dataclass
class OnlineTrainConfig(TrainingConfig):
    """Options of ``ctrl train --online``; the shared ones are documented on ``TrainingConfig``.

    Online defaults: ``lr`` 3e-4; ``reward`` None = the parent run's reward (fresh: hard mode);
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
        recent offline run of the workspace (default); ignored with ``fresh``.
    fresh: start from an untrained controller (bool, default False).
    parent_run_id: filled in by the run: the run it continued from (None: fresh).

    > Rollouts
    steps: optimizer steps (int, default 20). samples_per_step: groups per step (default 2).
    max_new_tokens: generation cap per rollout (int, default 16, exp5's cap).
    calibration_samples: training samples the budget calibration runs on (default 16).
    warmup: run each configuration once unmeasured before its first measured run (default True).
    threads: torch intra-op threads on CPU (default 1; 0 = torch's setting): with more threads
        than free cores, spinning threads make measured latencies slow and noisy.

    > Runs
    evaluate: after the last step, evaluate the run with the model on the test split against its
        offline start (``online.evaluate``; default True).
    eval_max_samples: test samples the final evaluation runs (default None: all of the test split).
    checkpoint_every: steps between checkpoints (default 5; the last step always saves).

    ``resume`` continues an online run from its last checkpoint: ``steps`` may grow, the device,
    threads and evaluation options may differ, everything else comes from the run's config.json.
    """

    lr: float = 3e-4
    model: str = "embedded"
    device: str = "cpu"
    dtype: str = "auto"
    images_dir: Path | None = None
    importance_scores: Path | None = None
    from_run: str | None = "latest"
    fresh: bool = False
    parent_run_id: str | None = None
    steps: int = 20
    samples_per_step: int = 2
    max_new_tokens: int = 16
    calibration_samples: int = 16
    warmup: bool = True
    threads: int = 1
    evaluate: bool = True
    eval_max_samples: int | None = None
    checkpoint_every: int = 5

    #: what a resumed run takes from the call instead of the run's config.json (not part of the experiment)
    PER_CALL: ClassVar[tuple[str, ...]] = ("steps", "device", "threads", "evaluate", "eval_max_samples")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("steps", 1), ("samples_per_step", 1), ("max_new_tokens", 1), ("calibration_samples", 1),
                          ("checkpoint_every", 1)):
            check_int(name, getattr(self, name), low)
        if (self.budget_min_ms is None) != (self.budget_max_ms is None):
            msg = "pass both budget_min_ms and budget_max_ms, or neither (calibrated)"
            raise ValueError(msg)
        check_dtype_name(self.dtype)
        for name in ("images_dir", "importance_scores"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                setattr(self, name, Path(value))

    def to_json(self) -> dict[str, Any]:
        return {"phase": "online", **super().to_json()}
