"""`RLHFModule`: the LightningModule that holds the models, runs the PPO/GRPO update loop and logs.

Formulas live in `losses`, the rollout in `rollout`; this file wires them to Lightning's manual
optimisation. Models given as names are loaded in `configure_model`, after every setting was checked.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
import warnings
from typing import Any, Callable, Sequence

import lightning as L
import torch
from torch import Tensor, nn

from lit_rlhf import losses
from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.models import (
    ActorCritic,
    causal_lm_response_forward,
    disable_dropout,
    freeze,
    frozen_copy,
    is_builtin,
    load_causal_lm,
    load_tokenizer,
)
from lit_rlhf.rewards import RewardComposer, SequenceRewardModel, resolve_reward_fns
from lit_rlhf.metrics import MetricWindow, rollout_metrics
from lit_rlhf.rollout import collect_experience, with_advantages
from lit_rlhf.types import Experience, PromptBatch, iterate_minibatches, split_rows

# training_step(self, dataloader_iter) is how rollouts stay fresh (DESIGN §1); Lightning warns that the
# signature is experimental on every fit. We rely on it deliberately, so those two notices are silenced.
warnings.filterwarnings("ignore", message=r".*`dataloader_iter`.*")

LR_SCHEDULES = ("constant", "linear", "cosine")
MODEL_ARGUMENTS = ("policy", "tokenizer", "reference", "reward_model", "reward_tokenizer", "reward_fns")


def _is_name(value: Any) -> bool:
    return value is None or isinstance(value, str)


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
        reward_fns: Sequence[str | Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        reward_model_weight: float = 1.0,
        nan_score: float | None = None,
        algorithm: AlgorithmConfig | None = None,
        sampling: SamplingConfig | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        separate_critic: bool = False,
        gradient_checkpointing: bool = False,
        log_samples_every_n_steps: int = 50,
        trust_remote_code: bool = False,
        max_consecutive_skips: int = 3,
        lora: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        if isinstance(algorithm, dict):  # as stored in a (weights-only loadable) checkpoint
            algorithm = AlgorithmConfig(**algorithm)
        if isinstance(sampling, dict):
            sampling = SamplingConfig(**sampling)
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
        self.sampling = sampling if sampling is not None else SamplingConfig()
        if lr <= 0:
            raise ConfigError(f"model.lr: must be > 0, got {lr}")
        if lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"model.lr_schedule: use one of {LR_SCHEDULES}, got {lr_schedule!r}")
        if warmup_steps < 0:
            raise ConfigError(f"model.warmup_steps: must be >= 0, got {warmup_steps}")
        if reward_model is None and not reward_fns:
            raise ConfigError("model.reward_fns / model.reward_model: give at least one reward function or a reward model")
        # fail on an unimportable reward function now, before any model is loaded
        self.reward = RewardComposer(resolve_reward_fns(reward_fns), reward_weights, reward_model_weight, nan_score)
        # model instances and callables are not hyperparameters; their names are
        self.save_hyperparameters(ignore=list(MODEL_ARGUMENTS))
        named = dict(policy=policy, tokenizer=tokenizer, reference=reference, reward_model=reward_model,
                     reward_tokenizer=reward_tokenizer)
        self.hparams.update({k: v for k, v in named.items() if _is_name(v)})
        if reward_fns:
            # callable objects and functools.partial have no __qualname__ (partial: no __module__ either)
            self.hparams["reward_fns"] = [
                f if isinstance(f, str) else f"{getattr(f, '__module__', None) or type(f).__module__}."
                f"{getattr(f, '__qualname__', None) or type(f).__qualname__}"
                for f in reward_fns
            ]
        self._specs = dict(policy=policy, tokenizer=tokenizer, reference=reference, reward_model=reward_model,
                           reward_tokenizer=reward_tokenizer)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.lr_schedule = warmup_steps, lr_schedule
        self.separate_critic = separate_critic
        self.gradient_checkpointing = gradient_checkpointing
        self.log_samples_every_n_steps = log_samples_every_n_steps
        self.trust_remote_code = trust_remote_code

        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else policy, "model.tokenizer", trust_remote_code)
        self.actor_critic: ActorCritic | None = None
        self.reference: nn.Module | None = None
        self.reward_model: SequenceRewardModel | None = None
        self.policy_version = 0  # optimizer updates applied so far
        self.rollouts_done = 0  # training steps (rollouts) consumed so far
        self.skipped_updates = 0
        self.consecutive_skips = 0
        if max_consecutive_skips < 1:
            raise ConfigError(f"model.max_consecutive_skips: must be >= 1, got {max_consecutive_skips}")
        self.max_consecutive_skips = max_consecutive_skips
        if lora is not None:
            from lit_rlhf.lora import lora_config

            lora_config(lora)  # fail on bad LoRA settings before any model is loaded
        self.lora = lora
        self._rng_restored_per_rank = False  # set when a checkpoint gave this rank its own RNG state
        self._update_generator = torch.Generator().manual_seed(0)
        self.last_update_stats: list[dict[str, float]] = []  # per minibatch, for inspection and tests
        self.step_metrics: dict[str, float] = {}  # the last training step's metrics, this rank's, unaveraged
        self.metric_window = MetricWindow(last_value_keys=("optim/lr", "optim/skipped_updates"))
        if not isinstance(policy, str):  # an instance: build now so the user can inspect it
            self.configure_model()

    # ------------------------------------------------------------------ models

    def configure_model(self) -> None:
        """Load and wire the models (once)."""
        if self.actor_critic is not None:
            return
        algo, specs = self.algorithm, self._specs
        policy = load_causal_lm(specs["policy"], "model.policy", self.trust_remote_code)
        rows = getattr(getattr(policy, "get_input_embeddings", lambda: None)(), "num_embeddings", None)
        if rows is not None and len(self.tokenizer) > rows:  # token ids past the table fail deep in a forward
            raise ConfigError(
                f"model.tokenizer: {len(self.tokenizer)} tokens, but model.policy embeds only {rows}; "
                "use the policy's own tokenizer (or resize the policy's token embeddings)"
            )
        disable_dropout(policy)
        if self.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        if self.lora is not None:
            from lit_rlhf.lora import apply_lora

            policy = apply_lora(policy, self.lora)
        critic_backbone = None
        if algo.uses_critic and self.separate_critic:
            critic_backbone = copy.deepcopy(policy)
        self.actor_critic = ActorCritic(policy, value_head=algo.uses_critic, critic_backbone=critic_backbone)
        if algo.uses_reference:
            if specs["reference"] is None and self.lora is not None:
                from lit_rlhf.lora import AdapterDisabledReference

                self.reference = AdapterDisabledReference(policy)
            elif specs["reference"] is None:
                self.reference = frozen_copy(policy)
            else:
                self.reference = freeze(load_causal_lm(specs["reference"], "model.reference", self.trust_remote_code))
                disable_dropout(self.reference)
        if specs["reward_model"] is not None:
            self.reward_model = build_reward_model(specs["reward_model"], specs["reward_tokenizer"], self.trust_remote_code)
            from lit_rlhf.rewards import check_shared_tokenizer

            check_shared_tokenizer(self.reward_model, self.tokenizer, specs["reward_model"])

    def rebuildable_prefixes(self) -> list[str]:
        """State-dict prefixes of frozen models that `configure_model` reloads from their source, so
        checkpoints need not carry them: a reference or reward model named by a folder or hub id."""
        specs, prefixes = self._specs, []
        policy_is_named = isinstance(specs["policy"], str) and not is_builtin(specs["policy"])
        reference_spec = specs["reference"]
        if self.reference is not None and (
            (reference_spec is None and policy_is_named)
            or (isinstance(reference_spec, str) and not is_builtin(reference_spec))
        ):
            prefixes.append("reference.")
        if self.reward_model is not None and isinstance(specs["reward_model"], str):
            prefixes.append("reward_model.")
        return prefixes

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop rebuildable frozen weights; keep counters and RNG states for an exact resume."""
        prefixes = tuple(self.rebuildable_prefixes())
        if prefixes:
            state = checkpoint["state_dict"]
            for key in [k for k in state if k.startswith(prefixes)]:
                del state[key]
        checkpoint["lit_rlhf"] = {
            "policy_version": self.policy_version,
            "rollouts_done": self.rollouts_done,
            "skipped_updates": self.skipped_updates,
            "consecutive_skips": self.consecutive_skips,
            "update_generator": self._update_generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rebuilt_prefixes": list(prefixes),
        }
        if self._trainer is not None and self.trainer.world_size > 1:
            # ranks sample different amounts, so their RNG streams differ: keep every rank's (this hook runs
            # on all ranks; the file is written by rank 0)
            gather, device = self.trainer.strategy.all_gather, self.trainer.strategy.root_device
            states = gather(torch.get_rng_state().to(device))
            checkpoint["lit_rlhf"]["torch_rng_per_rank"] = [s.cpu().clone() for s in states]  # own storage
            if device.type == "cuda":
                states = gather(torch.cuda.get_rng_state(device).to(device))
                checkpoint["lit_rlhf"]["cuda_rng_per_rank"] = [s.cpu().clone() for s in states]
        # dataclass settings as plain dicts, so the file loads with torch.load(weights_only=True)
        hparams = checkpoint.get("hyper_parameters")
        if isinstance(hparams, dict):
            checkpoint["hyper_parameters"] = {
                k: dataclasses.asdict(v) if isinstance(v, (AlgorithmConfig, SamplingConfig)) else v
                for k, v in hparams.items()
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put back the frozen weights rebuilt from source, and the counters and RNG states."""
        extra = checkpoint.get("lit_rlhf")
        if extra is None:
            return
        prefixes = tuple(extra.get("rebuilt_prefixes", []))
        if prefixes:
            own = self.state_dict()
            checkpoint["state_dict"].update({k: v for k, v in own.items() if k.startswith(prefixes)})
        self.policy_version = extra["policy_version"]
        self.rollouts_done = extra.get("rollouts_done", 0)
        self.skipped_updates = extra["skipped_updates"]
        self.consecutive_skips = extra["consecutive_skips"]
        self._update_generator.set_state(extra["update_generator"])
        per_rank = extra.get("torch_rng_per_rank")
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self._trainer is not None else (0, 1)
        state = per_rank[rank] if per_rank is not None and len(per_rank) == world else extra["torch_rng"]
        torch.set_rng_state(state.clone())  # a view with a storage offset crashes set_rng_state
        self._rng_restored_per_rank = per_rank is not None and len(per_rank) == world
        if extra.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["cuda_rng"])
        cuda_per_rank = extra.get("cuda_rng_per_rank")
        device = self.trainer.strategy.root_device if self._trainer is not None else self.device  # not moved yet
        if cuda_per_rank is not None and len(cuda_per_rank) == world and device.type == "cuda":
            torch.cuda.set_rng_state(cuda_per_rank[rank].clone(), device)

    def on_fit_start(self) -> None:
        """Every rank was seeded alike (same initial weights); give each rank its own sampling stream, so the
        ranks do not draw the same noise for their different prompts. A resume restores each rank's own stream."""
        if self.trainer.world_size > 1 and not self._rng_restored_per_rank:
            torch.manual_seed((torch.initial_seed() + self.trainer.global_rank) % 2**63)

    def frozen_modules(self) -> list[nn.Module]:
        return [m for m in (self.reference, self.reward_model) if m is not None]

    def train(self, mode: bool = True) -> "RLHFModule":
        """Lightning switches everything to train mode; the frozen models stay in eval mode."""
        super().train(mode)
        for module in self.frozen_modules():
            module.eval()
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.actor_critic.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ checks and optimizer

    def check_rollout_batch(self, prompts_per_step: int) -> None:
        """Called by the DataModule before models load: the rollout must split into (micro-)batches."""
        self.algorithm.check_batch(prompts_per_step * self.algorithm.group_size)

    def setup(self, stage: str) -> None:
        precision = str(self.trainer.precision) if self.trainer is not None else ""
        if precision in ("16-mixed", "16"):
            raise ConfigError(
                "trainer.precision: fp16 mixed precision scales gradients and is not supported by the manual "
                "update loop; use precision: bf16-mixed (or 32)"
            )

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=self.lr, betas=self.betas,
                                      weight_decay=self.weight_decay)
        total = self.trainer.max_steps if self.trainer is not None and self.trainer.max_steps > 0 else None
        schedule = lr_lambda(self.lr_schedule, self.warmup_steps, total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ rollout

    def make_rollout(self, prompts: PromptBatch) -> tuple[Experience, dict[str, float]]:
        """Generate, score and evaluate with the current policy."""
        was_training = self.actor_critic.training
        self.actor_critic.eval()
        try:
            experience, timings = collect_experience(
                prompts, self.actor_critic, self.reference, self.reward_model, self.reward, self.tokenizer,
                self.algorithm, self.sampling, policy_version=self.policy_version,
            )
        finally:
            self.actor_critic.train(was_training)
        return experience, {"time/generate_s": timings.generate_s, "time/score_s": timings.score_s,
                            "time/evaluate_s": timings.evaluate_s}

    # ------------------------------------------------------------------ training

    def training_step(self, dataloader_iter) -> None:
        start = time.perf_counter()
        batch, _, _ = next(dataloader_iter)
        if isinstance(batch, PromptBatch):
            batch = self.make_rollout(batch)
        experience, timings = batch
        self.rollouts_done += 1
        rollout_s = time.perf_counter() - start
        self.on_experience(experience)

        lr = self.optimizers().param_groups[0]["lr"]  # the rate this rollout's (first) update uses
        start = time.perf_counter()
        update_stats, experience = self.update(experience)
        update_s = time.perf_counter() - start

        metrics = rollout_metrics(experience, self.algorithm)
        metrics.update(update_stats)
        metrics.update(timings)
        tokens = float(experience.response_mask.sum())
        metrics.update({"time/rollout_s": rollout_s, "time/update_s": update_s,
                        "perf/tokens_per_s": tokens / max(rollout_s + update_s, 1e-9),
                        "optim/lr": lr,
                        "optim/skipped_updates": float(self.skipped_updates)})
        self.step_metrics = metrics
        self.log_step_metrics(metrics, experience.batch_size)
        self.log_samples(experience)

    def log_step_metrics(self, metrics: dict[str, float], batch_size: int) -> None:
        """The progress-bar reward every step; every metric, averaged over the steps since the last write,
        on the steps the Trainer writes logs (`Trainer(log_every_n_steps=...)`, Lightning's default 50).

        Lightning's `self.log` costs about 0.25 ms per metric per call on a CPU, several ms per step for the
        ~25 metrics, so they are only handed to it when they will be written.
        """
        self.log("reward", metrics["rollout/reward_mean"], prog_bar=True, logger=False, sync_dist=True,
                 batch_size=batch_size)
        self.metric_window.add(metrics)
        if self._trainer_writes_logs_now():
            self.log_dict(self.metric_window.values(), on_step=True, sync_dist=True, batch_size=batch_size)
            self.metric_window.clear()

    def _trainer_writes_logs_now(self) -> bool:
        """The Trainer's own test for this step (as Lightning's LearningRateMonitor uses it); True if absent."""
        trainer = self.trainer
        connector = getattr(trainer, "_logger_connector", None)
        return bool(getattr(connector, "should_update_logs", True) or getattr(trainer, "fast_dev_run", False))

    def on_experience(self, experience: Experience) -> None:
        """Hook called with every rollout before the update (for callbacks and tests).

        With a single pass the rollout's `advantages`, `old_logprobs`, `values` and `kl` may still be None here:
        the update computes them from its own forward (`AlgorithmConfig.policy_forward_in_rollout`).
        """

    def update(self, exp: Experience) -> tuple[dict[str, float], Experience]:
        """ppo_epochs passes of minibatch steps over one rollout.

        Returns the statistics averaged over the minibatches, and the rollout with its advantages: when the
        rollout left them to the update (a single pass), the first forward computes them from its detached
        log-probs and values and then gives the loss, so the policy runs once instead of twice.
        """
        algo = self.algorithm
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        forward = None
        if exp.advantages is None:
            forward = self.policy_forward(exp)
            _, values, logprobs = forward
            exp = with_advantages(exp, algo, logprobs.detach(), values.detach() if values is not None else None)
        minibatch_size = exp.batch_size // algo.num_minibatches
        micro_size = algo.micro_batch_size or minibatch_size
        self.last_update_stats = []
        for _ in range(algo.ppo_epochs):
            minibatches = iterate_minibatches(exp, minibatch_size, self._update_generator,
                                              shuffle=algo.num_minibatches > 1)
            for minibatch in minibatches:
                totals = {"tokens": minibatch.loss_mask.sum().clamp(min=1), "sequences": minibatch.batch_size}
                stats: dict[str, float] = {}
                slices = split_rows(minibatch.batch_size, micro_size)
                if forward is not None and len(slices) > 1:
                    raise RuntimeError("a rollout without advantages must be updated in one pass of one piece")
                for i, rows in enumerate(slices):
                    sync = contextlib.nullcontext() if i == len(slices) - 1 else self._no_backward_sync()
                    with sync:
                        loss, micro_stats = self.micro_batch_loss(minibatch.select(rows), totals, forward)
                        forward = None
                        self.manual_backward(loss)
                    for key, value in micro_stats.items():
                        stats[key] = stats.get(key, 0.0) + value
                stats["optim/grad_norm"] = self.optimizer_step(optimizer, scheduler, stats)
                self.last_update_stats.append(stats)
        averaged = {key: sum(s[key] for s in self.last_update_stats) / len(self.last_update_stats)
                    for key in self.last_update_stats[0]}
        return averaged, exp

    def _no_backward_sync(self):
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return block() if block is not None else contextlib.nullcontext()

    def policy_forward(self, mb: Experience) -> tuple[Tensor, Tensor | None, Tensor]:
        """Response logits (B, T, V), values (B, T) or None, and log-probs of the response tokens (B, T)."""
        logits, values = self.actor_critic(mb.input_ids(), mb.attention_mask(), mb.response_ids.shape[1])
        return logits, values, losses.logprobs_from_logits(logits, mb.response_ids, self.sampling.temperature)

    def micro_batch_loss(
        self, mb: Experience, totals: dict[str, Any], forward: tuple[Tensor, Tensor | None, Tensor] | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch, normalised by its minibatch's totals so micro-batches sum exactly.

        `forward`: this micro-batch's `policy_forward`, when the caller already ran it.
        """
        if mb.advantages is None:
            raise ValueError(
                "micro_batch_loss: this rollout left its advantages to the update's own forward (a single pass, "
                "see AlgorithmConfig.policy_forward_in_rollout); run update(), or complete it first with "
                "lit_rlhf.rollout.with_advantages"
            )
        algo = self.algorithm
        mask = mb.loss_mask
        logits, values, logprobs = forward if forward is not None else self.policy_forward(mb)
        # single pass without a critic: the policy has not moved yet, so this forward is the old policy
        old_logprobs = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()

        def aggregate(per_token: Tensor) -> Tensor:
            return losses.aggregate_loss(per_token, mask, algo.loss_aggregation, totals["tokens"],
                                         totals["sequences"], self.sampling.max_new_tokens)

        def token_share(per_token: Tensor) -> float:  # this micro-batch's part of the minibatch token mean
            return float(losses.masked_sum(per_token.detach().float(), mask) / totals["tokens"])

        policy_tokens, clipped = losses.clipped_policy_loss(
            logprobs, old_logprobs, mb.advantages, algo.clip_eps_low, algo.clip_eps_high, algo.dual_clip
        )
        policy_loss = aggregate(policy_tokens)
        loss = policy_loss
        log_ratio = (logprobs - old_logprobs).detach()
        stats = {"policy/loss": float(policy_loss.detach()),
                 "policy/clipfrac": token_share(clipped.float()),
                 "policy/approx_kl": token_share(0.5 * log_ratio ** 2),
                 "policy/ratio_mean": token_share(log_ratio.exp())}
        if values is not None:
            value_tokens, value_clipped = losses.clipped_value_loss(values, mb.values, mb.returns, algo.value_clip)
            value_loss = aggregate(value_tokens)
            loss = loss + algo.vf_coef * value_loss
            stats.update({"value/loss": float(value_loss.detach()), "value/clipfrac": token_share(value_clipped.float())})
        if algo.uses_reference and not algo.kl_in_reward:
            kl_tokens = self.kl_in_loss(mb, logits, logprobs)
            kl_loss = aggregate(kl_tokens)
            loss = loss + algo.kl_coef * kl_loss
            stats["policy/kl_loss"] = float(kl_loss.detach())
            if mb.kl is None:  # the rollout skipped the policy forward: report the KL seen here
                stats["objective/kl"] = float(losses.masked_sum(kl_tokens.detach(), mask) / totals["sequences"])
        entropy = losses.entropy_from_logits(logits if algo.entropy_coef else logits.detach(), self.sampling.temperature)
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * aggregate(entropy)
        stats["objective/entropy"] = token_share(entropy)
        return loss, stats

    def kl_in_loss(self, mb: Experience, logits: Tensor, logprobs: Tensor) -> Tensor:
        """Per-token KL of the current policy to the reference: (B, T)."""
        if self.algorithm.kl_estimator == "full":
            with torch.no_grad():
                ref_logits, _ = causal_lm_response_forward(self.reference, mb.input_ids(), mb.attention_mask(),
                                                           mb.response_ids.shape[1])
            return losses.full_kl_from_logits(logits, ref_logits, self.sampling.temperature)
        return losses.kl_from_logprobs(logprobs, mb.ref_logprobs, self.algorithm.kl_estimator)

    def optimizer_step(self, optimizer, scheduler, stats: dict[str, float]) -> float:
        """Clip, step, zero; returns the pre-clip gradient norm.

        A non-finite loss or gradient norm skips the step (weights unchanged, counted); after
        `max_consecutive_skips` skips in a row training stops with an error naming what went non-finite.
        """
        grads = [p.grad for p in self.trainable_parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) if grads \
            else torch.zeros(())
        norm_value = float(norm)
        bad = {k: v for k, v in stats.items() if k.endswith("loss") and not math.isfinite(v)}
        if not math.isfinite(norm_value):
            bad["optim/grad_norm"] = norm_value
        if bad:
            optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise FloatingPointError(
                    f"{self.consecutive_skips} optimizer steps in a row were skipped because values went "
                    f"non-finite; last: {bad} at global step {self.global_step} (policy version "
                    f"{self.policy_version}). Lower the learning rate, check the reward scale, or use bf16/fp32."
                )
            return norm_value
        self.consecutive_skips = 0
        if self.algorithm.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.algorithm.max_grad_norm,
                                gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        self.policy_version += 1
        return norm_value

    # ------------------------------------------------------------------ logging

    def log_samples(self, exp: Experience, count: int = 4) -> None:
        """Every `log_samples_every_n_steps` rollouts (the first included), a table of prompts, responses
        and scores to TensorBoard, one row from each of `count` different prompts."""
        every = self.log_samples_every_n_steps
        if not every or self.trainer is None or self.global_rank != 0 or (self.rollouts_done - 1) % every:
            return
        experiment = getattr(self.logger, "experiment", None) if self.logger is not None else None
        if experiment is None or not hasattr(experiment, "add_text"):
            return
        lines = ["| prompt | response | score |", "|---|---|---|"]
        for i in list(range(0, exp.batch_size, self.algorithm.group_size))[:count]:
            lines.append(f"| `{exp.prompts[i]}` | `{exp.responses[i]}` | {float(exp.scores[i]):.3f} |")
        experiment.add_text("samples", "\n".join(lines), global_step=self.global_step)


def build_reward_model(spec: Any, tokenizer_spec: Any, trust_remote_code: bool) -> SequenceRewardModel:
    from transformers import AutoModelForSequenceClassification

    if isinstance(spec, SequenceRewardModel):
        return freeze(spec)
    if isinstance(spec, str):
        from lit_rlhf.models import _check_local_path

        _check_local_path(spec, "model.reward_model")
        model = AutoModelForSequenceClassification.from_pretrained(spec, num_labels=1,
                                                                   trust_remote_code=trust_remote_code)
    else:
        model = spec
    disable_dropout(model)
    reward_tokenizer = None
    if tokenizer_spec is not None:
        reward_tokenizer = load_tokenizer(tokenizer_spec, "model.reward_tokenizer", trust_remote_code)
    return freeze(SequenceRewardModel(model, reward_tokenizer))


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int | None) -> Callable[[int], float]:
    """Multiplier of the base learning rate at optimizer step `step`."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or not total_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
