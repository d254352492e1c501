"""trainer: the controller policy, its reward, offline GRPO, evaluation against baselines, prediction.

Reads the workspace through ``pipeline``'s public readers (views ``groups``, ``lang_features``,
``image_features``) and writes runs to ``workspace/runs/<run_id>/`` (``trainer.runs``). Imports
torch: ``cli.py`` imports this package inside the command bodies that need it.
"""

from trainer.baselines import (
    Decider,
    FamilyLookupTableDecider,
    LargestDecider,
    LookupTableDecider,
    OracleDecider,
    RandomDecider,
)
from trainer.config import OfflineTrainConfig, TrainingConfig
from trainer.data import (
    Action,
    ActionSpace,
    OfflineData,
    budget_grid,
    default_budget_range,
    load_offline_data,
    split_of,
)
from trainer.evaluate import (
    EVALUATION_COLUMNS,
    default_budget_grid,
    evaluate_deciders,
    evaluate_run,
    evaluation_title,
    format_evaluation_table,
    write_evaluation,
)
from trainer.fallback import PolicyDecider, TableFallback, fit_table_fallback, read_fallback
from trainer.grpo import GroupSamples, LossOutput, group_advantages, pairwise_objective, policy_loss, sample_groups
from trainer.offline import OfflineTrainer, train_offline
from trainer.policy import ControllerPolicy, PolicyConfig, budget_normalization_range, expected_reward
from trainer.predict import PREDICTION_COLUMNS, predict
from trainer.reward import REWARD_PARTS, RewardConfig, compute_reward
from trainer.run_record import RunResult
from trainer.runs import RunDir, latest_run, resolve_checkpoint

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
    "predict",
    "PREDICTION_COLUMNS",
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
    "Decider",
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
