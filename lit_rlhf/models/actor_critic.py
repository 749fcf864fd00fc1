"""The actor-critic: a policy head and a value head on one backbone (or a separate critic backbone), both on the
(B, T) response grid (`lit_rlhf.models.forward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

from lit_rlhf.models.forward import ResponseForward, causal_lm_response_forward


class ActorCritic(nn.Module):
    """A causal LM policy with a scalar value head on the last hidden state.

    The value head shares the policy's backbone, or sits on a separate critic backbone when one is given.
    Without a value head, `forward` returns values None (GRPO). `share_prompts`: run each distinct prompt of a
    batch once (`algorithm.share_prompt_forward`); `length_groups`: run rows of similar response length apart, in
    up to that many groups (`algorithm.length_groups`).
    """

    def __init__(
        self,
        policy: nn.Module,
        value_head: bool = True,
        critic_backbone: nn.Module | None = None,
        share_prompts: bool = False,
        length_groups: int = 1,
    ):
        super().__init__()
        self.policy = policy
        self.share_prompts = share_prompts
        self.length_groups = length_groups
        self.critic_backbone = critic_backbone
        self.value_head: nn.Linear | None = None
        if value_head or critic_backbone is not None:
            source = critic_backbone if critic_backbone is not None else policy
            hidden_size = source.get_output_embeddings().weight.shape[1]  # type: ignore[operator]  # transformers
            self.value_head = nn.Linear(hidden_size, 1)
            nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
            nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, response_len: int
    ) -> tuple[ResponseForward, Tensor | None]:
        """(B, P+T) -> the policy's `ResponseForward` (the LM head's input (B, T, H) and the head), values (B, T)
        float32 or None."""
        policy = causal_lm_response_forward(
            self.policy, input_ids, attention_mask, response_len, self.share_prompts, self.length_groups
        )
        if self.value_head is None:
            return policy, None
        hidden = policy.hidden
        if self.critic_backbone is not None:
            critic = causal_lm_response_forward(
                self.critic_backbone,
                input_ids,
                attention_mask,
                response_len,
                self.share_prompts,
                self.length_groups,
                head=False,
            )
            hidden = critic.hidden
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return policy, values


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module` in eval mode for the block (sampling must not see training-only behaviour), then as it was."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
