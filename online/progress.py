"""What an online training run's progress events say: the bar's text, and the lines printed above it."""

from __future__ import annotations

from typing import Any

from trainer.progress import ProgressUpdate


def online_progress(event: dict[str, Any]) -> ProgressUpdate | None:
    """The update of one ``train_online`` progress event (None: an event the terminal ignores)."""
    phase = event.get("phase")
    if phase == "calibrate":
        return ProgressUpdate(info=f"calibrating the budget range on {event.get('samples')} samples")
    if phase == "guard_progress":
        return ProgressUpdate(info=f"latency guard: configuration {event['done']} of {event['total']}")
    if phase == "guarded":
        ratios = ", ".join(f"{stage} x{ratio:.2f}" for stage, ratio in event["stage_ratios"].items())
        spread = event.get("spread") or {}
        read = (f"; predicted by the {event['predictor'].replace('_', ' ')} model (p95/p50 "
                + ", ".join(f"{name.replace('_', ' ')} x{value:.2f}" for name, value in sorted(spread.items())) + ")"
                if spread else "")
        return ProgressUpdate(line=f"latency guard: {ratios} against the profile, slack x{event['slack']:.2f} "
                                   f"({event['requests']} requests){read}")
    if phase == "evaluate":
        return ProgressUpdate(info="evaluating on the test split with the model")
    if phase == "step":
        return ProgressUpdate(completed=event["step"], total=event["steps"],
                              info=f"reward {event['reward/mean']:.3f} acc {event['accuracy']:.3f} "
                                   f"latency {event['latency_ms_mean']:.0f} ms viol {event['violation_rate']:.0%}")
    if phase == "checking":
        return ProgressUpdate(info=f"held-out check after step {event['step']}: {event['pairs']} paired requests")
    if phase == "check":
        kept = "the start" if event["kept_step"] == 0 else f"step {event['kept_step']}"
        waiting = (f" ({event['since']} of {event['patience']} checks without a better one)"
                   if event["since"] and event["patience"] else "")
        return ProgressUpdate(line=f"step {event['step']}: held-out gain over the start {event['gain']:+.3f} "
                                   f"[{event['gain_low']:+.3f}, {event['gain_high']:+.3f}] on {event['requests']} "
                                   f"paired requests, late {event['late_share']:.0%} (start "
                                   f"{event['start_late_share']:.0%}); kept: {kept}{waiting}")
    if phase == "stop":
        return ProgressUpdate(line=f"stopping after step {event['step']} of {event['steps']}: {event['patience']} "
                                   "held-out checks in a row found nothing better (--patience 0 runs every step)")
    if phase == "no_checks":
        return ProgressUpdate(line=f"no held-out checks: {event['reason']}; the run's controller is its last step")
    return None
