"""`Rollouts`: where the module's rollouts come from. It owns the rollout backends (one per `sampling.backend` in
use, built on first use over the policy, synced to the policy's version before each use, closed at teardown), makes
the collectors (single-turn, or conversations with `model.environment`) with their settings bound once, and does
the DataModule hand-off (`lit_rlhf.data.handoff`) in `setup`."""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import Tensor

from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.data.datamodule import RolloutDataModule
from lit_rlhf.data.handoff import PromptNeeds, PromptSupply
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.functions import RewardFn
from lit_rlhf.rollout.backends.base import BackendContext, RolloutBackend
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.rollout.collect import Collector, RolloutSettings, SingleTurnCollector
from lit_rlhf.rollout.generation import Generation
from lit_rlhf.rollout.multi_turn import Conversations, MultiTurnCollector
from lit_rlhf.training.state import TrainingState


class Rollouts(L.LightningModule):
    """For a module with `actor_critic`, `tokenizer`, `state`, `algorithm`, `reward`, `metric_fns` and
    `compute_scores`."""

    actor_critic: Any
    tokenizer: Any
    state: TrainingState
    algorithm: AlgorithmConfig
    reward: RewardComposer
    metric_fns: dict[str, RewardFn]

    def setup_rollouts(self, conversations: Conversations | None, training: RolloutSettings) -> None:
        """The environment (None: single-turn) and the training rollouts' settings; no backend yet."""
        self.conversations, self.rollout_settings = conversations, training
        self.prompt_supply: PromptSupply | None = None  # from the DataModule, in `setup`
        self._backends: dict[str, tuple[RolloutBackend, int]] = {}  # name -> (backend, policy version synced)

    def compute_scores(
        self, prompts: list[str], responses: list[str], meta: dict[str, list[Any]], generation: Generation
    ) -> Tensor:
        raise NotImplementedError

    def prompt_needs(self) -> PromptNeeds:
        """What this module asks of a `RolloutDataModule` (handed over in `setup`, before models load): its
        tokenizer, the columns its reward and metric functions name, and a batch that splits into minibatches."""

        def check_rollout_batch(prompts_per_step: int) -> None:
            self.algorithm.check_batch(prompts_per_step * self.algorithm.filled.group_size)

        return PromptNeeds(self.tokenizer, self.reward.reward_fns, list(self.metric_fns.values()), check_rollout_batch)

    def setup(self, stage: str) -> None:
        """Hand the module's needs to a `RolloutDataModule` and keep what it gives back (None without one)."""
        trainer: Any = self.trainer  # Lightning sets `datamodule` on it during fit/validate/test/predict
        data = trainer.datamodule
        self.prompt_supply = data.connect(self.prompt_needs()) if isinstance(data, RolloutDataModule) else None
        super().setup(stage)

    def backend(self, sampling: SamplingConfig) -> RolloutBackend:
        """The backend `sampling.backend` names (one per name), synced to the policy's current version."""
        name, policy, version = sampling.backend, self.actor_critic.policy, self.state.policy_version
        if name not in self._backends:
            eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            context = BackendContext(policy, eos, pad, sampling, global_rank=self.global_rank)
            self._backends[name] = (make_backend(context), version)
        backend, synced = self._backends[name]
        if synced != version:
            backend.sync_weights(policy)
            self._backends[name] = (backend, version)
        return backend

    def collector(self, settings: RolloutSettings) -> Collector:
        """Samples and scores (`compute_scores`) a batch of prompts: conversations with the environment when there
        is one, else one response per sample."""
        backend = self.backend(settings.sampling)
        if self.conversations is None:
            return SingleTurnCollector(backend, self.tokenizer, self.compute_scores, settings)
        return MultiTurnCollector(self.conversations, backend, self.tokenizer, self.compute_scores, settings)

    def refill_supply(self) -> PromptSupply:
        """The DataModule's supply, which dynamic sampling's refills come from."""
        if self.prompt_supply is None:
            raise ConfigError(
                "algorithm.dynamic_sampling: needs more prompts than the batch to refill dropped groups, from a "
                "RolloutDataModule (fit has none); fit with a RolloutDataModule, or set "
                "algorithm.dynamic_sampling: false"
            )
        return self.prompt_supply

    def teardown(self, stage: str) -> None:
        for backend, _ in self._backends.values():
            backend.close()
        self._backends.clear()
        super().teardown(stage)
