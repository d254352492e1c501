"""The options of ``ctrl train`` for both phases, each said once: on its config field.

An option of the command sets one field of :class:`trainer.config.OfflineTrainConfig`, of
:class:`online.config.OnlineTrainConfig` or of both. Its help and default come from that field
(``trainer.config.option``); the command's own defaults are all None ("not given"), so the
config's default is the one that applies, per phase. :func:`train_config` builds the config of
one call from the options given:

* an option of the other phase only is refused with one line (``--online --hidden-dim 32``);
* with ``--resume``, the run's saved options apply; an option given with it is applied when a
  resumed run may change it (offline: ``--num-epochs``; online: ``--steps``, ``--device``,
  ``--threads``, ``--fast-path``, ``--float32-attention``, ``--evaluate``, ``--eval-max-samples``,
  ``--patience``, ``--rollout-batch``; both:
  ``--report-to``), accepted when it
  equals the run's value, and refused with one line otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from online.config import OnlineTrainConfig
from pipeline.errors import CtrlError
from pipeline.options import option_default, option_help
from pipeline.workspace import Workspace
from trainer.config import OfflineTrainConfig, TrainingConfig
from trainer.reward import RewardConfig

PHASES: dict[str, type[TrainingConfig]] = {"offline": OfflineTrainConfig, "online": OnlineTrainConfig}

#: what a resumed run may change, per phase (the rest of the experiment is the run's config.json)
RESUMABLE = {"offline": ("num_epochs", "report_to"), "online": OnlineTrainConfig.PER_CALL}


def _same(value: Any) -> Any:
    return value


def _on_off(value: bool) -> str:
    return "on" if value else "off"


#: the ``--help`` sections of the options of one phase or purpose
REWARD, ONLINE = "Reward and loss", "Online"


@dataclass(frozen=True)
class TrainOption:
    """One option of ``ctrl train``: its parameter name, the config field it sets and how, and its
    command-line form where the field's own does not fit both phases (``cli``: the keys of
    ``pipeline.options.option``: flags, panel, min, max; ``type``: the command-line type)."""

    name: str  # the command's parameter (``--num-epochs`` -> num_epochs)
    field: str  # the config field
    to_field: Callable[[Any], Any] = _same  # option value -> field value
    cli: Mapping[str, Any] = field(default_factory=dict)

    @property
    def flag(self) -> str:
        flags = self.cli.get("flags") or _field_flags(self)
        return flags[0].split("/")[0] if flags else "--" + self.name.replace("_", "-")

    def phases(self) -> tuple[str, ...]:
        return tuple(p for p, cls in PHASES.items() if any(f.name == self.field for f in fields(cls)))

    def help(self) -> str:
        """The field's help, then the default of each phase it applies to."""
        phases = self.phases()
        cls = PHASES[phases[0]]
        defaults = {p: option_default(PHASES[p], self.field) for p in phases}
        shown = {p: _on_off(d) if isinstance(d, bool) else ("none" if d is None else d) for p, d in defaults.items()}
        if len(phases) == 1:
            return f"{option_help(cls, self.field)} ({phases[0]} only; default: {shown[phases[0]]})"
        if len(set(map(str, shown.values()))) == 1:
            return f"{option_help(cls, self.field)} (default: {shown[phases[0]]})"
        return f"{option_help(cls, self.field)} (default: " + "; ".join(f"{p} {d}" for p, d in shown.items()) + ")"


TRAIN_OPTIONS: dict[str, TrainOption] = {o.name: o for o in (
    TrainOption("workspace", "workspace"),
    TrainOption("model_fingerprint", "model_fingerprint"),
    TrainOption("num_epochs", "num_epochs", cli={"min": 1}),
    TrainOption("group_size", "group_size", cli={"min": 2}),
    TrainOption("batch_size", "batch_size", cli={"min": 1}),
    TrainOption("lr", "lr"),
    TrainOption("seed", "seed"),
    TrainOption("budget_min_ms", "budget_min_ms"),
    TrainOption("budget_max_ms", "budget_max_ms"),
    TrainOption("report_to", "report_to"),
    TrainOption("calibration_samples", "calibration_samples", cli={"min": 1, "panel": ONLINE}),
    TrainOption("guard_samples", "guard_samples", cli={"min": 0, "panel": ONLINE}),
    TrainOption("reward_mode", "reward", lambda mode: RewardConfig(mode=mode), cli={"type": str, "panel": REWARD}),
    TrainOption("score_target", "score_target", cli={"panel": REWARD}),
    TrainOption("warm_start_steps", "warm_start_steps", cli={"min": 0, "panel": REWARD}),
    TrainOption("warm_start_target", "warm_start_target", cli={"panel": REWARD}),
    TrainOption("loss_type", "loss_type", cli={"panel": REWARD}),
    TrainOption("scale_rewards", "scale_rewards", cli={"panel": REWARD}),
    TrainOption("clip_epsilon", "clip_epsilon", cli={"panel": REWARD}),
    TrainOption("kl_beta", "kl_beta", cli={"panel": REWARD}),
    TrainOption("violation_target", "violation_target", lambda v: v or None,
                cli={"min": 0.0, "max": 0.99, "panel": REWARD}),
    TrainOption("no_table_fallback", "disable_table_fallback",
                cli={"flags": ("--no-table-fallback/--table-fallback",), "panel": REWARD}),
    TrainOption("fallback_confidence", "fallback_confidence", cli={"min": 0.5, "max": 0.999, "panel": REWARD}),
    TrainOption("fallback_prefers", "fallback_prefers", cli={"panel": REWARD}),
    TrainOption("fallback_table", "fallback_table", cli={"panel": REWARD}),
    TrainOption("fallback_request_table", "fallback_request_table",
                cli={"flags": ("--fallback-request-table/--no-fallback-request-table",), "panel": REWARD}),
    TrainOption("ignore_family_labels", "ignore_family_labels",
                cli={"flags": ("--ignore-family-labels",), "panel": REWARD}),
    TrainOption("latency_jitter", "latency_jitter", cli={"min": 0.0, "panel": REWARD}),
    TrainOption("cross_fit_folds", "cross_fit_folds", cli={"min": 0, "panel": REWARD}),
    TrainOption("holdout_dataset", "holdout_dataset"),
    TrainOption("use_tilings", "use_tilings", cli={"flags": ("--use-tilings/--no-tilings",)}),
    TrainOption("request_cost_input", "request_cost_input",
                cli={"flags": ("--request-cost-input/--no-request-cost-input",)}),
    TrainOption("hidden_dim", "hidden_dim", cli={"min": 8}),
    TrainOption("run_id", "run_id"),
    TrainOption("resume", "resume"),
    # online
    TrainOption("from_run", "from_run", cli={"flags": ("--from",), "panel": ONLINE}),
    TrainOption("fresh", "fresh", cli={"flags": ("--fresh",), "panel": ONLINE}),
    TrainOption("model", "model", cli={"panel": ONLINE}),
    TrainOption("images", "images_dir", cli={"panel": ONLINE}),
    TrainOption("steps", "steps", cli={"min": 1, "panel": ONLINE}),
    TrainOption("samples_per_step", "samples_per_step", cli={"min": 1, "panel": ONLINE}),
    TrainOption("max_new_tokens", "max_new_tokens", cli={"min": 1, "panel": ONLINE}),
    TrainOption("device", "device", cli={"panel": ONLINE}),
    TrainOption("dtype", "dtype", cli={"panel": ONLINE}),
    TrainOption("checkpoint_every", "checkpoint_every", cli={"min": 1, "panel": ONLINE}),
    TrainOption("online_evaluate", "evaluate", cli={"flags": ("--evaluate/--no-evaluate",), "panel": ONLINE}),
    TrainOption("eval_max_samples", "eval_max_samples", cli={"min": 1, "panel": ONLINE}),
    TrainOption("check_every", "check_every", cli={"min": 0, "panel": ONLINE}),
    TrainOption("check_samples", "check_samples", cli={"min": 1, "panel": ONLINE}),
    TrainOption("check_budgets", "check_budgets", cli={"min": 1, "panel": ONLINE}),
    TrainOption("patience", "patience", cli={"min": 0, "panel": ONLINE}),
    TrainOption("threads", "threads", cli={"panel": ONLINE}),
    TrainOption("fast_path", "fast_path", cli={"panel": ONLINE}),
    TrainOption("float32_attention", "float32_attention", cli={"panel": ONLINE}),
    TrainOption("rollout_batch", "rollout_batch", cli={"panel": ONLINE}),
)}


def _field_flags(option: TrainOption) -> tuple[str, ...] | None:
    cls = PHASES[option.phases()[0]]
    return next(f.metadata.get("flags") for f in fields(cls) if f.name == option.field)


def train_option_help(name: str) -> str:
    """The ``--help`` text of one ``ctrl train`` option."""
    return TRAIN_OPTIONS[name].help()


def train_config(phase: str, given: Mapping[str, Any]) -> TrainingConfig:
    """The config of one ``ctrl train`` call from the options given (None = not given)."""
    if phase not in PHASES:
        msg = f"phase must be 'offline' or 'online', got {phase!r}"
        raise ValueError(msg)
    values: dict[str, Any] = {}
    for name, value in given.items():
        if value is None:
            continue
        option = TRAIN_OPTIONS[name]
        if phase not in option.phases():
            other = option.phases()[0]
            msg = (f"{option.flag} applies to `ctrl train --{other}` only, not --{phase}\n"
                   f"Hint: leave it out, or train with --{other}.")
            raise CtrlError(msg)
        values[option.field] = option.to_field(value)
    cls = PHASES[phase]
    if values.get("resume") is None:
        return cls(**values)
    return _resumed(phase, values)


def _resumed(phase: str, values: dict[str, Any]) -> TrainingConfig:
    """The saved config of the run to resume, with the given options it may change."""
    from trainer.runs import RunDir  # torch: `ctrl --help` imports this module for the options' help

    run = RunDir.resolve(Workspace(values.get("workspace")), values["resume"])
    if run.phase != phase:
        msg = (f"--resume {run.run_id}: an {run.phase} run, resumed with `ctrl train --{run.phase} --resume`\n"
               f"Hint: --from {run.run_id} starts an online run from it.")
        raise CtrlError(msg)
    saved = run.read_config()
    try:
        saved_config = PHASES[phase].from_json({**saved, "resume": None})
    except (TypeError, ValueError) as err:  # a config.json edited or damaged into other fields/values
        msg = f"{run.config_path}: not a valid {phase} run config ({err})"
        raise CtrlError(msg) from None
    changes = {}
    for name, value in values.items():
        if name in ("workspace", "resume") or name in RESUMABLE[phase]:
            changes[name] = value
            continue
        before = getattr(saved_config, name)
        if value != before:
            flag = next(o.flag for o in TRAIN_OPTIONS.values() if o.field == name)
            allowed = ", ".join(next(o.flag for o in TRAIN_OPTIONS.values() if o.field == f) for f in RESUMABLE[phase])
            msg = (f"{flag} cannot change when resuming run {run.run_id} (it trained with {before!r}, given "
                   f"{value!r}); a resumed run may change only {allowed}\n"
                   "Hint: leave it out to resume, or start a new run with it.")
            raise CtrlError(msg)
    if phase == "offline":
        return OfflineTrainConfig.from_run(run.path, values.get("workspace"),
                                           **{k: v for k, v in changes.items() if k not in ("workspace", "resume")})
    return OnlineTrainConfig.from_json({**saved, **{k: v for k, v in changes.items() if k != "resume"},
                                        "workspace": values.get("workspace"), "resume": str(run.path)})
