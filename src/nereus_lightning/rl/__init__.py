"""RL algorithms (a registry: PPO, GRPO, RLOO, REINFORCE++, ReMax, yours), losses, rewards and tasks.

Pure torch on one process; the Lightning strategy distributes the stage functions.
"""

from nereus_lightning.rl.advantages import (
    apply_kl_penalty,
    gae_advantages,
    grpo_advantages,
    masked_var,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    returns_to_go,
    rloo_advantages,
    scores_to_token_rewards,
)
from nereus_lightning.rl.algorithm import (
    RLConfig,
    RLModels,
    batch_metrics,
    compute_advantages,
    rollout,
    score_batch,
    update_actor,
    update_critic,
)
from nereus_lightning.rl.batch import RolloutBatch, dp_slice
from nereus_lightning.rl.estimators import Algorithm, algorithm_of, register_algorithm
from nereus_lightning.rl.forward import (
    response_log_probs,
    response_span,
    response_values,
)
from nereus_lightning.rl.losses import (
    POLICY_LOSSES,
    agg_loss,
    entropy_from_logits,
    entropy_loss,
    gspo_policy_loss,
    kl_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
    register_policy_loss,
    token_log_probs,
    value_loss,
)
from nereus_lightning.rl.reward import FunctionReward, ModelReward, RewardScorer, make_scorer
from nereus_lightning.rl.tasks import PromptSampler, RepeatTask, TaskPrompt, repeat_reward
from nereus_lightning.rl.tokenizer import ByteTokenizer

__all__ = [
    "Algorithm",
    "POLICY_LOSSES",
    "algorithm_of",
    "register_algorithm",
    "register_policy_loss",
    "rloo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "gspo_policy_loss",
    "RLConfig",
    "RLModels",
    "batch_metrics",
    "compute_advantages",
    "rollout",
    "score_batch",
    "update_actor",
    "update_critic",
    "ByteTokenizer",
    "FunctionReward",
    "ModelReward",
    "PromptSampler",
    "RepeatTask",
    "RewardScorer",
    "RolloutBatch",
    "TaskPrompt",
    "agg_loss",
    "apply_kl_penalty",
    "dp_slice",
    "entropy_from_logits",
    "entropy_loss",
    "gae_advantages",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "make_scorer",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "remax_advantages",
    "repeat_reward",
    "response_log_probs",
    "response_span",
    "response_values",
    "returns_to_go",
    "scores_to_token_rewards",
    "token_log_probs",
    "value_loss",
]
