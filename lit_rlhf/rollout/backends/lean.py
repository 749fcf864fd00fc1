"""The lean KV-cache sampler (`sampling.backend: lean`) and its static-cache compiled variant (`compiled`):
`lit_rlhf.rollout.sampler.sample` over the live policy, one prefill per prompt shared by its group."""

from __future__ import annotations

from torch import Tensor

from lit_rlhf.config import SamplingConfig
from lit_rlhf.rollout.backends.base import InProcessBackend
from lit_rlhf.rollout.sampler import sample
from lit_rlhf.types import PromptBatch


class LeanBackend(InProcessBackend):
    """Decode steps through the model's dynamic KV cache (same draws as Hugging Face `generate` for a seed)."""

    compile = False

    def raw_responses(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Tensor:
        shared = sampling.share_prefill  # one prefill per prompt, its KV cache repeated group_size times
        ids, mask = prompts.input_ids, prompts.attention_mask
        if not shared:
            ids, mask = ids.repeat_interleave(group_size, dim=0), mask.repeat_interleave(group_size, dim=0)
        return sample(
            self.policy,
            ids,
            mask,
            sampling.max_new_tokens,
            self.eos_token_id,
            self.pad_token_id,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            generator=self.generator,
            do_sample=sampling.do_sample,
            group_size=group_size if shared else 1,
            compile=self.compile,
        ).response_ids


class CompiledBackend(LeanBackend):
    """The lean sampler with its decode steps over a static KV cache of a bucketed length, through
    `torch.compile` (CUDA graphs on a GPU; `lit_rlhf.rollout.static_decode`): the same draws as `LeanBackend`."""

    compile = True
