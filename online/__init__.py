"""online: the controller trained and evaluated with the model in the loop.

Each request runs the two-stage controller inside the model's prefill (``online.rollout``),
its latency is measured with hooks and its answer scored; GRPO updates the controller
(``online.train``). ``online.evaluate`` measures a run against its offline start; the budget
range of the machine comes from ``online.calibrate``.
"""

from importlib import import_module
from typing import Any

#: public name -> its module; imported on first use, so that reading a config (``ctrl --help``
#: reads the options' help from ``online.config``) does not load the model code and torch
_EXPORTS = {
    "OnlineTrainConfig": "online.config",
    "evaluate_online_run": "online.evaluate",
    "OnlineRunResult": "online.train",
    "OnlineTrainer": "online.train",
    "train_online": "online.train",
}

__all__ = ["OnlineRunResult", "OnlineTrainConfig", "OnlineTrainer", "evaluate_online_run", "train_online"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module 'online' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)
