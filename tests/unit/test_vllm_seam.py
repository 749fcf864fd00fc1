"""The seam to vLLM, without vLLM: a missing or untested vLLM is a setting error, a server that is down or hangs is
an error within the timeout (never a hang), requests carry our settings, and the sampler's log-probs feed the
mismatch metrics and truncated importance sampling; with the in-process samplers the trainer's log-probs are the
sampler's by construction. (tests/with_vllm runs the real engine and server where vLLM is installed.)"""

from __future__ import annotations

import math
import socket
import sys
import threading
import time
import types

import pytest
import torch

from conftest import free_port, make_policy, prompt_batch
from lit_rlhf import AlgorithmConfig, RLHFModule, SamplingConfig
from lit_rlhf.algorithms import losses
from lit_rlhf.algorithms.experience import policy_forward, sampler_metrics
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.config import ConfigError, VLLMConfig
from lit_rlhf.rollout.backends.base import BackendContext
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.rollout.backends.vllm_common import (
    VLLMError,
    call_with_timeout,
    import_vllm,
    prompt_requests,
    response_grid,
    sampling_params,
)
from lit_rlhf.rollout.sampler import sample

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def vllm_context(tokenizer, **vllm) -> BackendContext:
    sampling = SamplingConfig(max_new_tokens=4, backend="vllm", vllm=vllm or None)
    return BackendContext(make_policy(), tokenizer.eos_token_id, tokenizer.pad_token_id, sampling)


def test_a_missing_vllm_names_the_extra(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees where it is not installed
    with pytest.raises(ConfigError, match=r"sampling.backend: 'vllm' needs the vllm package.*\.\[vllm\]"):
        make_backend(vllm_context(tokenizer))


def test_a_vllm_outside_the_tested_range_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.40.1"))
    with pytest.raises(ConfigError, match=r"vLLM 0.40.1 is outside .*>= 0.32, < 0.33.*allow_untested_version"):
        import_vllm(VLLMConfig())
    assert import_vllm(VLLMConfig(allow_untested_version=True)).__version__ == "0.40.1"
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0+cpu"))
    assert import_vllm(VLLMConfig()).__version__ == "0.32.0+cpu"


def test_a_server_that_is_down_is_an_error_at_once(tokenizer):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(VLLMError, match=rf"the health check got no answer .*server_url=http://127.0.0.1:{port}"):
        make_backend(vllm_context(tokenizer, mode="server", server_url=f"http://127.0.0.1:{port}", timeout_s=30))
    assert time.monotonic() - start < 5


def test_a_server_that_hangs_is_an_error_within_the_timeout(tokenizer):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()  # accepts, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(VLLMError, match=r"the health check got no answer .* within sampling.vllm.timeout_s=1 s"):
        make_backend(vllm_context(tokenizer, mode="server", server_url=url, timeout_s=1))
    assert 0.9 < time.monotonic() - start < 5
    listener.close()


def test_engine_calls_end_in_errors_naming_them():
    settings = VLLMConfig(timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(VLLMError, match=r"generate did not finish within sampling.vllm.timeout_s=0.3 s \(colocate"):
        call_with_timeout("generate", settings, lambda: time.sleep(3))
    assert time.monotonic() - start < 2

    def broken():
        raise ValueError("bad prompt")

    with pytest.raises(VLLMError, match=r"sync_weights failed \(colocate mode\): ValueError: bad prompt"):
        call_with_timeout("sync_weights", settings, broken)
    assert call_with_timeout("x", settings, lambda: 3) == 3


def test_requests_carry_our_sampling_settings():
    sampling = SamplingConfig(max_new_tokens=9, temperature=0.7, top_k=5, top_p=0.9)
    params = sampling_params(sampling, 4, seed=11, eos_token_id=2)
    assert params == {
        "n": 4, "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 11, "logprobs": 0,
        "stop_token_ids": [2], "ignore_eos": False,
    }  # fmt: skip
    greedy = sampling_params(SamplingConfig(max_new_tokens=3, do_sample=False), 1, 0, 2)
    assert greedy["temperature"] == 0.0 and "top_k" not in greedy


def test_greedy_groups_send_each_prompt_group_size_times_with_n_1():
    # vLLM refuses n > 1 with greedy decoding; the same answers come from the prompt repeated
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    greedy = SamplingConfig(max_new_tokens=3, do_sample=False)
    assert prompt_requests(ids, mask, 3, greedy) == ([[5, 6]] * 3 + [[7, 8, 9]] * 3, 1)
    assert prompt_requests(ids, mask, 1, greedy) == ([[5, 6], [7, 8, 9]], 1)
    assert prompt_requests(ids, mask, 3, SamplingConfig(max_new_tokens=3)) == ([[5, 6], [7, 8, 9]], 3)


def test_engine_outputs_land_on_the_response_grid():
    ids, logprobs = response_grid([([5, 6, 2], [-0.5, -1.0, -0.1]), ([7], [-2.0])], pad_token_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 2], [7, 0, 0]]
    torch.testing.assert_close(logprobs, torch.tensor([[-0.5, -1.0, -0.1], [-2.0, 0.0, 0.0]]))


def test_vllm_settings_are_checked():
    with pytest.raises(ConfigError, match="sampling.vllm.mode: unknown value 'remote'"):
        SamplingConfig(backend="vllm", vllm={"mode": "remote"})
    with pytest.raises(ConfigError, match="sampling.vllm.server_url: must be an http:// or https:// address"):
        VLLMConfig(server_url="localhost:8000")
    with pytest.raises(ConfigError, match="sampling.vllm.kv_cache_gib: must be >= 1"):
        VLLMConfig(kv_cache_gib=0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="algorithm.tis_cap: must be >= 1"):
        AlgorithmConfig(tis_cap=0.5)
    with pytest.raises(ConfigError, match="sampling.vllm: set, but sampling.backend is 'lean', which would ignore"):
        SamplingConfig(vllm={"mode": "server"})


def test_the_in_process_samplers_log_probs_are_the_trainers(tokenizer):
    """Why the in-process samplers keep no log-probs of their own: the lean loop's log-probs of what it sampled
    are the trainer's forward over the same tokens, to float rounding."""
    module = RLHFModule(policy=make_policy(), tokenizer=tokenizer, reward_fns=[REWARD], algorithm={"group_size": 3})
    batch = prompt_batch(tokenizer, ["3142>", "90>"])
    policy = module.actor_critic.policy.eval()
    torch.manual_seed(0)
    T = module.sampling.max_new_tokens
    out = sample(policy, batch.input_ids, batch.attention_mask, T, 1, 0, group_size=3, return_logprobs=True)
    torch.manual_seed(0)
    rollout, _ = module.make_rollout(batch)
    assert torch.equal(rollout.response_ids, out.response_ids)  # the same draws (pad after EOS either way)
    with torch.no_grad():
        trainer = policy_forward(module.actor_critic.eval(), rollout, 1.0, 1024).logprobs
    mask = rollout.response_mask
    torch.testing.assert_close(trainer[mask], out.logprobs[mask], atol=1e-5, rtol=0)
    assert rollout.sampler_logprobs is None and sampler_metrics(module.make_experience(rollout)[0]) == {}


def test_truncated_importance_weights_and_the_mismatch_metrics(tokenizer):
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    sampler = old - torch.tensor([[0.0, math.log(4.0), math.log(1.5)]])  # ratios 1, 4, 1.5
    weight, capped = losses.truncated_importance_weight(old, sampler, cap=2.0)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 2.0, 1.5]]))
    assert capped.tolist() == [[False, True, False]]

    module = RLHFModule(
        policy=make_policy(), tokenizer=tokenizer, reward_fns=[REWARD],
        algorithm=AlgorithmConfig(group_size=2, kl_coef=0.0, tis_cap=2.0, micro_batch_size=2),
    )  # fmt: skip
    torch.manual_seed(0)
    exp, _ = module.make_experience(module.make_rollout(prompt_batch(tokenizer, ["3142>", "90>"]))[0])
    totals = MinibatchTotals.of(exp, module.sampling.max_new_tokens)
    plain, _ = module.micro_batch_loss(exp, totals)  # no sampler log-probs: no weights
    quartered = exp.old_logprobs - math.log(4.0)  # a sampler 4x less likely on every token: every weight capped at 2
    exp.sampler_logprobs = torch.where(exp.response_mask, quartered, torch.zeros_like(quartered))
    weighted, stats = module.micro_batch_loss(exp, totals)
    torch.testing.assert_close(weighted, 2 * plain)
    assert stats["policy/tis_weight_mean"] == pytest.approx(2.0) and stats["policy/tis_capped_frac"] == 1.0
    metrics = sampler_metrics(exp)
    assert metrics["sampler/logprob_diff_mean"] == pytest.approx(math.log(4.0), abs=1e-5)
    assert metrics["sampler/frac_diff_over_0.1"] == 1.0
