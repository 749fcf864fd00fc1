"""`sampling.backend: vllm` with `sampling.vllm.mode: colocate`: a vLLM engine in the training process.

The engine is built at the first rollout, in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), with a KV cache of
`sampling.vllm.kv_cache_gib` on a CPU or `gpu_memory_utilization` of a GPU, from the policy's weights written once
to a folder in shared memory: a LoRA policy's base weights (LoRA enabled at its rank), or, without adapters or
where vLLM cannot serve them (`vllm_weights.adapter_refusal`, logged), the full weights. After every optimizer step
the module calls `sync_weights`: a LoRA policy's adapters are written as the next version's adapter folder (a few
MB) and loaded under a new LoRA id, which every following request names; full weights go from the policy's own
tensors into the engine's model through the worker's `reload_weights` (no checkpoint, no copy but a merged LoRA's),
and the prefix cache is cleared. Prompts go in as token ids and responses come back as token ids with their
log-probs. `close` shuts the engine down and releases its process groups while they are still valid.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch import nn

from lit_rlhf.config import SamplingConfig, VLLMConfig
from lit_rlhf.rollout.backends.vllm_common import (
    call_with_timeout,
    import_vllm,
    plain_model,
    policy_weights,
    prompt_requests,
    request_seed,
    response_grid,
    sampling_params,
)
from lit_rlhf.rollout.backends.vllm_weights import (
    AdapterVersions,
    base_weights,
    serves_adapters,
    shared_memory_folder,
    tensor_bytes,
    vllm_max_lora_rank,
    write_weight_shards,
)
from lit_rlhf.rollout.generation import EosIds, Generation, finish_generation
from lit_rlhf.types import PromptBatch

log = logging.getLogger(__name__)


def no_chat_template_warmup(record: logging.LogRecord) -> bool:
    """Drops vLLM's "Chat template warmup failed" warning, whose traceback a user reads as a crash: the engine gets
    token ids, never chat messages, and has no tokenizer (`skip_tokenizer_init`) for the warmup to render with."""
    return record.getMessage() != "Chat template warmup failed"


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
        self.adapters, reason = serves_adapters(policy, settings.lora_adapters)
        if reason is not None:
            log.warning("sampling.vllm: the LoRA policy is synced as merged full weights: %s", reason)
        self.folder = shared_memory_folder("lit_rlhf-vllm-")
        model = os.path.join(self.folder.name, "model")  # the architecture and first (base) weights, sent once
        write_weight_shards(base_weights(policy) if self.adapters else policy_weights(policy).items(), model)
        plain_model(policy).config.to_json_file(os.path.join(model, "config.json"))
        self.versions = AdapterVersions(self.folder.name)
        self.lora_request: Any = None  # the adapter version every request names (LoRA policies)
        self.last_sync = (0.0, 0)  # (seconds, bytes) of the last sync_weights
        warmup_log = logging.getLogger("vllm.renderers.base")
        warmup_log.addFilter(no_chat_template_warmup)
        try:
            self.llm = call_with_timeout("building the engine", settings, lambda: self._build(policy, model))
        finally:
            warmup_log.removeFilter(no_chat_template_warmup)
        if self.adapters:
            self.sync_weights(policy)  # the adapters as they are now (trained ones when resumed)

    def _build(self, policy: nn.Module, model: str) -> Any:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, sharing its memory
        on_gpu = self.device.type == "cuda"
        if not on_gpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.settings.kv_cache_gib)
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        return self.vllm.LLM(
            model=model,
            dtype=dtype,
            seed=0,
            enforce_eager=self.settings.enforce_eager,
            max_model_len=self.settings.max_model_len,
            skip_tokenizer_init=True,  # token ids in and out
            generation_config="vllm",  # the sampling settings are ours, not the checkpoint's defaults
            logprobs_mode="processed_logprobs",  # after the temperature, as the trainer computes them
            enable_prefix_caching=True,
            **({"gpu_memory_utilization": self.settings.gpu_memory_utilization} if on_gpu else {}),
            **(
                {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(policy), "max_loras": 1}
                if self.adapters
                else {}
            ),
        )

    def generate(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Generation:
        rows, n = prompt_requests(prompts.input_ids, prompts.attention_mask, group_size, sampling)
        params = self.vllm.SamplingParams(
            **sampling_params(sampling, n, request_seed(self.generator), self.eos_token_id), detokenize=False
        )
        requests = [{"prompt_token_ids": ids} for ids in rows]
        outputs = call_with_timeout(
            "generate",
            self.settings,
            lambda: self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request),
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
        """The next version of the adapters (LoRA) or the full weights, straight from the policy's tensors."""
        start = time.perf_counter()
        if self.adapters:
            sent = call_with_timeout("sync_weights (LoRA adapters)", self.settings, lambda: self._load_adapter(policy))
        else:
            weights = policy_weights(policy)  # the policy's own tensors (a merged copy for LoRA)
            sent = tensor_bytes(weights.items())

            def reload() -> None:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
                self.llm.reset_prefix_cache()

            call_with_timeout("sync_weights", self.settings, reload)
        self.last_sync = (time.perf_counter() - start, sent)

    def _load_adapter(self, policy: nn.Module) -> int:
        """Write and load the next adapter version; requests name it from now on (the previous one is removed)."""
        name, lora_id, folder, sent = self.versions.write(policy)
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, lora_id, folder)
        self.llm.llm_engine.add_lora(request)
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
        self.lora_request = request
        self.versions.drop_older()
        return sent

    def close(self) -> None:
        """Shut the engine down (its executor, then vLLM's process groups, while they are valid: left to the
        interpreter's exit, vLLM's finalizer ran after the trainer had destroyed the default group and printed a
        traceback) and remove the weights folder."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        self.folder.cleanup()
