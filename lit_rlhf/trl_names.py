"""TRL's option names and what lit_rlhf calls them (docs/migrating-from-trl.md).

A TRL name is refused, never aliased: a setting keeps one spelling in configs, `--print_config`, `hparams.yaml`
and checkpoints, and several TRL options do not mean exactly what ours do (`beta` defaults to 0 there,
`per_device_train_batch_size` counts completions, not prompts), so the error names ours and says how to convert.
`config.check_foreign_names` raises it from the constructors, `cli.CheckedCLI` from a config file or the command
line, before LightningCLI's own "unexpected key" error.
"""

from __future__ import annotations

from typing import NamedTuple


class TRLName(NamedTuple):
    """One TRL option: ours (a dotted setting, or None when lit_rlhf has no counterpart) and how to convert."""

    ours: str | None
    how: str = ""


# TRL's GRPOConfig / RLOOConfig (and the TrainingArguments options GRPO scripts set) -> ours.
TRL_NAMES: dict[str, TRLName] = {
    "num_generations": TRLName("model.algorithm.group_size", "responses sampled per prompt"),
    "rloo_k": TRLName("model.algorithm.group_size", "with model.algorithm.advantage_estimator: rloo"),
    "beta": TRLName("model.algorithm.kl_coef", "TRL's default is 0.0, without a reference; GRPO's here is 0.04"),
    "epsilon": TRLName("model.algorithm.clip_eps_low", "the lower (and, unless clip_eps_high is set, upper) clip"),
    "cliprange": TRLName("model.algorithm.clip_eps_low"),
    "epsilon_high": TRLName("model.algorithm.clip_eps_high"),
    "delta": TRLName("model.algorithm.dual_clip", "the same cap on the ratio of tokens with negative advantage"),
    "importance_sampling_level": TRLName("model.algorithm.ratio_level", "'token' or 'sequence', the same values"),
    "num_iterations": TRLName("model.algorithm.ppo_epochs", "updates per rollout"),
    "num_ppo_epochs": TRLName("model.algorithm.ppo_epochs"),
    "num_mini_batches": TRLName("model.algorithm.num_minibatches"),
    "steps_per_generation": TRLName("model.algorithm.num_minibatches", "optimizer steps per rollout"),
    "loss_type": TRLName(
        "model.algorithm.loss_aggregation",
        "'dapo'/'bnpo' -> token_mean, 'grpo' -> seq_mean_token_mean, 'dr_grpo' -> seq_mean_token_sum_norm",
    ),
    "scale_rewards": TRLName(
        "model.algorithm.advantage_estimator", "'group'/true -> grpo, 'batch' -> batch_std, 'none'/false -> dr_grpo"
    ),
    "normalize_advantages": TRLName("model.algorithm.whiten_advantages"),
    "mask_truncated_completions": TRLName("model.algorithm.mask_truncated"),
    "top_entropy_quantile": TRLName("model.algorithm.entropy_top_fraction", "the same fraction of tokens kept"),
    "max_grad_norm": TRLName("model.algorithm.max_grad_norm"),
    "gradient_accumulation_steps": TRLName(
        "model.algorithm.micro_batch_size", "split each minibatch into micro-batches instead of accumulating steps"
    ),
    "kl_coef": TRLName("model.algorithm.kl_coef"),
    "max_completion_length": TRLName("model.sampling.max_new_tokens"),
    "response_length": TRLName("model.sampling.max_new_tokens"),
    "temperature": TRLName("model.sampling.temperature"),
    "top_p": TRLName("model.sampling.top_p"),
    "top_k": TRLName("model.sampling.top_k", "0 (not None) turns it off"),
    "use_vllm": TRLName("model.sampling.backend", "the rollout backend ('lean', 'compiled', 'generate')"),
    "max_prompt_length": TRLName("data.max_prompt_length"),
    "per_device_train_batch_size": TRLName(
        "data.batch_size", "prompts per process and step: TRL's completions per device / num_generations"
    ),
    "generation_batch_size": TRLName("data.batch_size", "prompts per rollout (x group_size responses)"),
    "learning_rate": TRLName("model.lr"),
    "adam_beta1": TRLName("model.betas", "[adam_beta1, adam_beta2]"),
    "adam_beta2": TRLName("model.betas", "[adam_beta1, adam_beta2]"),
    "lr_scheduler_type": TRLName("model.lr_schedule", "'constant', 'linear' or 'cosine'"),
    "weight_decay": TRLName("model.weight_decay"),
    "warmup_steps": TRLName("model.warmup_steps"),
    "gradient_checkpointing": TRLName("model.gradient_checkpointing"),
    "reward_weights": TRLName("model.reward_weights"),
    "reward_funcs": TRLName("model.reward_fns", "dotted paths or callables fn(prompts, responses, **columns)"),
    "peft_config": TRLName("model.lora", "a peft LoraConfig, or {r, alpha, dropout, target_modules}"),
    "reward_processing_classes": TRLName("model.reward_tokenizer", "the reward model's tokenizer"),
    "model_init_kwargs": TRLName("model.policy", "load the model yourself (dtype, attention) and pass the instance"),
    "generation_kwargs": TRLName("model.sampling", "its fields: max_new_tokens, temperature, top_p, top_k"),
    "shuffle_dataset": TRLName("data.shuffle"),
    "vllm_importance_sampling_cap": TRLName("model.algorithm.tis_cap", "the same cap on the sampler correction"),
    "log_completions": TRLName("model.log_samples_every_n_steps", "0: never"),
    "num_generations_eval": TRLName("model.val_samples_per_prompt"),
    "num_train_epochs": TRLName("trainer.max_epochs"),
    "max_steps": TRLName("trainer.max_steps"),
    "logging_steps": TRLName("trainer.log_every_n_steps"),
    "output_dir": TRLName("trainer.default_root_dir"),
    "save_steps": TRLName("trainer.callbacks", "a ModelCheckpoint with every_n_train_steps"),
    "eval_steps": TRLName("trainer.val_check_interval"),
    "report_to": TRLName("trainer.logger", "a Lightning logger (TensorBoardLogger, WandbLogger, MLFlowLogger, ...)"),
    "bf16": TRLName("trainer.precision", "bf16-mixed"),
    "seed": TRLName("seed_everything", "and data.seed for the prompt order"),
    "min_p": TRLName(None, "sample with top_p / top_k (model.sampling)"),
    "repetition_penalty": TRLName(None, "the sampled distribution is the policy's (the ratio needs it)"),
    "sync_ref_model": TRLName(None, "the reference stays the initial policy"),
}


def trl_name_message(where: str, key: str) -> str | None:
    """The error for `key`, found where lit_rlhf does not know it (`where`: 'model', 'model.algorithm', ...), if
    it is one of TRL's names; None otherwise."""
    name = TRL_NAMES.get(key)
    if name is None:
        return None
    how = f" ({name.how})" if name.how else ""
    if name.ours is None:
        return f"{where}.{key}: is a TRL option without a counterpart here{how}; see docs/migrating-from-trl.md"
    return (
        f"{where}.{key}: is TRL's name; lit_rlhf calls it {name.ours}{how}; set that instead "
        "(docs/migrating-from-trl.md maps every option)"
    )
