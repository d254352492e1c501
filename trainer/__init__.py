"""trainer: the controller policy, its reward, offline GRPO, evaluation against baselines.

Reads the workspace through ``pipeline``'s public readers (views ``groups``, ``lang_features``,
``image_features``) and writes runs to ``workspace/runs/<run_id>/`` (``trainer.runs``). Imports
torch when a name of it is first used (``trainer.config`` alone does not).
"""

from importlib import import_module
from typing import Any

#: public name -> its module; imported on first use, so that reading a config (``ctrl --help``
#: reads the options' help from ``trainer.config``) does not load torch
_EXPORTS = {
    "BatchDecider": "trainer.baselines",
    "FamilyLookupTableDecider": "trainer.baselines",
    "LargestDecider": "trainer.baselines",
    "LookupTableDecider": "trainer.baselines",
    "OracleDecider": "trainer.baselines",
    "RandomDecider": "trainer.baselines",
    "OfflineTrainConfig": "trainer.config",
    "TrainingConfig": "trainer.config",
    "Action": "trainer.data",
    "ActionSpace": "trainer.data",
    "OfflineData": "trainer.data",
    "budget_grid": "trainer.data",
    "default_budget_range": "trainer.data",
    "load_offline_data": "trainer.data",
    "split_of": "trainer.data",
    "EVALUATION_COLUMNS": "trainer.evaluate",
    "default_budget_grid": "trainer.evaluate",
    "evaluate_deciders": "trainer.evaluate",
    "evaluate_run": "trainer.evaluate",
    "evaluation_title": "trainer.evaluate",
    "format_evaluation_table": "trainer.evaluate",
    "write_evaluation": "trainer.evaluate",
    "PolicyDecider": "trainer.fallback",
    "TableFallback": "trainer.fallback",
    "fit_table_fallback": "trainer.fallback",
    "read_fallback": "trainer.fallback",
    "GroupSamples": "trainer.grpo",
    "LossOutput": "trainer.grpo",
    "group_advantages": "trainer.grpo",
    "pairwise_objective": "trainer.grpo",
    "policy_loss": "trainer.grpo",
    "sample_groups": "trainer.grpo",
    "OfflineTrainer": "trainer.offline",
    "train_offline": "trainer.offline",
    "ControllerPolicy": "trainer.policy",
    "PolicyConfig": "trainer.policy",
    "budget_normalization_range": "trainer.policy",
    "expected_reward": "trainer.policy",
    "REWARD_PARTS": "trainer.reward",
    "RewardConfig": "trainer.reward",
    "compute_reward": "trainer.reward",
    "RunResult": "trainer.run_record",
    "RunDir": "trainer.runs",
    "latest_run": "trainer.runs",
    "resolve_checkpoint": "trainer.runs",
}

__all__ = [
    # configs
    "TrainingConfig",
    "OfflineTrainConfig",
    "PolicyConfig",
    "RewardConfig",
    # runners
    "train_offline",
    "OfflineTrainer",
    "RunResult",
    "evaluate_run",
    "evaluation_title",
    # runs on disk
    "RunDir",
    "latest_run",
    "resolve_checkpoint",
    # policy and loss
    "ControllerPolicy",
    "PolicyDecider",
    "expected_reward",
    "budget_normalization_range",
    "GroupSamples",
    "LossOutput",
    "sample_groups",
    "group_advantages",
    "pairwise_objective",
    "policy_loss",
    # data and reward
    "Action",
    "ActionSpace",
    "OfflineData",
    "load_offline_data",
    "split_of",
    "default_budget_range",
    "budget_grid",
    "compute_reward",
    "REWARD_PARTS",
    # deployment: the lookup table where the controller does not beat it on held-out data
    "TableFallback",
    "fit_table_fallback",
    "read_fallback",
    # evaluation
    "BatchDecider",
    "OracleDecider",
    "LookupTableDecider",
    "FamilyLookupTableDecider",
    "LargestDecider",
    "RandomDecider",
    "evaluate_deciders",
    "write_evaluation",
    "format_evaluation_table",
    "default_budget_grid",
    "EVALUATION_COLUMNS",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module 'trainer' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)
