"""`Rollouts`: where the module's rollouts come from. It owns the rollout backends (one per `sampling.backend` in
use, built on first use over the policy, synced to the policy's version before each use, closed at teardown), makes
the collectors (single-turn, or conversations with `model.environment`) with their settings bound once, runs phase
2 of the training step (`make_rollout`: synchronous, overlapped scoring, dynamic sampling, or asynchronous
rollouts sampled ahead by `async_rollouts`), and does the DataModule hand-off (`lit_rlhf.data.handoff`) in
`setup`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn

from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig, check_backend_installed
from lit_rlhf.data.datamodule import RolloutDataModule
from lit_rlhf.data.handoff import PromptNeeds, PromptSupply
from lit_rlhf.models.actor_critic import eval_mode
from lit_rlhf.models.stop_ids import stop_id_disagreement, stop_token_ids
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.functions import RewardFn
from lit_rlhf.rollout.backends.base import BackendContext, InProcessBackend, RolloutBackend
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.rollout.collect import Collector, RolloutSettings, RolloutTimings, SingleTurnCollector
from lit_rlhf.rollout.dynamic import dynamic_rollout, refill_source
from lit_rlhf.rollout.generation import Generation
from lit_rlhf.rollout.multi_turn import Conversations, MultiTurnCollector
from lit_rlhf.rollout.producer import ProducerStopped
from lit_rlhf.rollout.scoring import PendingRollout, start_rollout
from lit_rlhf.training.async_rollouts import AsyncRollouts, AsyncSettings
from lit_rlhf.training.callback_checks import check_callbacks
from lit_rlhf.training.sharding import is_fsdp2, unsharded_for_rollout
from lit_rlhf.training.state import TrainingState
from lit_rlhf.types import PromptBatch, Rollout

IN_FLIGHT_KEY = "lit_rlhf_rollouts_in_flight"
"""The checkpoint's asynchronous rollouts sampled ahead of its step (`AsyncRollouts.in_flight`)."""


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
        self._async: AsyncRollouts | None = None  # with algorithm.max_staleness > 0, from the first step
        self._restored_in_flight: list[dict[str, Any]] = []  # a resumed checkpoint's rollouts sampled ahead
        self.rollout_seed = torch.initial_seed() % 2**62  # the asynchronous sampler's random streams start here
        self._stop_ids: tuple[int, ...] | None = None  # from the policy's generation config, at the first rollout

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
        if stage == "fit":
            check_backend_installed(self.rollout_settings.sampling)  # before any model loads
        if stage == "fit" and self.algorithm.max_staleness:
            self.check_async_fit(trainer)
        super().setup(stage)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Without a `RolloutDataModule` (whose own hook runs instead), refuse a batch that is not a `PromptBatch`
        (a plain DataLoader of prompts) before any sampling, saying how to wrap the data."""
        if not isinstance(batch, PromptBatch):
            raise ConfigError(
                f"trainer.fit: got a dataloader whose batches are {type(batch).__name__}, not PromptBatch; an "
                "RLHFModule takes its prompts from a RolloutDataModule, which tokenises them: "
                "trainer.fit(module, RolloutDataModule(prompts=rows, batch_size=8)), rows being a list of prompt "
                "strings or dicts (other keys reach the reward functions), a .jsonl file or a datasets Dataset"
            )
        return batch

    def check_async_fit(self, trainer: Any) -> None:
        """What asynchronous rollouts need of the fit, before any model loads."""
        k = self.algorithm.max_staleness
        if self.prompt_supply is None:
            raise ConfigError(
                f"algorithm.max_staleness: {k} samples the next prompts ahead, which only a RolloutDataModule can "
                "read; fit with a RolloutDataModule, or set algorithm.max_staleness: 0"
            )
        if is_fsdp2(trainer):
            raise ConfigError(
                f"algorithm.max_staleness: {k} samples with a full copy of the policy, which ModelParallelStrategy "
                "(FSDP2) shards; use strategy: ddp, or algorithm.max_staleness: 0"
            )

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a response (`stop_token_ids`: the tokenizer's EOS, the policy's generation config's
        and the chat template's end of turn), read once the policy is built; a disagreement is warned once."""
        if self._stop_ids is None:
            config = getattr(self.actor_critic.policy, "generation_config", None)
            if (disagreement := stop_id_disagreement(self.tokenizer, config)) is not None:
                rank_zero_warn(disagreement)
            self._stop_ids = stop_token_ids(self.tokenizer, config)
        return self._stop_ids

    def backend(self, sampling: SamplingConfig) -> RolloutBackend:
        """The backend `sampling.backend` names (one per name), synced to the policy's current version."""
        name, policy, version = sampling.backend, self.actor_critic.policy, self.state.policy_version
        if self._async is not None and name == self.rollout_settings.sampling.backend:
            return self._async.evaluation_backend()  # one engine per process: the paused sampler's
        if name not in self._backends:
            context = BackendContext(
                policy, self.stop_ids, self.tokenizer.pad_token_id, sampling, global_rank=self.global_rank
            )
            self._backends[name] = (make_backend(context), version)
        backend, synced = self._backends[name]
        if synced != version:
            backend.sync_weights(policy)
            self._backends[name] = (backend, version)
        return backend

    def collector(
        self, settings: RolloutSettings, backend: RolloutBackend | None = None, tokenizer: Any = None
    ) -> Collector:
        """Samples and scores (`compute_scores`) a batch of prompts: conversations with the environment when there
        is one, else one response per sample; with the module's backend for `settings.sampling` and its tokenizer
        unless given others."""
        backend = self.backend(settings.sampling) if backend is None else backend
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        if self.conversations is None:
            return SingleTurnCollector(backend, tokenizer, self.compute_scores, settings, self.stop_ids)
        return MultiTurnCollector(self.conversations, backend, tokenizer, self.compute_scores, settings, self.stop_ids)

    def make_rollout(self, prompts: PromptBatch) -> tuple[Rollout | PendingRollout, RolloutTimings]:
        """Phase 2: generate and score with the current policy (in eval mode); with dynamic sampling, tied groups
        are replaced by groups of more prompts (`lit_rlhf.rollout.dynamic`); with `overlap_scoring`, a
        `PendingRollout` whose scores are still being computed; with `max_staleness` > 0, the rollout sampled
        ahead for this step (`async_rollouts`)."""
        algo, G, version = self.algorithm, self.algorithm.filled.group_size, self.state.policy_version
        if algo.max_staleness:
            try:  # a hung job holds no SIGTERM
                return self.async_rollouts().take(
                    prompts, self.state.rollouts_done - 1, version, self.received_sigterm()
                )
            except ProducerStopped:
                raise SIGTERMException from None  # Lightning's own stop: last.ckpt saved, exit status 143
        collector = self.collector(self.rollout_settings)
        with eval_mode(self.actor_critic), unsharded_for_rollout(self.actor_critic):  # FSDP2: gathered once
            if self.hparams["overlap_scoring"]:  # refused with an environment: a single-turn collector
                assert isinstance(collector, SingleTurnCollector)
                return start_rollout(collector, prompts, version)
            if not algo.dynamic_sampling:
                return collector.collect(prompts, version)
            supply, rounds = self.refill_supply(), algo.max_sampling_rounds
            refill = refill_source(supply.refill_batch, supply.batch_size, self.state.rollouts_done, rounds)
            collect = lambda batch: collector.collect(batch, version)  # noqa: E731
            return dynamic_rollout(collect, prompts, refill, G, rounds, self.tokenizer.pad_token_id)

    def received_sigterm(self) -> Callable[[], bool] | None:
        """A test of whether the Trainer received SIGTERM (None without a Trainer)."""
        trainer = self._trainer
        return (lambda: trainer.received_sigterm) if trainer is not None else None

    def async_rollouts(self) -> AsyncRollouts:
        """The background sampler of `algorithm.max_staleness` > 0, made at the first step (the checkpoint's
        rollouts in flight put back)."""
        if self._async is None:
            algo, pad = self.algorithm, self.tokenizer.pad_token_id
            dynamic = (algo.filled.group_size, algo.max_sampling_rounds, pad) if algo.dynamic_sampling else None
            settings = AsyncSettings(
                algo.max_staleness,
                self.rollout_seed,
                self.global_rank,
                dynamic,
                self.rollout_settings.sampling.temperature,
                algo.share_prompt_forward,
                self.actor_critic.length_groups,
                algo.logit_chunk_tokens,
            )
            supply = self.refill_supply() if algo.dynamic_sampling else self.prompt_supply
            assert supply is not None  # check_async_fit
            self._async = AsyncRollouts(self.actor_critic.policy, self.sampler_collector, supply, settings)
            self._async.restore(self._restored_in_flight, self.state.rollouts_done - 1)
            self._restored_in_flight = []
        return self._async

    def sampler_collector(self, sampler: nn.Module, generator: torch.Generator) -> tuple[RolloutBackend, Collector]:
        """The asynchronous sampler's backend over its own copy of the policy and random stream, and a collector
        with its own tokenizer (the training thread keeps using the module's)."""
        eos, pad, sampling = self.stop_ids, self.tokenizer.pad_token_id, self.rollout_settings.sampling
        backend, _ = self._backends.get(sampling.backend, (None, 0))
        if backend is None or isinstance(backend, InProcessBackend):  # those sample the module they were given
            backend = make_backend(BackendContext(sampler, eos, pad, sampling, generator, self.global_rank))
        else:  # an engine (or a server's client) of its own, e.g. from the sanity check: one per process, kept
            del self._backends[sampling.backend]
        return backend, self.collector(self.rollout_settings, backend, copy.deepcopy(self.tokenizer))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the asynchronous rollouts sampled ahead (waiting for those in flight), for an exact resume."""
        super().on_save_checkpoint(checkpoint)
        if self._async is not None:  # on SIGTERM a hung job is left out (sampled again on resume)
            checkpoint[IN_FLIGHT_KEY] = self._async.in_flight(self.received_sigterm())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._restored_in_flight = checkpoint.get(IN_FLIGHT_KEY, [])

    def on_validation_start(self) -> None:
        """Held-out evaluation shares the reward functions, reward model and environment: the asynchronous sampler
        pauses for it."""
        if self._async is not None:
            self._async.producer.pause()
        super().on_validation_start()

    def on_validation_end(self) -> None:
        if self._async is not None:
            self._async.producer.resume()
        super().on_validation_end()

    def refill_supply(self) -> PromptSupply:
        """The DataModule's supply, which dynamic sampling's refills come from."""
        if self.prompt_supply is None:
            raise ConfigError(
                "algorithm.dynamic_sampling: needs more prompts than the batch to refill dropped groups, from a "
                "RolloutDataModule (fit has none); fit with a RolloutDataModule, or set "
                "algorithm.dynamic_sampling: false"
            )
        return self.prompt_supply

    def configure_callbacks(self) -> Any:
        """The rollouts' own callback; the Trainer's are checked first (`callback_checks`: a refused one fails here,
        before any model loads)."""
        trainer: Any = self._trainer  # its `callbacks` list is set at run time
        if trainer is not None:
            check_callbacks(trainer.callbacks)
        inherited = super().configure_callbacks()
        assert isinstance(inherited, list)  # LightningModule's own: []
        return [*inherited, CloseRollouts()]

    def close_rollouts(self, stopping: bool = False) -> None:
        """Stop the asynchronous sampler and close every backend (at teardown, or when fit fails or stops:
        `stopping`, a bounded wait for the sampler's running job)."""
        if self._async is not None:
            self._async.close(stopping)
            self._async = None
        for backend, _ in self._backends.values():
            backend.close()
        self._backends.clear()
        reward = getattr(self, "reward", None)  # the reward worker processes, with what their rewards started
        if reward is not None:
            reward.close()

    def teardown(self, stage: str) -> None:
        self.close_rollouts(stopping=self._trainer is not None and self._trainer.received_sigterm)
        super().teardown(stage)


class CloseRollouts(L.Callback):
    """Lightning runs no module `teardown` when fit fails: the producer thread and the backends are closed here
    then (after the `RunFolderGuard`'s SIGTERM checkpoint, which keeps the rollouts in flight)."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(pl_module, Rollouts):
            pl_module.close_rollouts(stopping=True)  # SIGTERM, Ctrl-C or an error: a hung job holds nothing
