"""The module's forwards on a rollout or micro-batch, each model run as the others are (shared prompts, length
groups): the actor-critic's with its token statistics, the frozen reference's, log-probs from either, in chunks of
`algorithm.logit_chunk_tokens` tokens (`lit_rlhf.algorithms.chunked_logprobs`), and a micro-batch's loss."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lit_rlhf.algorithms.experience import PolicyForward, frozen_forward, policy_forward, response_stats
from lit_rlhf.algorithms.objective import MinibatchTotals, ppo_objective
from lit_rlhf.config import AlgorithmConfig, SamplingConfig
from lit_rlhf.models.forward import ResponseForward
from lit_rlhf.training.sharding import reshard_frozen
from lit_rlhf.types import Experience, Rollout


class ModelForwards:
    """For a module with `actor_critic`, `reference` (None: no reference), `algorithm` and `sampling`."""

    actor_critic: Any
    reference: Any
    algorithm: AlgorithmConfig
    sampling: SamplingConfig

    def policy_forward(self, mb: Rollout, reference: ResponseForward | None = None) -> PolicyForward:
        """The actor-critic's forward on a rollout or micro-batch and its token statistics (with the reference's
        forward, the exact KL to it)."""
        chunk = self.algorithm.logit_chunk_tokens
        return policy_forward(self.actor_critic, mb, self.sampling.temperature, chunk, reference)

    def reference_forward(self, mb: Rollout) -> ResponseForward:
        """The reference's forward (the LM head's input, no logits) on a rollout or micro-batch, run as the
        actor-critic's is."""
        assert self.reference is not None  # the callers check
        actor_critic = self.actor_critic
        forward = frozen_forward(self.reference, mb, actor_critic.share_prompts, actor_critic.length_groups)
        reshard_frozen(self.reference)  # FSDP2 (its head's weight was copied: `output_head.kept_after_reshard`)
        return forward

    def token_logprobs(self, forward: ResponseForward, mb: Rollout) -> Tensor:
        """The sampled tokens' log-probs (B, T) under a forward, at the sampling temperature (0 outside the mask)."""
        chunk = self.algorithm.logit_chunk_tokens
        return response_stats(forward, mb, self.sampling.temperature, chunk, entropy=False).logprobs

    def micro_batch_loss(
        self, mb: Experience, totals: MinibatchTotals, forward: PolicyForward | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch, normalised by its minibatch's totals (`forward`: its policy forward,
        when the caller already ran it)."""
        if forward is None:
            reference = None
            if self.algorithm.full_kl_in_loss and self.reference is not None:
                reference = self.reference_forward(mb)
            forward = self.policy_forward(mb, reference)
        return ppo_objective(forward, mb, self.algorithm, totals)
