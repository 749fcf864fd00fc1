"""`model.overlap_scoring`: the rollout is scored on a background thread while phase 3's forwards run, with the
serial path's results; errors, timeouts and Ctrl-C reach the training thread; incompatible settings are refused."""

from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest
import torch

from conftest import make_policy, make_trainer, prompt_batch
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.functions import RewardError
from lit_rlhf.rollout.collect import Sampled
from lit_rlhf.rollout.environment import EnvironmentConfig
from lit_rlhf.rollout.generation import Generation
from lit_rlhf.rollout.scoring import OverlapTimings, PendingRollout

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def length_reward(prompts, responses, **meta):
    """Varies within almost every group, so the advantages are not all zero."""
    return [float(len(r)) for r in responses]


class Recorder(RLHFModule):
    """Keeps every experience the update sees."""

    def on_experience(self, experience):
        self.experiences = [*getattr(self, "experiences", []), experience]


CASES = {
    "grpo_single_pass": AlgorithmConfig(name="grpo", group_size=2),
    "ppo_critic_reference": AlgorithmConfig(name="ppo", ppo_epochs=2, num_minibatches=2, truncated_score=-1.0),
}


def fit_once(name: str, overlap: bool, max_steps: int, tokenizer) -> Recorder:
    torch.manual_seed(0)
    module = Recorder(
        policy=make_policy(0),
        tokenizer=tokenizer,
        reward_fns=[length_reward, REWARD],
        algorithm=CASES[name],
        sampling=SamplingConfig(max_new_tokens=6),
        lr=1e-2,
        overlap_scoring=overlap,
    )
    torch.manual_seed(1)
    make_trainer(max_steps=max_steps).fit(
        module, RolloutDataModule("builtin:digits", batch_size=4, max_prompt_length=16)
    )
    return module


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_gives_the_serial_scores_experience_parameters_and_metrics(name, tokenizer):
    """Same seed, overlap off vs on: every tensor of the experience, every parameter after the update and every
    logged number (timings aside) are identical. PPO: critic values, GAE, a reference, 2 epochs x 2 minibatches
    (4 optimizer steps per rollout, so 8 steps are two rollouts)."""
    steps = 1 if name == "grpo_single_pass" else 8
    serial, overlapped = fit_once(name, False, steps, tokenizer), fit_once(name, True, steps, tokenizer)
    assert len(serial.experiences) == len(overlapped.experiences) >= 1
    for a, b in zip(serial.experiences, overlapped.experiences, strict=True):
        assert torch.isfinite(b.scores).all() and a.scores.std() > 0  # real scores, not all tied
        for field in ("scores", "advantages", "returns", "old_logprobs", "ref_logprobs", "kl", "values", "loss_mask"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None), field
            if x is not None:
                assert torch.equal(x, y), field
        assert a.responses == b.responses
    if name == "ppo_critic_reference":  # the thread applies truncated_score too
        assert serial.experiences[0].values is not None and serial.reference is not None
        assert (serial.experiences[0].scores == -1.0).any() and serial.experiences[0].truncated.any()
    for (key, x), (_, y) in zip(serial.state_dict().items(), overlapped.state_dict().items(), strict=True):
        assert torch.equal(x, y), key
    timing = ("time/", "perf/tokens_per_s")
    logged = {k: v for k, v in serial.step_metrics.items() if not k.startswith(timing)}
    assert logged == {k: v for k, v in overlapped.step_metrics.items() if not k.startswith(timing)}
    assert "time/score_wait_s" in overlapped.step_metrics and "time/score_wait_s" not in serial.step_metrics


def _module(tokenizer, reward, overlap: bool, **kwargs) -> RLHFModule:
    return RLHFModule(
        policy=make_policy(0),
        tokenizer=tokenizer,
        reward_fns=[reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        overlap_scoring=overlap,
        **kwargs,
    )


def test_the_reward_runs_on_another_thread_while_the_reference_forward_runs(tokenizer):
    """No timing guess: the reward function waits (up to 10 s) for the reference's forward to start; it sees it
    only when the two run at the same time. Serial scoring would wait in vain and fail the test."""
    reference_started = threading.Event()
    seen: dict[str, object] = {}

    def waiting_reward(prompts, responses, **meta):
        seen["reward_thread"] = threading.get_ident()
        seen["saw_reference"] = reference_started.wait(timeout=10)
        return [0.0] * len(responses)

    module = _module(tokenizer, waiting_reward, overlap=True)

    def on_reference_forward(*_):
        seen["reference_thread"] = threading.get_ident()
        reference_started.set()

    module.reference.register_forward_pre_hook(on_reference_forward)
    rollout, timings = module.make_rollout(prompt_batch(tokenizer, ["312>", "9051>"]))
    experience, _ = module.make_experience(rollout)
    assert seen["saw_reference"] is True
    assert seen["reference_thread"] == threading.get_ident() != seen["reward_thread"]
    assert experience.scores.tolist() == [0.0] * 4
    assert 0 <= timings.score_wait_s <= timings.score_s


def test_phase_2_returns_before_the_reward_does_and_the_wait_is_timed(tokenizer):
    """The reward cannot finish until make_rollout has returned (it waits for a gate the test opens after), then
    sleeps 0.3 s: that time is the thread's `score_s`, and the training thread's wait is part of it."""
    gate, seen = threading.Event(), {}

    def gated_reward(prompts, responses, **meta):
        seen["opened_after_phase_2"] = gate.wait(timeout=10)
        time.sleep(0.3)
        return [1.0] * len(responses)

    module = _module(tokenizer, gated_reward, True)
    rollout, timings = module.make_rollout(prompt_batch(tokenizer, ["312>"]))
    gate.set()
    assert isinstance(rollout, PendingRollout) and torch.isnan(rollout.unscored.scores).all()
    experience, _ = module.make_experience(rollout)
    assert seen["opened_after_phase_2"] is True and experience.scores.tolist() == [1.0, 1.0]
    assert timings.score_s >= 0.3 and 0 <= timings.score_wait_s <= timings.score_s


def _step_error(module: RLHFModule, tokenizer) -> BaseException:
    with pytest.raises(BaseException) as caught:
        module.make_experience(module.make_rollout(prompt_batch(tokenizer, ["312>", "9051>"]))[0])
    return caught.value


def failing_reward(prompts, responses, **meta):
    raise ValueError("row 0 has no answer column")


def test_a_reward_error_on_the_thread_is_raised_on_the_training_thread_as_in_serial(tokenizer):
    serial = _step_error(_module(tokenizer, failing_reward, False), tokenizer)
    overlapped = _step_error(_module(tokenizer, failing_reward, True), tokenizer)
    assert type(serial) is type(overlapped) is RewardError
    assert str(overlapped) == str(serial) and "failing_reward" in str(overlapped)
    assert "row 0 has no answer column" in str(overlapped)


def test_reward_timeout_and_workers_still_apply_inside_the_scoring_thread(tokenizer):
    release = threading.Event()

    def stuck_reward(prompts, responses, **meta):
        release.wait(timeout=30)
        return [0.0] * len(responses)

    try:
        error = _step_error(_module(tokenizer, stuck_reward, True, reward_timeout_s=0.2, reward_workers=2), tokenizer)
    finally:
        release.set()
    assert type(error) is RewardError
    assert "stuck_reward did not return within reward_timeout_s=0.2 s" in str(error)


def _generation(batch: int) -> Generation:
    ids = torch.zeros(batch, 3, dtype=torch.long)
    mask = torch.ones(batch, 3, dtype=torch.bool)
    return Generation(ids, mask.long(), ids, mask, torch.zeros(batch, dtype=torch.bool))


def test_ctrl_c_interrupts_the_join():
    """The join waits in short slices: a KeyboardInterrupt (here simulated with `interrupt_main`, which does not
    wake a blocking wait) stops it within a slice while the scoring thread is still stuck."""
    release = threading.Event()

    def stuck() -> torch.Tensor:
        release.wait(timeout=30)
        return torch.zeros(2)

    sampled = Sampled(_generation(2), ["a", "b"], ["x", "y"], {})
    pending = PendingRollout(sampled, stuck, 0, OverlapTimings())
    # a shell's background job ignores SIGINT, and then interrupt_main does nothing: Python's own handler here
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.2, _thread.interrupt_main).start()
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            pending.scored()
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 5


def test_scores_ready_before_the_join_cost_no_wait():
    scores = torch.tensor([0.5, -1.0])
    pending = PendingRollout(Sampled(_generation(2), ["a", "b"], ["x", "y"], {}), lambda: scores, 3, OverlapTimings())
    assert pending.done.wait(timeout=10)
    rollout = pending.scored()
    assert pending.timings.score_wait_s == 0.0
    assert torch.equal(rollout.scores, scores) and rollout.policy_version == 3 and rollout.responses == ["x", "y"]


def test_the_scoring_thread_runs_under_the_training_threads_autocast():
    """Lightning's bf16-mixed enters autocast on the training thread (thread-local state): a reward model scored
    on the thread must see it as the serial path does."""
    seen = {}

    def compute() -> torch.Tensor:
        seen["autocast"] = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        return torch.zeros(2)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        pending = PendingRollout(Sampled(_generation(2), ["a", "b"], ["x", "y"], {}), compute, 0, OverlapTimings())
    pending.scored()
    assert seen["autocast"] == (True, torch.bfloat16)


@pytest.mark.parametrize(
    "settings, clash",
    [
        (
            dict(algorithm=AlgorithmConfig(name="grpo", group_size=2, dynamic_sampling=True)),
            "algorithm.dynamic_sampling",
        ),
        (dict(algorithm={"name": "grpo", "group_size": 2, "dynamic_sampling": True}), "algorithm.dynamic_sampling"),
        (dict(environment=EnvironmentConfig("builtin:peek", max_turns=2, max_total_tokens=16)), "model.environment"),
    ],
)
def test_overlap_is_refused_with_settings_that_need_scores_before_sampling_goes_on(settings, clash, monkeypatch):
    import lit_rlhf.training.module as module_file

    def no_model_loads(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(module_file, "load_tokenizer", no_model_loads)
    with pytest.raises(ConfigError, match=f"^model\\.overlap_scoring: true cannot be combined with {clash}: .*false"):
        RLHFModule(policy="builtin:digits", reward_fns=[REWARD], overlap_scoring=True, **settings)


def test_overlap_scoring_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"^model\.overlap_scoring: must be true or false, got 'yes'"):
        RLHFModule(policy="builtin:digits", reward_fns=[REWARD], overlap_scoring="yes")
