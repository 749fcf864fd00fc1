"""The settings section: the values the CLI already validated, with the defaults that were filled in and matter."""

from __future__ import annotations

from typing import Any

from lit_rlhf.preflight.report import Section
from lit_rlhf.preflight.run_length import RunLength, duration


def describe_settings(section: Section, module: Any, datamodule: Any, trainer: Any, length: RunLength) -> None:
    """Lines for the algorithm, sampling, batch shape, devices and run length; warns on a run with no end."""
    algo, sampling = module.algorithm, module.sampling
    filled = algo.filled
    kl = f"kl_coef {filled.kl_coef:g} ({filled.kl_estimator}, {'in reward' if filled.kl_in_reward else 'in loss'})"
    section.line(
        f"algorithm {algo.name}: group_size {filled.group_size}, advantage_estimator {filled.advantage_estimator}, "
        f"{kl}, critic {'yes' if algo.uses_critic else 'no'}, reference {'yes' if algo.uses_reference else 'no'}"
    )
    micro = algo.micro_batch_size or algo.micro_batch_tokens
    section.line(
        f"update: ppo_epochs {algo.ppo_epochs} x num_minibatches {algo.num_minibatches}, micro-batch "
        f"{micro if micro else 'the whole minibatch'}, lr {module.hparams['lr']:g}, lora "
        f"{'r ' + str(module.hparams['lora'].get('r')) if module.hparams.get('lora') else 'off'}"
    )
    section.line(
        f"sampling: backend {sampling.backend}, max_new_tokens {sampling.max_new_tokens}, temperature "
        f"{sampling.temperature:g}, top_k {sampling.top_k}, top_p {sampling.top_p:g}"
    )
    rows = datamodule.batch_size * filled.group_size
    section.line(
        f"batch: {datamodule.batch_size} prompts x {filled.group_size} = {rows} responses per rollout and process; "
        f"prompts up to {datamodule.max_prompt_length} tokens ({datamodule.prompt_truncation} beyond)"
    )
    section.line(
        f"trainer: {trainer.strategy.root_device.type} x {trainer.world_size} process(es), precision "
        f"{trainer.precision}, memory_check {module.hparams['memory_check']}"
    )
    _describe_length(section, length)


def _describe_length(section: Section, length: RunLength) -> None:
    limit = f", or trainer.max_time {duration(length.max_time_s)} first" if length.max_time_s else ""
    if length.rollouts is None:
        section.line(f"run: no rollout limit; trainer.max_time {duration(length.max_time_s or 0)} ends it")
    else:
        section.line(
            f"run: {length.rollouts} rollouts ({length.bound_by}; {length.rollouts_per_epoch} per epoch){limit}; "
            f"{length.evaluations} held-out evaluations of {length.val_batches} batches, "
            f"{length.sanity_batches} sanity batches"
        )
    if length.rollouts is None and length.max_time_s is None:
        section.warn("the run has no end (no max_epochs, max_steps or max_time)", "trainer.max_steps")
