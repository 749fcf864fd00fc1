"""lit_rlhf: PPO, GRPO and their variants for causal language models, as PyTorch Lightning modules.

The data flow, one folder each: `data` (prompts) -> `rollout` (generate, score with `rewards`) ->
`algorithms` (experience, advantages, losses) -> `training` (the LightningModule's update loop).
"""

from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.data.datamodule import RolloutDataModule
from lit_rlhf.rewards.functions import rowwise
from lit_rlhf.rollout.environment import Environment, StepResult
from lit_rlhf.training.callbacks import SavePolicy, WritePredictions
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO
from lit_rlhf.training.module import RLHFModule
from lit_rlhf.training.reward_model_training import PreferenceDataModule, RewardModelModule
from lit_rlhf.training.run_folder import RunFolderGuard
from lit_rlhf.types import Experience, PromptBatch, Rollout

__all__ = [
    "AlgorithmConfig",
    "AtomicCheckpointIO",
    "ConfigError",
    "Environment",
    "Experience",
    "PreferenceDataModule",
    "PromptBatch",
    "RLHFModule",
    "RewardModelModule",
    "Rollout",
    "RolloutDataModule",
    "RunFolderGuard",
    "SamplingConfig",
    "SavePolicy",
    "StepResult",
    "WritePredictions",
    "rowwise",
]
__version__ = "0.5.0"
