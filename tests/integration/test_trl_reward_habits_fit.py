"""TRL's reward habits through a real CPU Trainer: `trainer_state` advances with the optimizer steps, each reward
function's mean and std are logged beside the weighted total, one function alone (from Python or YAML) is a list
of one, TRL's `peft_config` names `lora`, which takes a peft `LoraConfig`."""

from __future__ import annotations

import statistics

import pytest
import yaml

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.cli import CheckedCLI
from lit_rlhf.config import ConfigError

PROMPTS = ["3142>", "907>", "55>", "1234>"]
SEEN: list = []


def curriculum(completions, trainer_state=None, **kwargs):
    """A step-based curriculum, as TRL users write it: records the state it is given."""
    SEEN.append(trainer_state)
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def length(prompts, responses, **meta):
    return [float(len(r)) for r in responses]


def has_seven(prompts, responses, **meta):
    return [float("7" in r) for r in responses]


class Recorder(RLHFModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.experiences: list = []
        self.metrics: list[dict[str, float]] = []

    def on_experience(self, experience):
        self.experiences.append(experience)

    def log_step(self, values, experience):
        self.metrics.append(dict(values))
        super().log_step(values, experience)


def module(tokenizer, reward_fns, **extra):
    return Recorder(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=reward_fns,
        algorithm=extra.pop("algorithm", AlgorithmConfig(name="grpo", group_size=2)),
        sampling=SamplingConfig(max_new_tokens=4),
        log_samples_every_n_steps=0,
        **extra,
    )


def fit(model, **trainer):
    data = RolloutDataModule(prompts=PROMPTS, batch_size=2, max_prompt_length=8, shuffle=False)
    make_trainer(**trainer).fit(model, data)


def test_trainer_state_advances_with_the_optimizer_steps(tokenizer):
    SEEN.clear()
    algorithm = AlgorithmConfig(name="grpo", group_size=2, ppo_epochs=2, num_minibatches=2)
    model = module(tokenizer, curriculum, algorithm=algorithm)  # one function alone, as TRL takes it
    fit(model, max_steps=12)  # 4 optimizer steps per rollout: 3 rollouts, 2 per epoch
    assert [s.global_step for s in SEEN] == [0, 4, 8]
    assert [s.max_steps for s in SEEN] == [12] * 3
    assert [s.epoch for s in SEEN] == [0.0, 0.5, 1.0]
    scores = [x for e in model.experiences for x in e.scores.tolist()]
    assert scores == pytest.approx([0.0] * 4 + [4 / 12] * 4 + [8 / 12] * 4)


def test_max_steps_is_counted_from_the_epochs_when_unset(tokenizer):
    SEEN.clear()
    algorithm = AlgorithmConfig(name="grpo", group_size=2, ppo_epochs=3)
    fit(module(tokenizer, [curriculum], algorithm=algorithm), max_steps=-1, max_epochs=1)
    assert [(s.global_step, s.max_steps) for s in SEEN] == [(0, 6), (3, 6)]  # 2 rollouts x 3 steps


def test_each_reward_functions_mean_and_std_are_logged_beside_the_total(tokenizer):
    model = module(tokenizer, [length, has_seven], reward_weights=[0.5, 2.0])
    fit(model, max_steps=2)
    for experience, metrics in zip(model.experiences, model.metrics, strict=True):
        lengths = [float(len(r)) for r in experience.responses]
        sevens = [float("7" in r) for r in experience.responses]
        assert metrics["reward/length/mean"] == pytest.approx(statistics.mean(lengths))
        assert metrics["reward/length/std"] == pytest.approx(statistics.stdev(lengths))
        assert metrics["reward/has_seven/mean"] == pytest.approx(statistics.mean(sevens))
        assert metrics["reward/has_seven/std"] == pytest.approx(statistics.stdev(sevens))
        total = [0.5 * n + 2.0 * s for n, s in zip(lengths, sevens, strict=True)]
        assert metrics["rollout/score_mean"] == pytest.approx(statistics.mean(total))


def test_one_dotted_path_in_yaml_is_a_list_of_one(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump({"model": {"reward_fns": "lit_rlhf.tasks.digits.sort_digits_reward"}}))
    cli = CheckedCLI(RLHFModule, RolloutDataModule, run=False, args=["--config", str(path)], save_config_callback=None)
    assert [fn.__name__ for fn in cli.model.reward.reward_fns] == ["sort_digits_reward"]
    assert cli.model.hparams["reward_fns"] == ["lit_rlhf.tasks.digits.sort_digits_reward"]


def test_trls_peft_config_points_to_lora():
    peft = pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=r"model.peft_config: is TRL's name; lit_rlhf calls it model.lora"):
        RLHFModule(reward_fns=length, peft_config=peft.LoraConfig(r=4))


def test_a_peft_lora_config_is_taken_as_lora(tokenizer):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0, target_modules=["c_attn"])
    model = module(tokenizer, length, lora=config)
    adapters = model.actor_critic.policy.peft_config["default"]
    assert (adapters.r, adapters.lora_alpha, set(adapters.target_modules)) == (4, 12, {"c_attn"})
    assert model.hparams["lora"] == {"r": 4, "alpha": 12, "dropout": 0.0, "target_modules": ["c_attn"]}
    trained = {n for n, p in model.actor_critic.policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and "c_attn" in n for n in trained)
