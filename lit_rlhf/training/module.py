"""`RLHFModule`: the LightningModule that holds the models and runs one PPO/GRPO step per prompt batch.

A training step is five phases (`training_step`); formulas live in `lit_rlhf.algorithms`, sampling and
scoring in `lit_rlhf.rollout`, model building in `lit_rlhf.models.build`, resume state in `state`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.algorithms.experience import (
    PolicyForward,
    compute_advantages,
    make_experience,
    sampler_metrics,
    shaping_metrics,
)
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.config import (
    AlgorithmConfig,
    LRSchedule,
    ResumeChanges,
    SamplingConfig,
    algorithm_and_sampling,
    check_module_settings,
    held_out_sampling,
    refuses_trl_names,
)
from lit_rlhf.models.build import BUILD_OPTIONS, MODEL_ARGUMENTS, ModelSpecs, build_models
from lit_rlhf.models.export import PolicyExport
from lit_rlhf.models.loading import load_tokenizer
from lit_rlhf.models.lora import lora_settings
from lit_rlhf.rewards.composer import RewardComposer, RewardIsolation
from lit_rlhf.rewards.functions import RewardFns, function_list, resolve_reward_fns
from lit_rlhf.rollout.collect import RolloutSettings
from lit_rlhf.rollout.environment import EnvironmentConfig
from lit_rlhf.rollout.generation import Generation
from lit_rlhf.rollout.multi_turn import conversations_from
from lit_rlhf.rollout.scoring import PendingRollout, overlap_metrics, split_pending
from lit_rlhf.training import metrics as logs
from lit_rlhf.training.batching import micro_batches, padding_fraction
from lit_rlhf.training.context_window import ContextWindowCheck
from lit_rlhf.training.evaluation import HeldOutEvaluation
from lit_rlhf.training.forwards import ModelForwards
from lit_rlhf.training.host_memory import return_freed_memory_on_cpu
from lit_rlhf.training.lightning_checks import LightningToolChecks
from lit_rlhf.training.memory_plan import MemoryCheck, fit_memory_check
from lit_rlhf.training.optim import ManualOptimization, single_optimizer
from lit_rlhf.training.rank0_weights import Rank0Loader
from lit_rlhf.training.sharding import check_fsdp2_settings, is_fsdp2, reshard_frozen, shard_loaded_models
from lit_rlhf.training.state import ExactResume, TrainingState
from lit_rlhf.training.step_boundary import StepBoundary
from lit_rlhf.training.step_logging import StepLogging
from lit_rlhf.training.trainer_state import reward_trainer_state
from lit_rlhf.types import Experience, PromptBatch, Rollout, iterate_minibatches


@refuses_trl_names("model")
class RLHFModule(
    LightningToolChecks,
    StepBoundary,
    ExactResume,
    ManualOptimization,
    StepLogging,
    HeldOutEvaluation,
    PolicyExport,
    ContextWindowCheck,
    ModelForwards,
):
    """PPO, GRPO and their variants for causal language models (every setting: docs/settings.md).

    Args:
        policy: model name, local folder, 'builtin:digits', or a transformers causal LM instance.
        tokenizer: name, folder or instance; defaults to `policy`'s.
        reference: frozen reference policy (name or instance); defaults to a frozen copy of `policy`.
        reward_model: sequence-classification reward model (name, folder or instance), or None.
        reward_tokenizer: the reward model's tokenizer when it differs from the policy's; None: shared ids.
        reward_fns: one reward function or a list (dotted paths or callables; lit_rlhf.rewards.binding); None: none.
        reward_weights: one weight per reward function (default 1 each).
        reward_model_weight: the weight of the reward model's score.
        nan_score: replace NaN scores from reward functions by this value (default: NaN is an error).
        reward_timeout_s: seconds a reward call may run (None: no limit).
        reward_workers: threads that run the reward calls (0: none, the calls run in turn).
        reward_isolation: 'thread' or 'process' (worker processes killed at the limit: a hard bound; docs/settings.md).
        algorithm: the PPO/GRPO settings; None: AlgorithmConfig(), GRPO's defaults (--model.algorithm.help).
        sampling: the generation settings; None: SamplingConfig() (--model.sampling.help).
        lr: AdamW's learning rate over the trainable parameters.
        weight_decay: AdamW's weight decay.
        betas: AdamW's betas.
        warmup_steps: optimizer steps of linear warm-up.
        lr_schedule: after the warm-up, 'constant', 'linear' or 'cosine' decay to max_steps.
        separate_critic: the value head gets its own copy of the backbone instead of sharing the policy's.
        gradient_checkpointing: recompute activations in backward to save memory.
        log_samples_every_n_steps: prompt/response samples every this many rollouts (0: never).
        trust_remote_code: allow model code from the model folder (off unless you trust it).
        max_consecutive_skips: stop after this many optimizer steps in a row skipped for non-finite values.
        lora: LoRA adapters on the policy (needs `peft`), e.g. {r: 8, alpha: 16} or a peft LoraConfig; the
            reference is then the same weights with the adapters disabled. None: full fine-tuning.
        metric_fns: held-out metrics (one or a list; reward-function contract) logged as `val/<name>`; None: none.
        val_sampling: how held-out prompts are answered; None: greedy, with `sampling`'s max_new_tokens and backend.
        val_samples_per_prompt: answers per held-out prompt (default: one).
        environment: multi-turn rollouts against this environment (docs/multi-turn.md); None: single-turn.
        overlap_scoring: score each rollout on a background thread while phase 3's forwards run (same results).
        memory_check: at fit start, before the models load, plan the memory per device ('error': refuse a plan
            over the free memory; 'warn'; 'off'); see `lit_rlhf.training.memory_plan` and `lit-rlhf-plan`.
        resume_changes: 'warn' naming each change, or 'error', when a resume would change the rollouts.
    """

    def __init__(
        self,
        policy: Any = "builtin:digits",
        tokenizer: Any = None,
        reference: Any = None,
        reward_model: Any = None,
        reward_tokenizer: Any = None,
        reward_fns: RewardFns | None = None,
        reward_weights: Sequence[float] | None = None,
        reward_model_weight: float = 1.0,
        nan_score: float | None = None,
        reward_timeout_s: float | None = None,
        reward_workers: int = 0,
        reward_isolation: RewardIsolation = "thread",
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
        metric_fns: RewardFns | None = None,
        val_sampling: SamplingConfig | None = None,
        val_samples_per_prompt: int = 1,
        environment: EnvironmentConfig | None = None,
        overlap_scoring: bool = False,
        memory_check: MemoryCheck = "error",
        resume_changes: ResumeChanges = "warn",
    ):
        super().__init__()
        self.automatic_optimization = False
        # one function alone is a list of one; LoRA settings checked before any model loads (a LoraConfig as a dict)
        reward_fns, metric_fns, lora = function_list(reward_fns), function_list(metric_fns), lora_settings(lora)
        self.algorithm, self.sampling = algorithm_and_sampling(algorithm, sampling)
        check_module_settings(locals(), self.sampling)  # every argument, before any model loads
        algo = self.algorithm
        self.setup_rollouts(conversations_from(environment, algo), RolloutSettings.training(algo, self.sampling))
        val = held_out_sampling(val_sampling, self.sampling)
        self.setup_evaluation(resolve_reward_fns(metric_fns, "model.metric_fns"), val, val_samples_per_prompt)
        settings = (reward_weights, reward_model_weight, nan_score, reward_timeout_s, reward_workers, reward_isolation)
        self.reward = RewardComposer(resolve_reward_fns(reward_fns), *settings)  # an unimportable one fails now
        self.specs = ModelSpecs(policy, tokenizer, reference, reward_model, reward_tokenizer)
        self.save_hyperparameters(ignore=[*MODEL_ARGUMENTS, "reward_fns", "metric_fns"])  # instances: by name
        self.record_named_settings(reward_fns=reward_fns, metric_fns=metric_fns)  # hparams.yaml: safe YAML
        tokenizer = policy if tokenizer is None else tokenizer  # the policy's own by default
        self.tokenizer = load_tokenizer(tokenizer, "model.tokenizer", trust_remote_code)
        self.actor_critic: Any = None  # an ActorCritic once configure_model ran
        self.reference, self.reward_model = None, None  # frozen models once configure_model ran (None: not used)
        self.state = TrainingState()
        self.last_update_stats: list[dict[str, float]] = []  # per minibatch, for inspection and tests
        self.step_metrics: dict[str, float] = {}  # the last training step's metrics, this rank's, unaveraged
        self.metric_window = logs.MetricWindow(last_value_keys=("optim/lr", "optim/skipped_updates"))
        if not isinstance(policy, str):  # an instance: build now so the user can inspect it
            self.configure_model()

    # ------------------------------------------------------------------ Lightning hooks

    def configure_model(self) -> None:
        """Load and wire the models (once)."""
        if self.actor_critic is not None:
            return
        fit_memory_check(self, self.hparams["memory_check"])  # at fit start: refuse a plan that cannot fit
        options = {k: self.hparams[k] for k in BUILD_OPTIONS}
        strategy: Any = self._trainer.strategy if self._trainer is not None and is_fsdp2(self._trainer) else None
        if strategy is not None:  # ModelParallelStrategy: rank 0 alone reads the weights (training/rank0_weights.py)
            check_fsdp2_settings(self, getattr(self, "shard_frozen", True))
            options["load_model"] = Rank0Loader(strategy)
        models = build_models(self.specs, self.tokenizer, self.algorithm, **options)
        self.actor_critic = models.actor_critic
        self.reference, self.reward_model = models.reference, models.reward_model
        if strategy is not None:  # FSDP2 units (training/sharding.py), each rank's shard of rank 0's weights
            shard_loaded_models(self, strategy)

    def train(self, mode: bool = True) -> RLHFModule:
        """Lightning switches everything to train mode; the frozen models stay in eval mode."""
        super().train(mode)
        for module in (self.reference, self.reward_model):
            if module is not None:
                module.eval()
        return self

    # ------------------------------------------------------------------ the training step

    def training_step(self, prompts: PromptBatch, batch_idx: int) -> None:
        # 1. prompts: this rank's batch from the DataModule
        clock = logs.PhaseClock()
        self.state.rollouts_done += 1
        # 2. rollout: sample group_size responses per prompt with the current policy, and score them
        rollout, timings = self.make_rollout(prompts)
        return_freed_memory_on_cpu(self.device)  # glibc keeps freed pages: sampling's would stay under phase 3
        clock.mark("rollout")
        # 3. experience: old and reference log-probs, KL, advantages (and the update's first forward, when the
        #    sampling policy's outputs come from it: a single pass over a rollout in one piece)
        experience, first_forward = self.make_experience(rollout)
        return_freed_memory_on_cpu(self.device)
        self.on_experience(experience)
        clock.mark("evaluate")
        # 4. update: ppo_epochs x minibatches x micro-batches
        lr = single_optimizer(self.optimizers()).param_groups[0]["lr"]  # the rate this rollout's (first) update uses
        update_stats = self.update(experience, first_forward)
        clock.mark("update")
        # 5. log
        tokens_per_s = float(experience.response_mask.sum()) / clock.total_s()
        values = {**logs.rollout_metrics(experience, self.algorithm), **update_stats, **clock.metrics(timings)}
        values.update(shaping_metrics(experience, self.algorithm, self.sampling.max_new_tokens))
        values.update({**sampler_metrics(experience), **logs.reward_part_metrics(experience, self.reward.names())})
        values.update({**timings.metrics, **overlap_metrics(timings)})
        skipped = float(self.state.skipped_updates)
        values.update({"perf/tokens_per_s": tokens_per_s, "optim/lr": lr, "optim/skipped_updates": skipped})
        self.log_step(values, experience)
        self.step_schedulers("step", self.state.rollouts_done, plateau=True)  # with this rollout's metrics

    def compute_scores(
        self, prompts: list[str], responses: list[str], meta: dict[str, list[Any]], generation: Generation
    ) -> Tensor:
        """Hook: one score per response, (B,) float. Default: the weighted reward functions and reward model.
        Every rollout and every held-out evaluation is scored here (truncation handling comes after)."""
        ids, mask, last = generation.input_ids(), generation.attention_mask(), generation.last_index()
        state = reward_trainer_state(self._trainer, self.algorithm)  # TRL's `trainer_state`, for functions taking it
        scores = self.reward(prompts, responses, meta, self.reward_model, ids, mask, last, ~generation.truncated, state)
        reshard_frozen(self.reward_model)  # FSDP2
        return scores

    def compute_advantages(
        self, rollout: Rollout, kl: Tensor | None, values: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Hook: advantages (B, T) and returns (B, T) or None from the rollout's scores, the per-token KL to the
        reference and the critic's values (either None when absent). Default: `algorithm`'s estimator."""
        return compute_advantages(self.algorithm, rollout.scores, kl, values, rollout.response_mask)

    def make_experience(self, rollout: Rollout | PendingRollout) -> tuple[Experience, PolicyForward | None]:
        """Phase 3: the reference's and sampling policy's forwards, then (a pending rollout's scores) the experience.

        When the update is one pass over the rollout in one piece, the sampling policy's forward is the update's
        first forward, run with grad and returned for the update to reuse; otherwise a no-grad one, and None."""
        rollout, scored = split_pending(rollout)  # a pending rollout's scores are joined after the forwards
        algo = self.algorithm
        reference = self.reference_forward(rollout) if self.reference is not None else None
        exact_kl = reference is not None and algo.kl_estimator == "full"  # the policy's forward computes it
        ref_logprobs = None
        if reference is not None and not exact_kl:
            ref_logprobs = self.token_logprobs(reference, rollout)
        reference = reference if exact_kl else None  # (B, T, H) kept only until the policy's forward
        first_forward = None
        if algo.policy_forward_in_rollout(rollout.batch_size):
            with torch.no_grad():
                sampling_policy = self.policy_forward(rollout, reference)
        else:
            sampling_policy = first_forward = self.policy_forward(rollout, reference)
        experience = make_experience(scored(), algo, sampling_policy, ref_logprobs, self.compute_advantages)
        return experience, first_forward

    def on_experience(self, experience: Experience) -> None:
        """Hook called with every complete experience before the update (for callbacks and tests)."""

    def update(self, exp: Experience, first_forward: PolicyForward | None = None) -> dict[str, float]:
        """Phase 4: `ppo_epochs` passes of minibatch steps; returns the statistics averaged over minibatches.

        `first_forward`: the policy's forward over the whole rollout with grad, the loss's first forward."""
        algo = self.algorithm
        minibatch_size = exp.batch_size // algo.num_minibatches
        micro_size = algo.micro_batch_size or minibatch_size
        self.last_update_stats = []
        for _ in range(algo.ppo_epochs):
            order = self.state.update_generator
            for minibatch in iterate_minibatches(exp, minibatch_size, order, shuffle=algo.num_minibatches > 1):
                totals = MinibatchTotals.of(minibatch, self.sampling.max_new_tokens)
                stats: dict[str, float] = {}
                pieces = micro_batches(minibatch, micro_size, algo.micro_batch_tokens)  # per rank: sync on its last
                for i, piece in enumerate(pieces):
                    with self.gradient_sync(enabled=i == len(pieces) - 1):
                        loss, micro_stats = self.micro_batch_loss(piece, totals, first_forward)
                        first_forward = None
                        self.manual_backward(loss)
                    for key, value in micro_stats.items():
                        stats[key] = stats.get(key, 0.0) + value
                stats["perf/update_padding"] = padding_fraction(pieces)
                stats["optim/grad_norm"] = self.clip_and_step(stats)
                self.last_update_stats.append(stats)
        return logs.mean_over(self.last_update_stats)
