"""`sampling.backend: vllm` with `sampling.vllm.mode: colocate`: a vLLM engine in the training process.

The engine is built at the first rollout from the policy's own weights (written once to a temporary folder, with
LoRA adapters merged), in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), with a KV cache of
`sampling.vllm.kv_cache_gib` on a CPU or `gpu_memory_utilization` of a GPU. After every optimizer step the
module calls `sync_weights`, which loads the policy's current weights into the engine's model through the
worker's `reload_weights` and clears the prefix cache (cached prompts were computed with the old weights).
Prompts go in as token ids and responses come back as token ids with their log-probs.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn

from lit_rlhf.config import SamplingConfig, VLLMConfig
from lit_rlhf.rollout.backends.vllm_common import (
    call_with_timeout,
    import_vllm,
    plain_model,
    policy_weights,
    prompt_rows,
    request_seed,
    response_grid,
    sampling_params,
)
from lit_rlhf.rollout.generation import EosIds, Generation, finish_generation
from lit_rlhf.types import PromptBatch


class VLLMEngineBackend:
    """A vLLM `LLM` next to the trainer, sampling the policy's latest synced weights."""

    def __init__(
        self,
        policy: nn.Module,
        eos_token_id: EosIds,
        pad_token_id: int,
        settings: VLLMConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        self.vllm = import_vllm(settings)
        self.generator = generator  # the request seeds' source (None: the global RNG)
        self.settings, self.eos_token_id, self.pad_token_id = settings, eos_token_id, pad_token_id
        self.device = next(policy.parameters()).device
        self.folder = tempfile.TemporaryDirectory(prefix="lit_rlhf-vllm-")
        plain_model(policy).save_pretrained(self.folder.name)  # the architecture and first weights
        self.llm = call_with_timeout("building the engine", settings, lambda: self._build(policy))

    def _build(self, policy: nn.Module) -> Any:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, sharing its memory
        on_gpu = self.device.type == "cuda"
        if not on_gpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.settings.kv_cache_gib)
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        return self.vllm.LLM(
            model=self.folder.name,
            dtype=dtype,
            seed=0,
            enforce_eager=self.settings.enforce_eager,
            max_model_len=self.settings.max_model_len,
            skip_tokenizer_init=True,  # token ids in and out
            generation_config="vllm",  # the sampling settings are ours, not the checkpoint's defaults
            logprobs_mode="processed_logprobs",  # after the temperature, as the trainer computes them
            enable_prefix_caching=True,
            **({"gpu_memory_utilization": self.settings.gpu_memory_utilization} if on_gpu else {}),
        )

    def generate(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Generation:
        params = self.vllm.SamplingParams(
            **sampling_params(sampling, group_size, request_seed(self.generator), self.eos_token_id), detokenize=False
        )
        requests = [{"prompt_token_ids": ids} for ids in prompt_rows(prompts.input_ids, prompts.attention_mask)]
        outputs = call_with_timeout(
            "generate", self.settings, lambda: self.llm.generate(requests, params, use_tqdm=False)
        )
        samples = []
        for output in outputs:  # in prompt order; each prompt's samples by their index
            for sample in sorted(output.outputs, key=lambda s: s.index):
                chosen = [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs, strict=True)]
                samples.append((sample.token_ids, chosen))
        raw, logprobs = response_grid(samples, self.pad_token_id, self.device)
        prompts = prompts.to(self.device)
        return finish_generation(prompts, group_size, raw, self.eos_token_id, self.pad_token_id, logprobs)

    @torch.no_grad()
    def sync_weights(self, policy: nn.Module) -> None:
        weights = list(policy_weights(policy).items())

        def reload() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()

        call_with_timeout("sync_weights", self.settings, reload)

    def close(self) -> None:
        self.llm = None
        self.folder.cleanup()
