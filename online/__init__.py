"""online: the controller trained and evaluated with the model in the loop.

Each request runs the two-stage controller inside the model's prefill (``online.rollout``),
its latency is measured with hooks and its answer scored; GRPO updates the controller
(``online.train``). ``online.evaluate`` measures a run against its offline start; the budget
range of the machine comes from ``online.calibrate``.
"""

from online.config import OnlineTrainConfig
from online.evaluate import evaluate_online_run
from online.train import OnlineRunResult, OnlineTrainer, train_online

__all__ = ["OnlineRunResult", "OnlineTrainConfig", "OnlineTrainer", "evaluate_online_run", "train_online"]
