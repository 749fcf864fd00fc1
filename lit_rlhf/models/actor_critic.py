"""The actor-critic (policy head + value head on one backbone) and the one forward that training,
evaluation and the reference share: logits (and hidden states) on the (B, T) response grid only.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from lit_rlhf.algorithms.losses import response_logits


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that ignore left padding: cumulative sum of the mask minus one, 0 on padding. (B, S)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def accepts_argument(model: nn.Module, argument: str) -> bool:
    """Whether `model.forward` takes `argument`; a peft wrapper passes its **kwargs to the base model."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        model = get_base()
    return argument in inspect.signature(model.forward).parameters


def causal_lm_response_forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    want_hidden: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logits predicting the last `response_len` tokens, and optionally the last hidden state there.

    input_ids, attention_mask (B, P+T) -> logits (B, T, V) in the model's dtype, hidden (B, T, H) or None.
    Only the T+1 last positions go through the LM head when the model supports `logits_to_keep`.
    """
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        output_hidden_states=want_hidden,
    )
    if accepts_argument(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = response_len + 1
    out = model(**kwargs)
    logits = out.logits
    kept_prompt = logits.shape[1] - response_len  # 1 when logits_to_keep worked, P otherwise
    logits = response_logits(logits, kept_prompt, response_len)
    hidden = None
    if want_hidden:
        last = out.hidden_states[-1]
        hidden = response_logits(last, last.shape[1] - response_len, response_len)
    return logits, hidden


class ActorCritic(nn.Module):
    """A causal LM policy with a scalar value head on the last hidden state.

    The value head shares the policy's backbone, or sits on a separate critic backbone when one is given.
    Without a value head, `forward` returns values None (GRPO).
    """

    def __init__(self, policy: nn.Module, value_head: bool = True, critic_backbone: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.critic_backbone = critic_backbone
        self.value_head: nn.Linear | None = None
        if value_head or critic_backbone is not None:
            source = critic_backbone if critic_backbone is not None else policy
            hidden_size = source.get_output_embeddings().weight.shape[1]  # type: ignore[operator]  # transformers
            self.value_head = nn.Linear(hidden_size, 1)
            nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> tuple[Tensor, Tensor | None]:
        """(B, P+T) -> logits (B, T, V), values (B, T) float32 or None."""
        shared = self.value_head is not None and self.critic_backbone is None
        logits, hidden = causal_lm_response_forward(
            self.policy, input_ids, attention_mask, response_len, want_hidden=shared
        )
        values = None
        if self.value_head is not None:
            if self.critic_backbone is not None:
                _, hidden = causal_lm_response_forward(
                    self.critic_backbone, input_ids, attention_mask, response_len, want_hidden=True
                )
            if hidden is None:
                raise RuntimeError("ActorCritic: the value head needs the last hidden state; the forward gave none")
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return logits, values


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module` in eval mode for the block (sampling must not see training-only behaviour), then as it was."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
