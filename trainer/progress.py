"""What an offline training run's progress events say: the line a terminal's progress bar shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProgressUpdate:
    """A progress event as a terminal shows it: the bar's text and position, and a line to print
    above the bar (None: nothing of that kind)."""

    info: str | None = None
    completed: int | None = None
    total: int | None = None
    line: str | None = None


def offline_progress(event: dict[str, Any]) -> ProgressUpdate | None:
    """The update of one ``train_offline`` progress event (None: an event the bar ignores)."""
    phase = event.get("phase")
    if phase == "train":
        val = event.get("val_expected_reward")
        shown = f"{val:.3f}" if val is not None else "-"
        return ProgressUpdate(
            completed=event.get("step", 0), total=event.get("total_steps"),
            info=f"epoch {event.get('epoch')} loss {event.get('loss', float('nan')):.4f} "
                 f"reward {event.get('reward', float('nan')):.3f} val E[r] {shown}")
    if phase == "fold":
        return ProgressUpdate(info=f"cross-fitting: fold {event['fold']} of {event['num_folds']}, "
                                   f"epoch {event.get('epoch', 0)}")
    if phase == "fit":  # a model fitted before the first step (the cost model takes seconds at full width)
        return ProgressUpdate(info=f"fitting the {event['model']}")
    if phase == "evaluate":
        return ProgressUpdate(info="evaluating")
    return None


def cost_model_line(event: dict[str, Any]) -> str:
    """The per-request cost model's check on held-out latencies (a run's ``request_cost.json``), and what
    the profile could not model."""
    n = int(event.get("num_measurements") or 0)
    if n == 0:
        text = "request cost model: no held-out per-sample latency with a known tiling to check it on"
    else:
        text = (f"request cost model: median |error| {event['median_abs_error']:.1%} of the val split's latencies, "
                f"its p{round(100 * event['quantile'])} covers {event['coverage']:.1%} ({n:,} measurements)")
    missing = event.get("unmodelled") or []
    if missing:
        text += f"; the profile has no {', no '.join(missing)}: not modelled (each request's is read as the profile's)"
    return text
