"""`sampling.backend` -> how to build that backend: the one table of samplers."""

from __future__ import annotations

from collections.abc import Callable

from lit_rlhf.config import VLLMConfig
from lit_rlhf.rollout.backends.base import BackendContext, RolloutBackend
from lit_rlhf.rollout.backends.hf_generate import GenerateBackend
from lit_rlhf.rollout.backends.lean import CompiledBackend, LeanBackend


def vllm_backend(context: BackendContext) -> RolloutBackend:
    """A vLLM engine in this process (`sampling.vllm.mode: colocate`) or a client of a vLLM server (`server`)."""
    settings = context.sampling.vllm or VLLMConfig()
    policy, eos, pad = context.policy, context.eos_token_id, context.pad_token_id
    if settings.mode == "server":
        from lit_rlhf.rollout.backends.vllm_server import VLLMServerBackend

        return VLLMServerBackend(policy, eos, pad, settings, context.global_rank, context.generator)
    from lit_rlhf.rollout.backends.vllm_engine import VLLMEngineBackend

    return VLLMEngineBackend(policy, eos, pad, settings, context.generator)


BACKENDS: dict[str, Callable[[BackendContext], RolloutBackend]] = {
    "lean": LeanBackend.from_context,
    "compiled": CompiledBackend.from_context,
    "generate": GenerateBackend.from_context,
    "vllm": vllm_backend,
}
"""Every value of `SamplingConfig.backend` (`config.SamplingBackend` lists the same names; a test checks)."""


def make_backend(context: BackendContext) -> RolloutBackend:
    """The backend `context.sampling.backend` names, over `context.policy`."""
    return BACKENDS[context.sampling.backend](context)
