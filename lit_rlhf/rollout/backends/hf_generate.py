"""Hugging Face `generate` as a rollout backend (`sampling.backend: generate`): every model transformers can
sample, at `generate`'s per-step cost. It draws from the global RNG (seeded per rank by the module)."""

from __future__ import annotations

from torch import Tensor

from lit_rlhf.config import SamplingConfig
from lit_rlhf.rollout.backends.base import InProcessBackend
from lit_rlhf.rollout.generation import eos_id_list
from lit_rlhf.types import PromptBatch


class GenerateBackend(InProcessBackend):
    """`policy.generate` over each prompt repeated `group_size` times (it prefills every copy)."""

    def raw_responses(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Tensor:
        from transformers import GenerationConfig

        prompt_ids = prompts.input_ids.repeat_interleave(group_size, dim=0)  # (B, P)
        prompt_mask = prompts.attention_mask.repeat_interleave(group_size, dim=0)  # (B, P)
        shaping = {"temperature": sampling.temperature, "top_k": sampling.top_k or None, "top_p": sampling.top_p}
        config = GenerationConfig(
            do_sample=sampling.do_sample,
            max_new_tokens=sampling.max_new_tokens,
            **(shaping if sampling.do_sample else {}),
            eos_token_id=eos_id_list(self.eos_token_id),  # generate stops at the first of them
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        out = self.policy.generate(  # type: ignore[operator]  # a transformers method: nn.Module types it Tensor | Module
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
        )
        return out[:, prompt_ids.shape[1] :]
