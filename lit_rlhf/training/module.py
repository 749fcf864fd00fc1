"""`RLHFModule`: the LightningModule that holds the models and runs one PPO/GRPO step per prompt batch.

A training step is five phases (`training_step`); formulas live in `lit_rlhf.algorithms`, sampling and
scoring in `lit_rlhf.rollout`, model building in `lit_rlhf.models.build`, resume state in `state`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lit_rlhf.algorithms.experience import PolicyForward, make_experience, policy_forward, reference_logits
from lit_rlhf.algorithms.objective import MinibatchTotals, ppo_objective
from lit_rlhf.config import AlgorithmConfig, ConfigError, LRSchedule, SamplingConfig, check_module_settings
from lit_rlhf.models.build import ModelSpecs, build_models
from lit_rlhf.models.loading import load_tokenizer
from lit_rlhf.models.lora import lora_config
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.functions import RewardFn, callable_path, resolve_reward_fns
from lit_rlhf.rollout.collect import collect_rollout
from lit_rlhf.training.metrics import MetricWindow, mean_over, rollout_metrics, samples_table, trainer_writes_logs
from lit_rlhf.training.schedules import warmup_then_decay
from lit_rlhf.training.state import TrainingState, load_training_state, save_training_state
from lit_rlhf.types import Experience, PromptBatch, Rollout, iterate_minibatches, split_rows


class RLHFModule(L.LightningModule):
    """PPO and GRPO for causal language models.

    Args:
        policy: model name, local folder, 'builtin:digits', or a transformers causal LM instance.
        tokenizer: name, folder or instance; defaults to `policy`'s.
        reference: frozen reference policy (name or instance); defaults to a frozen copy of `policy`.
        reward_model: sequence-classification reward model (name, folder or instance), or None.
        reward_tokenizer: the reward model's tokenizer when it differs from the policy's (texts are
            re-tokenised for it); None when they share token ids.
        reward_fns: reward functions (dotted paths or callables) `fn(prompts, responses, **meta)`.
        reward_weights: one weight per reward function (default 1 each).
        reward_model_weight: weight of the reward model's score.
        nan_score: replace NaN scores from reward functions by this value (default: NaN is an error).
        algorithm: PPO/GRPO settings.
        sampling: generation settings.
        lr, weight_decay, betas: AdamW over the trainable parameters only.
        warmup_steps, lr_schedule: linear warm-up, then 'constant', 'linear' or 'cosine' decay to max_steps.
        separate_critic: the value head gets its own copy of the backbone instead of sharing the policy's.
        gradient_checkpointing: recompute activations in backward to save memory.
        log_samples_every_n_steps: write prompt/response samples to TensorBoard every this many rollouts
            (0: never).
        trust_remote_code: allow model code from the model folder (off unless you trust it).
        max_consecutive_skips: stop after this many optimizer steps in a row skipped for non-finite values.
        lora: LoRA adapters on the policy (needs `peft`), e.g. {r: 8, alpha: 16, target_modules: all-linear};
            only the adapters (and the value head) train, and without an explicit `reference` the reference is
            the same weights with the adapters disabled (no second copy). None: full fine-tuning.
    """

    def __init__(
        self,
        policy: Any = "builtin:digits",
        tokenizer: Any = None,
        reference: Any = None,
        reward_model: Any = None,
        reward_tokenizer: Any = None,
        reward_fns: Sequence[str | RewardFn] | None = None,
        reward_weights: Sequence[float] | None = None,
        reward_model_weight: float = 1.0,
        nan_score: float | None = None,
        algorithm: AlgorithmConfig | None = None,
        sampling: SamplingConfig | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_schedule: LRSchedule = "constant",
        separate_critic: bool = False,
        gradient_checkpointing: bool = False,
        log_samples_every_n_steps: int = 50,
        trust_remote_code: bool = False,
        max_consecutive_skips: int = 3,
        lora: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        # dicts: as stored in a (weights-only loadable) checkpoint
        self.algorithm = AlgorithmConfig(**algorithm) if isinstance(algorithm, dict) else algorithm or AlgorithmConfig()
        self.sampling = SamplingConfig(**sampling) if isinstance(sampling, dict) else sampling or SamplingConfig()
        check_module_settings(lr, lr_schedule, warmup_steps, max_consecutive_skips, reward_model, reward_fns)
        if lora is not None:
            lora_config(lora)  # fail on bad LoRA settings before any model is loaded
        # fail on an unimportable reward function now, before any model is loaded
        self.reward = RewardComposer(resolve_reward_fns(reward_fns), reward_weights, reward_model_weight, nan_score)
        self.specs = ModelSpecs(policy, tokenizer, reference, reward_model, reward_tokenizer)
        # model instances and callables are not hyperparameters; their names are
        self.save_hyperparameters(ignore=["policy", "tokenizer", "reference", "reward_model", "reward_tokenizer",
                                          "reward_fns"])
        self.hparams.update(self.specs.names())
        if reward_fns:
            self.hparams["reward_fns"] = [f if isinstance(f, str) else callable_path(f) for f in reward_fns]
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.lr_schedule = warmup_steps, lr_schedule
        self.separate_critic, self.gradient_checkpointing = separate_critic, gradient_checkpointing
        self.log_samples_every_n_steps = log_samples_every_n_steps
        self.trust_remote_code, self.max_consecutive_skips, self.lora = trust_remote_code, max_consecutive_skips, lora
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else policy, "model.tokenizer",
                                        trust_remote_code)
        self.actor_critic: Any = None  # an ActorCritic once configure_model ran
        self.reference: nn.Module | None = None
        self.reward_model: nn.Module | None = None
        self.state = TrainingState()
        self.last_update_stats: list[dict[str, float]] = []  # per minibatch, for inspection and tests
        self.step_metrics: dict[str, float] = {}  # the last training step's metrics, this rank's, unaveraged
        self.metric_window = MetricWindow(last_value_keys=("optim/lr", "optim/skipped_updates"))
        if not isinstance(policy, str):  # an instance: build now so the user can inspect it
            self.configure_model()

    # ------------------------------------------------------------------ Lightning hooks

    def configure_model(self) -> None:
        """Load and wire the models (once)."""
        if self.actor_critic is not None:
            return
        models = build_models(self.specs, self.tokenizer, self.algorithm, self.lora, self.separate_critic,
                              self.gradient_checkpointing, self.trust_remote_code)
        self.actor_critic, self.reference, self.reward_model = models.actor_critic, models.reference, models.reward_model

    def check_rollout_batch(self, prompts_per_step: int) -> None:
        """Called by the DataModule before models load: the rollout must split into (micro-)batches."""
        self.algorithm.check_batch(prompts_per_step * self.algorithm.group_size)

    def setup(self, stage: str) -> None:
        if self._trainer is not None and str(self.trainer.precision) in ("16-mixed", "16"):
            raise ConfigError("trainer.precision: fp16 mixed precision scales gradients and is not supported by the "
                              "manual update loop; use precision: bf16-mixed (or 32)")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=self.lr, betas=self.betas,
                                      weight_decay=self.weight_decay)
        total = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else None
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay(self.lr_schedule,
                                                                                   self.warmup_steps, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        """Every rank was seeded alike (same initial weights); give each rank its own sampling stream, so the
        ranks do not draw the same noise for their different prompts. A resume restores each rank's own stream."""
        if self.trainer.world_size > 1 and not self.state.rng_restored_per_rank:
            torch.manual_seed((torch.initial_seed() + self.trainer.global_rank) % 2**63)

    def train(self, mode: bool = True) -> RLHFModule:
        """Lightning switches everything to train mode; the frozen models stay in eval mode."""
        super().train(mode)
        for module in (self.reference, self.reward_model):
            if module is not None:
                module.eval()
        return self

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop rebuildable frozen weights; keep counters and RNG states for an exact resume."""
        prefixes = self.specs.rebuildable_prefixes(self.reference is not None, self.reward_model is not None)
        world = self.trainer.world_size if self._trainer is not None else 1
        save_training_state(checkpoint, self.state, prefixes, self.trainer.strategy if world > 1 else None, world)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put back the frozen weights rebuilt from source, and the counters and RNG states."""
        attached = self._trainer is not None
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if attached else (0, 1)
        device = self.trainer.strategy.root_device if attached else self.device  # the module is not moved yet
        load_training_state(checkpoint, self.state, self.state_dict(), rank, world, device)

    # ------------------------------------------------------------------ the training step

    def training_step(self, prompts: PromptBatch, batch_idx: int) -> None:
        # 1. prompts: this rank's batch from the DataModule
        start = time.perf_counter()
        self.state.rollouts_done += 1
        # 2. rollout: sample group_size responses per prompt with the current policy, and score them
        rollout, timings = self.make_rollout(prompts)
        # 3. experience: old and reference log-probs, KL, advantages. A single pass over a rollout in one piece
        #    takes the sampling policy's outputs from the update's own first forward (one policy forward a step).
        start_experience = time.perf_counter()
        first_forward = None
        if not self.algorithm.policy_forward_in_rollout(rollout.batch_size):
            first_forward = policy_forward(self.actor_critic, rollout, self.sampling.temperature)
        experience = self.make_experience(rollout, first_forward)
        self.on_experience(experience)
        # 4. update: ppo_epochs x minibatches x micro-batches
        lr = self.optimizers().param_groups[0]["lr"]  # the rate this rollout's (first) update uses
        start_update = time.perf_counter()
        update_stats = self.update(experience, first_forward)
        # 5. log
        end = time.perf_counter()
        metrics = {**rollout_metrics(experience, self.algorithm), **update_stats,
                   "time/generate_s": timings.generate_s, "time/score_s": timings.score_s,
                   "time/evaluate_s": start_update - start_experience, "time/rollout_s": start_update - start,
                   "time/update_s": end - start_update,
                   "perf/tokens_per_s": float(experience.response_mask.sum()) / max(end - start, 1e-9),
                   "optim/lr": lr, "optim/skipped_updates": float(self.state.skipped_updates)}
        self.log_step(metrics, experience)

    def make_rollout(self, prompts: PromptBatch) -> tuple[Rollout, Any]:
        """Phase 2: generate and score with the current policy (in eval mode)."""
        was_training = self.actor_critic.training
        self.actor_critic.eval()
        try:
            return collect_rollout(prompts, self.actor_critic.policy, self.tokenizer, self.reward, self.reward_model,
                                   self.algorithm, self.sampling, self.state.policy_version)
        finally:
            self.actor_critic.train(was_training)

    def make_experience(self, rollout: Rollout, sampling_policy: PolicyForward | None = None) -> Experience:
        """Phase 3: the sampling policy's forward (`sampling_policy` when the update already ran it, else a
        no-grad one now) and the reference's, into the complete experience."""
        if sampling_policy is None:
            with torch.no_grad():
                sampling_policy = policy_forward(self.actor_critic, rollout, self.sampling.temperature)
        ref_logits = reference_logits(self.reference, rollout) if self.reference is not None else None
        return make_experience(rollout, self.algorithm, sampling_policy, ref_logits, self.sampling.temperature)

    def on_experience(self, experience: Experience) -> None:
        """Hook called with every complete experience before the update (for callbacks and tests)."""

    def update(self, exp: Experience, first_forward: PolicyForward | None = None) -> dict[str, float]:
        """Phase 4: `ppo_epochs` passes of minibatch steps; returns the statistics averaged over minibatches.

        `first_forward`: the policy's forward over the whole rollout with grad (a single pass in one piece),
        used as the loss's forward instead of running it again.
        """
        algo = self.algorithm
        minibatch_size = exp.batch_size // algo.num_minibatches
        micro_size = algo.micro_batch_size or minibatch_size
        self.last_update_stats = []
        for _ in range(algo.ppo_epochs):
            for minibatch in iterate_minibatches(exp, minibatch_size, self.state.update_generator,
                                                 shuffle=algo.num_minibatches > 1):
                totals = MinibatchTotals.of(minibatch, self.sampling.max_new_tokens)
                stats: dict[str, float] = {}
                pieces = split_rows(minibatch.batch_size, micro_size)
                for i, rows in enumerate(pieces):
                    with self.gradient_sync(enabled=i == len(pieces) - 1):
                        loss, micro_stats = self.micro_batch_loss(minibatch.select(rows), totals, first_forward)
                        first_forward = None
                        self.manual_backward(loss)
                    for key, value in micro_stats.items():
                        stats[key] = stats.get(key, 0.0) + value
                stats["optim/grad_norm"] = self.clip_and_step(stats)
                self.last_update_stats.append(stats)
        return mean_over(self.last_update_stats)

    def micro_batch_loss(self, mb: Experience, totals: MinibatchTotals,
                         forward: PolicyForward | None = None) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch, normalised by its minibatch's totals (`forward`: its policy forward,
        when the caller already ran it)."""
        current = forward if forward is not None else policy_forward(self.actor_critic, mb, self.sampling.temperature)
        ref_logits = None
        if self.algorithm.uses_reference and not self.algorithm.kl_in_reward and self.algorithm.kl_estimator == "full":
            ref_logits = reference_logits(self.reference, mb)
        return ppo_objective(current, mb, self.algorithm, totals, self.sampling.temperature, ref_logits)

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Under DDP, skip the gradient all-reduce for all but a minibatch's last micro-batch."""
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return contextlib.nullcontext() if enabled or block is None else block()

    def clip_and_step(self, stats: dict[str, float]) -> float:
        """Clip, step the optimizer and the schedule, zero the gradients; returns the pre-clip gradient norm.

        A non-finite loss or gradient norm skips the step (weights unchanged, counted); after
        `max_consecutive_skips` skips in a row training stops with an error naming what went non-finite.
        """
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        grads = [p.grad for p in self.trainable_parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) \
            if grads else 0.0
        bad = {k: v for k, v in stats.items() if k.endswith("loss") and not math.isfinite(v)}
        if not math.isfinite(norm):
            bad["optim/grad_norm"] = norm
        if bad:
            optimizer.zero_grad(set_to_none=True)
            self.state.skip_update(bad, self.max_consecutive_skips, self.global_step)
            return norm
        self.state.consecutive_skips = 0
        if self.algorithm.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.algorithm.max_grad_norm,
                                gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        self.state.policy_version += 1
        return norm

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.actor_critic.parameters() if p.requires_grad)

    # ------------------------------------------------------------------ logging

    def log_step(self, metrics: dict[str, float], experience: Experience) -> None:
        """Phase 5: the progress-bar reward every step; every metric, averaged over the steps since the last
        write, on the steps the Trainer writes logs (`log_every_n_steps`); samples every
        `log_samples_every_n_steps` rollouts.

        Lightning's `self.log` costs about 0.25 ms per metric per call on a CPU, several ms per step for the
        ~25 metrics, so they are only handed to it when they will be written.
        """
        self.step_metrics = metrics
        batch_size = experience.batch_size
        self.log("reward", metrics["rollout/reward_mean"], prog_bar=True, logger=False, sync_dist=True,
                 batch_size=batch_size)
        self.metric_window.add(metrics)
        if trainer_writes_logs(self.trainer, self.state.rollouts_done):
            self.log_dict(self.metric_window.values(), on_step=True, sync_dist=True, batch_size=batch_size)
            self.metric_window.clear()
        every = self.log_samples_every_n_steps
        experiment = getattr(self.logger, "experiment", None) if self.logger is not None else None
        if every and self.global_rank == 0 and (self.state.rollouts_done - 1) % every == 0 \
                and hasattr(experiment, "add_text"):
            experiment.add_text("samples", samples_table(experience, self.algorithm.group_size),
                                global_step=self.global_step)

