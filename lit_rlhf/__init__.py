"""lit_rlhf: PPO and GRPO for causal language models as PyTorch Lightning modules."""

from lit_rlhf.checkpoint import AtomicCheckpointIO
from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.data import RolloutDataModule
from lit_rlhf.module import RLHFModule
from lit_rlhf.types import Experience, PromptBatch

__all__ = [
    "AlgorithmConfig",
    "AtomicCheckpointIO",
    "ConfigError",
    "Experience",
    "PromptBatch",
    "RLHFModule",
    "RolloutDataModule",
    "SamplingConfig",
]
__version__ = "0.1.0"
