"""``ctrl train``: GRPO offline on the recorded configurations, or online with the model in the loop."""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any

import typer

from cli.common import Bar, app, err, handled, out, running, say
from cli.options import config_parameters, with_parameters
from online.train_options import PHASES, TRAIN_OPTIONS, train_option_help
from trainer.progress import ProgressUpdate


def _train_parameters() -> list[inspect.Parameter]:
    """Every ``ctrl train`` option, from the config field it sets (the phase's that has it)."""
    return [p for option in TRAIN_OPTIONS.values()
            for p in config_parameters(PHASES[option.phases()[0]], [option.name], not_given=True,
                                       help_of=train_option_help, field_of={option.name: option.field},
                                       overrides={option.name: dict(option.cli)})]


def _show(bar: Bar, update: ProgressUpdate | None) -> None:
    """A progress update on the terminal: the bar's text and position, a line above it."""
    if update is None:
        return
    if update.line is not None:
        err.print(update.line, highlight=False, markup=False, soft_wrap=True)
    if update.info is not None or update.completed is not None or update.total is not None:
        bar.update(completed=update.completed, total=update.total, info=update.info)


@app.command()
@with_parameters(_train_parameters())
def train(
    offline: Annotated[bool, typer.Option("--offline/--online", help="Offline GRPO on the recorded configurations, "
                                          "or online GRPO running the model.")] = True,
    **options: Any,
) -> None:
    """Train the knob controller with GRPO: --offline on the recorded configuration groups (then
    evaluate), or --online with the model in the loop (hook-measured latency, scored answers).
    Options of the other phase are refused; with --resume only the options a resumed run may
    change are accepted (docs/cli.md)."""
    import os

    from online.train_options import train_config

    phase = "offline" if offline else "online"
    with handled(also=(ValueError,)):
        config = train_config(phase, options)
    if config.resume is None and config.run_id is None and os.environ.get("WORLD_SIZE", "1") == "1":
        from dataclasses import replace

        from trainer.runs import new_run_id

        config = replace(config, run_id=new_run_id())  # named now, so that messages can say how to resume it
    if offline:
        _train_offline(config)
    else:
        _train_online(config)


def _train_offline(config: Any) -> None:
    from trainer import evaluation_title, read_fallback, train_offline
    from trainer.progress import cost_model_line, offline_progress
    from trainer.request_cost import REQUEST_COST_CHECK

    run = config.resume or config.run_id or "RUN"
    with running("train", interrupted=f"resume with --resume {run} (the last finished epoch is checkpointed)",
                 resume=f"ctrl train --offline --resume {run} (the last finished epoch is checkpointed)",
                 also=(ValueError,), counts=False) as bar:
        result = train_offline(config, progress=lambda event: _show(bar, offline_progress(event)))
    say(f"run {result.run_id}: best epoch {result.best_epoch}, validation expected reward "
        f"{result.initial_val_expected_reward:.4f} -> {result.best_val_expected_reward:.4f}; {result.run_dir}")
    fallback = read_fallback(result.best_checkpoint)
    if fallback is not None:
        say(fallback.describe())
    check = result.run_dir / REQUEST_COST_CHECK
    if check.exists():
        say(cost_model_line(json.loads(check.read_text())))
    if result.evaluation is not None:
        from trainer.evaluate import format_summary_table, summarize_evaluation

        title = evaluation_title(result.run_dir).replace("evaluation", "summary", 1)
        out.print(format_summary_table(summarize_evaluation(result.evaluation, fallback), title))
        say(f"every decider: `ctrl evaluate {result.run_id}`; plot: {result.run_dir / 'evaluation.png'}")
    say(f"next: `ctrl predict --run {result.run_id} --budget-ms 200 --out decisions.parquet`, or "
        f"`ctrl query \"FROM evaluations WHERE run_id = '{result.run_id}'\"`")


def _train_online(config: Any) -> None:
    import os

    from online import train_online
    from online.progress import online_progress
    from runtime.distributed import current_dist
    from trainer import format_evaluation_table

    # under torchrun, rank 0 shows the progress and reports
    run = config.resume or config.run_id or "RUN"
    with running("online", interrupted=f"continue with --online --resume {run} (from its last checkpoint)",
                 resume=f"ctrl train --online --resume {run} (from its last checkpoint)",
                 also=(ValueError,), show=os.environ.get("RANK", "0") == "0") as bar:
        bar.update(total=config.steps, info="starting")

        result = train_online(config, progress=lambda event: _show(bar, online_progress(event)))
    if current_dist().rank != 0:
        return
    if result.evaluation is not None:
        out.print(format_evaluation_table(result.evaluation))
    frame = result.steps
    lo, hi = result.budget_range_ms
    if len(frame):
        first, last = frame.head(max(1, len(frame) // 4)), frame.tail(max(1, len(frame) // 4))

        def change(column: str, fmt: str) -> str:
            return f"{first[column].mean():{fmt}} -> {last[column].mean():{fmt}}"

        say(f"online run {result.run_id}: {len(frame)} steps, budget range {lo:.1f}-{hi:.1f} ms; "
            f"first/last quarter: reward {change('reward/mean', '.3f')}, accuracy {change('accuracy', '.3f')}, "
            f"violations {change('violation_rate', '.0%')}, latency {change('latency_ms_mean', '.0f')} ms; "
            f"{result.run_dir}")
        if result.kept is not None:
            k = result.kept
            say(f"kept: the start (no check found a better controller); {result.checkpoint}" if k.step == 0 else
                f"kept: step {k.step}, held-out gain over the start {k.gain:+.3f} [{k.gain_low:+.3f}, "
                f"{k.gain_high:+.3f}]; {result.checkpoint}")
        say(f"next: `ctrl evaluate {result.run_id}` (measured, paired with its offline start), the steps in "
            f"`ctrl query \"FROM online_steps WHERE run_id = '{result.run_id}'\"`, every rollout in view rollouts")
