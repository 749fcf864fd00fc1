"""`sampling.backend: vllm` on this CPU with SmolLM2-135M-Instruct, in both modes: after each weight update vLLM's
log-probs of the tokens it sampled equal the trainer's float32 log-probs of the same tokens (and differ before the
update), seeded requests repeat, GRPO runs end to end with full and LoRA training, and ranks share a server.

These run in an environment with vLLM installed (`.ci/run` builds `.venv-vllm` and runs this folder there,
docs/vllm.md) and skip elsewhere. They need SmolLM2-135M-Instruct as a Hugging Face folder at models/smollm2-135m
(`python scripts/prepare_smollm2.py --out models/smollm2-135m`). No conftest.py here: a second one would shadow
tests/conftest.py's helpers, which other tests import by module name."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (docs/vllm.md)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine in the test process

from conftest import forward_logits, full_logprobs
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.rollout.backends.base import BackendContext
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.rollout.backends.vllm_common import VLLMError
from lit_rlhf.rollout.generation import Generation
from lit_rlhf.types import PromptBatch

MODEL = pathlib.Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def model_folder() -> str:
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no SmolLM2 folder at {MODEL}: python scripts/prepare_smollm2.py --out models/smollm2-135m")
    return str(MODEL)


@pytest.fixture(scope="session")
def vllm_server(model_folder, tmp_path_factory):
    """One server for the session's server-mode tests, started as docs/vllm.md says (stopped with its engine at the
    end)."""
    from vllm_server import start_server, stop_server  # scripts/ (tests/conftest.py puts it on the path)

    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        process, url = start_server(model_folder, log)
        yield url
        stop_server(process)


SYNC_TOLERANCE = 1e-3
"""Largest |log-prob(vLLM) - log-prob(trainer)| on a sampled token after a sync, float32 (measured: 4e-5)."""
STALE_AT_LEAST = 0.05
"""After a 2% weight perturbation without a sync the largest difference is far above the tolerance (~0.7)."""


def load(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), tokenizer


def prompts(tokenizer) -> PromptBatch:
    texts = ["Hello, how are", "The capital of France is"]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return PromptBatch(encoded["input_ids"], encoded["attention_mask"], texts)


def largest_gap(policy, gen: Generation) -> float:
    """max |trainer log-prob - the backend's| over the sampled tokens."""
    ids = torch.cat([gen.prompt_ids, gen.response_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.response_mask.long()], 1)
    with torch.no_grad():
        logits = forward_logits(policy, ids, mask, gen.response_ids.shape[1])
    ours = full_logprobs(logits, gen.response_ids, 1.0).float()
    assert gen.logprobs is not None
    return float((ours - gen.logprobs).abs()[gen.response_mask].max())


def perturb(policy, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(noise * 0.02 * parameter.std())


def vllm_backend(policy, tokenizer, mode: str, server_url: str | None = None):
    """A vLLM backend over `policy` (colocate, or a client of the server at `server_url`) and its sampling settings
    (10 new tokens)."""
    vllm = {"mode": mode, "max_model_len": 256, **({"server_url": server_url} if mode == "server" else {})}
    sampling = SamplingConfig(max_new_tokens=10, backend="vllm", vllm=vllm)
    return make_backend(BackendContext(policy, tokenizer.eos_token_id, tokenizer.pad_token_id, sampling)), sampling


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_weight_sync_is_exact_and_sampling_repeats_for_a_seed(model_folder, request, mode):
    policy, tokenizer = load(model_folder)
    url = request.getfixturevalue("vllm_server") if mode == "server" else None
    backend, sampling = vllm_backend(policy, tokenizer, mode, url)
    try:
        batch = prompts(tokenizer)
        gen = backend.generate(batch, 3, sampling)
        assert gen.response_ids.shape[0] == 6 and largest_gap(policy, gen) < SYNC_TOLERANCE
        perturb(policy, seed=1)
        assert largest_gap(policy, backend.generate(batch, 3, sampling)) > STALE_AT_LEAST  # not synced yet
        backend.sync_weights(policy)
        assert largest_gap(policy, backend.generate(batch, 3, sampling)) < SYNC_TOLERANCE
        torch.manual_seed(7)
        first = backend.generate(batch, 3, sampling)
        torch.manual_seed(7)
        again = backend.generate(batch, 3, sampling)
        assert torch.equal(first.response_ids, again.response_ids)  # the request seed comes from the run's RNG
    finally:
        backend.close()


def brevity(prompts: list[str], responses: list[str], **meta) -> list[float]:
    return [-len(response) / 100 for response in responses]


def fit_grpo(model_folder: str, vllm: dict, steps: int, **module_settings) -> RLHFModule:
    import lightning as L

    module = RLHFModule(
        policy=model_folder,
        reward_fns=[brevity],
        algorithm=AlgorithmConfig(group_size=2, kl_coef=0.0, tis_cap=2.0),
        sampling=SamplingConfig(max_new_tokens=8, backend="vllm", vllm={"max_model_len": 256, **vllm}),
        lr=1e-4,
        **module_settings,
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1,
    )  # fmt: skip
    data = RolloutDataModule(prompts=["Name a colour.", "Count to three.", "Say hi."], batch_size=2, seed=0)
    trainer.fit(module, data)
    return module


@pytest.mark.parametrize(
    "mode, lora", [("colocate", None), ("colocate", {"r": 4, "alpha": 8}), ("server", None)], ids=str
)
def test_grpo_steps_sample_the_synced_policy(model_folder, request, mode, lora):
    vllm = {"mode": mode}
    if mode == "server":
        vllm["server_url"] = request.getfixturevalue("vllm_server")
    module = fit_grpo(model_folder, vllm, steps=2, lora=lora)
    metrics = module.step_metrics  # the second rollout, sampled after the first update was synced
    assert module.state.policy_version == 2
    assert metrics["sampler/logprob_diff_max"] < SYNC_TOLERANCE
    assert 0.99 < metrics["policy/tis_weight_mean"] < 1.01


def test_ranks_share_one_server_and_only_rank_zero_pushes(model_folder, vllm_server, tmp_path):
    policy, tokenizer = load(model_folder)
    settings = {"mode": "server", "server_url": vllm_server, "weights_dir": str(tmp_path), "timeout_s": 3}
    sampling = SamplingConfig(max_new_tokens=4, backend="vllm", vllm=settings)
    ids = tokenizer.eos_token_id, tokenizer.pad_token_id
    rank0 = make_backend(BackendContext(policy, *ids, sampling, global_rank=0))
    rank1 = make_backend(BackendContext(policy, *ids, sampling, global_rank=1))
    batch = prompts(tokenizer)
    rank1.generate(batch, 1, sampling)  # version 1 was pushed by rank 0 when it was built
    perturb(policy, seed=2)
    rank1.sync_weights(policy)  # counts version 2, pushes nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pushed_version", "v1"]
    with pytest.raises(
        VLLMError, match="rank 1 waited sampling.vllm.timeout_s=3 s for rank 0's push of policy version 2"
    ):
        rank1.generate(batch, 1, sampling)
    rank0.sync_weights(policy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pushed_version", "v2"]
    assert largest_gap(policy, rank1.generate(batch, 2, sampling)) < SYNC_TOLERANCE
    rank0.close()
    rank1.close()


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_asynchronous_rollouts_sample_with_the_weights_of_their_job(model_folder, request, mode):
    """max_staleness 1: rollout 2 is sampled by vLLM with the weights after the first update (the job's copy, pushed
    by the producer), not the live ones: its engine log-probs equal an HF forward of those weights."""
    import lightning as L

    vllm = {"mode": mode}
    if mode == "server":
        vllm["server_url"] = request.getfixturevalue("vllm_server")
    weights: list[dict] = []
    seen: list = []

    class Weights(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            weights.append({k: v.detach().clone() for k, v in pl_module.actor_critic.policy.state_dict().items()})

    module = RLHFModule(
        policy=model_folder,
        reward_fns=[brevity],
        algorithm=AlgorithmConfig(group_size=2, kl_coef=0.0, max_staleness=1),
        sampling=SamplingConfig(max_new_tokens=8, backend="vllm", vllm={"max_model_len": 256, **vllm}),
        lr=1e-3,
        memory_check="warn",  # the plan (4.2 GiB: full fine-tuning plus the producer's copies) is not under test here
    )
    module.on_experience = seen.append  # type: ignore[method-assign]
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Weights()],
    )  # fmt: skip
    data = RolloutDataModule(prompts=["Name a colour.", "Count to three.", "Say hi."], batch_size=2, seed=0)
    trainer.fit(module, data)
    assert [exp.policy_version for exp in seen] == [0, 0, 1]
    policy, _ = load(model_folder)
    gaps = []
    for step in (1, 2):  # rollout 2 was sampled with step 1's weights; step 2's are the live ones at its update
        policy.load_state_dict(weights[step])
        exp = seen[2]
        gen = Generation(exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask, exp.truncated)
        gen.logprobs = exp.sampler_logprobs
        gaps.append(largest_gap(policy, gen))
    assert gaps[0] < SYNC_TOLERANCE < gaps[1], gaps


def test_a_lora_policy_goes_as_merged_weights_to_a_server_without_lora(model_folder, vllm_server, caplog):
    import logging

    from lit_rlhf.models.lora import apply_lora

    policy, tokenizer = load(model_folder)
    policy = apply_lora(policy, {"r": 4, "alpha": 8})
    with caplog.at_level(logging.WARNING, logger="lit_rlhf"):
        backend, sampling = vllm_backend(policy, tokenizer, "server", vllm_server)
    try:
        assert not backend.adapters
        assert "merged full weights: the server at" in caplog.text and "started without LoRA" in caplog.text
        perturb(policy, seed=3)  # the adapters and the base: only merged weights carry both
        backend.sync_weights(policy)
        assert largest_gap(policy, backend.generate(prompts(tokenizer), 3, sampling)) < SYNC_TOLERANCE
    finally:
        backend.close()
