"""Bad input fails early with a ConfigError that names the field; the prompt data path (files, left padding,
truncation, sharding, resume) against hand-made expectations."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import PAD_ID, make_trainer
from lit_rlhf import AlgorithmConfig, ConfigError, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.data.sources import PromptStream, read_prompt_file
from lit_rlhf.models.loading import load_causal_lm, load_tokenizer

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def ids_of(tok, text: str) -> list[int]:
    vocab = tok.get_vocab()
    return [vocab[c] for c in text]


# ----------------------------------------------------------------------------- algorithm / sampling settings


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(name="dpo"), "algorithm.name"),
        (dict(name="ppo", kl_estimator="k4"), "algorithm.kl_estimator"),
        (dict(name="grpo", kl_estimator="exact"), "algorithm.kl_estimator"),
        (dict(name="grpo", group_size=1), "algorithm.group_size"),
        (dict(name="ppo", advantage_estimator="rloo"), "algorithm.group_size"),  # PPO's G=1 with a group estimator
        (dict(name="ppo", advantage_estimator="vtrace"), "algorithm.advantage_estimator"),
        (dict(name="grpo", loss_aggregation="sum"), "algorithm.loss_aggregation"),
        (dict(name="grpo", ppo_epochs=0), "algorithm.ppo_epochs"),
        (dict(name="grpo", micro_batch_size=0), "algorithm.micro_batch_size"),
    ],
)
def test_algorithm_config_rejects_bad_settings(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AlgorithmConfig(**kwargs)


def test_algorithm_defaults_per_name():
    ppo, grpo = AlgorithmConfig(name="ppo"), AlgorithmConfig(name="grpo")
    assert (ppo.group_size, ppo.advantage_estimator, ppo.kl_in_reward, ppo.uses_critic) == (1, "gae", True, True)
    assert (grpo.group_size, grpo.advantage_estimator, grpo.kl_estimator, grpo.kl_in_reward, grpo.uses_critic) == (
        8,
        "grpo",
        "k3",
        False,
        False,
    )
    assert AlgorithmConfig(name="grpo", kl_coef=0.0).uses_reference is False


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_new_tokens=0), "sampling.max_new_tokens"),
        (dict(temperature=0.0), "sampling.temperature"),
        (dict(top_p=0.0), "sampling.top_p"),
        (dict(backend="sglang"), "sampling.backend"),
    ],
)
def test_sampling_config_rejects_bad_settings(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingConfig(**kwargs)


def test_check_batch_names_the_field_that_does_not_divide():
    algo = AlgorithmConfig(name="grpo", group_size=4, num_minibatches=3)
    with pytest.raises(ConfigError, match="algorithm.num_minibatches") as info:
        algo.check_batch(8)
    assert "8" in str(info.value)
    algo.check_batch(12)  # 3 minibatches of 4: fine

    algo = AlgorithmConfig(name="grpo", group_size=4, num_minibatches=2, micro_batch_size=3)
    with pytest.raises(ConfigError, match="algorithm.micro_batch_size"):
        algo.check_batch(8)  # minibatch of 4 rows, micro-batches of 3
    algo.check_batch(12)  # minibatch of 6 rows: two micro-batches of 3


def test_indivisible_rollout_fails_in_fit_before_any_model_is_loaded():
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2, num_minibatches=3),
    )
    assert module.actor_critic is None
    dm = RolloutDataModule(prompts="builtin:digits", batch_size=2)  # 2 prompts x G=2 = 4 rows, 3 minibatches
    with pytest.raises(ConfigError, match="algorithm.num_minibatches"):
        make_trainer(max_steps=1).fit(module, dm)
    assert module.actor_critic is None and module.reference is None


def test_fp16_precision_is_refused():
    module = RLHFModule(
        policy="builtin:digits", reward_fns=[REWARD], algorithm=AlgorithmConfig(name="grpo", group_size=2)
    )
    module.trainer = type("FakeTrainer", (), {"precision": "16-mixed"})()  # setup() only reads the precision
    with pytest.raises(ConfigError, match="trainer.precision"):
        module.setup("fit")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(lr=0.0), "model.lr"),
        (dict(lr_schedule="step"), "model.lr_schedule"),
        (dict(warmup_steps=-1), "model.warmup_steps"),
        (dict(reward_fns=None), "model.reward_fns"),
        (dict(reward_weights=[1.0, 2.0]), "reward_weights"),
    ],
)
def test_module_rejects_bad_arguments(kwargs, field):
    kwargs = {"policy": "builtin:digits", "reward_fns": [REWARD], **kwargs}
    with pytest.raises(ConfigError, match=field):
        RLHFModule(**kwargs)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_without_pad_gets_eos_with_a_warning(tokenizer):
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    assert tokenizer.pad_token_id is None
    with pytest.warns(UserWarning, match="model.tokenizer.*no pad token"):
        module = RLHFModule(policy="builtin:digits", tokenizer=tokenizer, reward_fns=[REWARD])
    assert module.tokenizer.pad_token_id == module.tokenizer.eos_token_id == 1
    assert module.tokenizer.padding_side == "left"


def test_tokenizer_without_eos_is_an_error(tokenizer):
    tokenizer.eos_token = None
    assert tokenizer.eos_token_id is None
    with pytest.raises(ConfigError, match="model.tokenizer.*EOS"):
        RLHFModule(policy="builtin:digits", tokenizer=tokenizer, reward_fns=[REWARD])
    with pytest.raises(ConfigError, match="data.tokenizer"):
        load_tokenizer(tokenizer, field="data.tokenizer")


# ----------------------------------------------------------------------------- reward function paths


@pytest.mark.parametrize(
    "path, words",
    [
        ("no_such_package_xyz.rewards.score", ["reward_fns", "no_such_package_xyz.rewards"]),
        ("lit_rlhf.tasks.digits.no_such_reward", ["reward_fns", "no_such_reward"]),
        ("lit_rlhf.tasks.digits.DIGITS", ["reward_fns", "DIGITS"]),  # exists, not callable
        ("sort_digits_reward", ["reward_fns", "dotted path"]),
    ],
)
def test_reward_fn_path_that_does_not_import(path, words):
    with pytest.raises(ConfigError) as info:
        RLHFModule(policy="builtin:digits", reward_fns=[path])
    for word in words:
        assert word in str(info.value)


def test_reward_fn_path_with_colon_imports():
    module = RLHFModule(policy="builtin:digits", reward_fns=["lit_rlhf.tasks.digits:sort_digits_reward"])
    from lit_rlhf.tasks.digits import sort_digits_reward

    assert module.reward.reward_fns == [sort_digits_reward]


# ----------------------------------------------------------------------------- models that do not exist


def test_model_folder_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ConfigError, match="model.policy.*no_such_model.*does not exist"):
        load_causal_lm(missing, "model.policy")
    with pytest.raises(ConfigError, match="no_such_model.*does not exist"):
        RLHFModule(policy=missing, reward_fns=[REWARD])  # the tokenizer (from the policy's folder) fails first
    module = RLHFModule(
        policy="builtin:digits",
        reference=missing,
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
    )
    with pytest.raises(ConfigError, match="model.reference.*does not exist"):
        module.configure_model()
    with pytest.raises(ValueError, match="builtin:digits"):
        load_causal_lm("builtin:chess")


# ----------------------------------------------------------------------------- prompts: lengths and truncation


def test_prompt_longer_than_limit_is_an_error_at_setup(tokenizer):
    dm = RolloutDataModule(prompts=["12>", "1234567>"], max_prompt_length=4, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="data.max_prompt_length.*8 tokens.*4"):
        dm.setup("fit")


def test_builtin_prompt_longer_than_limit_is_an_error_when_batched(tokenizer):
    dm = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=3, tokenizer=tokenizer)
    dm.setup("fit")  # an endless stream cannot be checked up front
    with pytest.raises(ConfigError, match="data.max_prompt_length"):
        next(iter(dm.train_dataloader()))


def test_prompt_truncation_left_cuts_the_start_with_a_warning(tokenizer):
    dm = RolloutDataModule(
        prompts=["1234567>", "12>"],
        batch_size=2,
        max_prompt_length=4,
        prompt_truncation="left",
        tokenizer=tokenizer,
        shuffle=False,
    )
    dm.setup("fit")
    with pytest.warns(UserWarning, match="left"):
        batch = next(iter(dm.train_dataloader()))
    assert batch.input_ids.tolist() == [ids_of(tokenizer, "567>"), [PAD_ID, *ids_of(tokenizer, "12>")]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert batch.texts == ["1234567>", "12>"]


def test_prompts_are_left_padded_with_meta_columns(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "31>", "target": "13"},
                {"prompt": "9>", "target": "9"},
                {"prompt": "6420>", "target": "0246"},
            ]
        )
        + "\n"
    )
    dm = RolloutDataModule(prompts=str(path), batch_size=3, tokenizer=tokenizer, shuffle=False)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.input_ids.tolist() == [
        [PAD_ID, PAD_ID, *ids_of(tokenizer, "31>")],
        [PAD_ID] * 3 + ids_of(tokenizer, "9>"),
        ids_of(tokenizer, "6420>"),
    ]
    assert batch.attention_mask.sum(1).tolist() == [3, 2, 5]
    assert batch.meta == {"target": ["13", "9", "0246"]}


# ----------------------------------------------------------------------------- prompt files


def test_jsonl_line_without_the_prompt_field_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "12>"}\n\n{"question": "34>"}\n')
    with pytest.raises(ConfigError, match=f"data.prompts.*{path.name}:3.*'prompt'"):
        RolloutDataModule(prompts=str(path))
    # read with the other column name, it is line 1 that lacks the field
    with pytest.raises(ConfigError, match=f"{path.name}:1.*'question'"):
        read_prompt_file(str(path), prompt_column="question")


def test_jsonl_invalid_json_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "12>"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=f"{path.name}:2.*not valid JSON"):
        RolloutDataModule(prompts=str(path))


def test_prompt_file_missing_or_empty(tmp_path):
    with pytest.raises(ConfigError, match="data.prompts.*does not exist"):
        RolloutDataModule(prompts=str(tmp_path / "nothing.jsonl"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="data.prompts.*no prompts"):
        RolloutDataModule(prompts=str(empty))
    text = tmp_path / "prompts.txt"
    text.write_text("12>\n\n34>\n")
    assert RolloutDataModule(prompts=str(text)).source == [{"prompt": "12>"}, {"prompt": "34>"}]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompts=[]), "data.prompts"),
        (dict(prompts=[{"text": "12>"}]), "data.prompts"),
        (dict(prompts="builtin:chess"), "data.prompts"),
        (dict(batch_size=0), "data.batch_size"),
        (dict(max_prompt_length=0), "data.max_prompt_length"),
        (dict(prompt_truncation="right"), "data.prompt_truncation"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs, field):
    kwargs = {"prompts": ["12>"], **kwargs}
    with pytest.raises(ConfigError, match=field):
        RolloutDataModule(**kwargs)


def test_datamodule_without_any_tokenizer():
    dm = RolloutDataModule(prompts=["12>"], batch_size=1, val_prompts=["3>"])
    dm.setup("fit")  # no module handed a tokenizer over (RLHFModule does in its setup, through connect)
    for hook in (dm.train_dataloader, dm.val_dataloader, lambda: dm.refill_batch(0)):
        with pytest.raises(RuntimeError, match="data.tokenizer is None and no module handed its tokenizer over"):
            hook()


# ----------------------------------------------------------------------------- sharding and resume


def take(stream, n):
    out = []
    for row in stream:
        out.append(row["prompt"])
        if len(out) == n:
            break
    return out


def test_prompt_stream_shards_ranks_disjointly_and_reshuffles_each_pass():
    rows = [{"prompt": f"{i}>"} for i in range(7)]  # 7 rows, 2 ranks: 6 usable per pass
    r0 = take(PromptStream(rows, seed=3, shuffle=True, rank=0, world_size=2), 6)
    r1 = take(PromptStream(rows, seed=3, shuffle=True, rank=1, world_size=2), 6)
    first_pass = set(r0[:3]) | set(r1[:3])
    assert len(first_pass) == 6 and not set(r0[:3]) & set(r1[:3])
    # the unshuffled order is the plain round robin
    assert take(PromptStream(rows, 0, False, rank=1, world_size=2), 4) == ["1>", "3>", "5>", "1>"]
    # every pass is a new permutation of the same rows
    single = take(PromptStream(rows, seed=3, shuffle=True), 14)
    assert sorted(single[:7]) == sorted(single[7:]) == sorted(r["prompt"] for r in rows)
    assert single[:7] != single[7:]


def test_prompt_stream_resumes_where_it_stopped():
    rows = [{"prompt": f"{i}>"} for i in range(5)]
    full = take(PromptStream(rows, seed=1, shuffle=True), 12)
    first = PromptStream(rows, seed=1, shuffle=True)
    assert take(first, 7) == full[:7]
    resumed = PromptStream(rows, seed=1, shuffle=True)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 5) == full[7:12]


def test_datamodule_state_dict_before_setup_is_applied_at_setup(tokenizer):
    dm = RolloutDataModule(prompts=["1>", "2>", "3>"], batch_size=1, tokenizer=tokenizer, shuffle=False)
    dm.load_state_dict({"prompt_stream": {"rows_consumed": 2}})
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.texts == ["3>"] and batch.position == 3
    # a batch that was read but never reached training_step (Lightning prefetches one) does not count
    assert dm.state_dict() == {"prompt_stream": {"rows_consumed": 2}}
    assert torch.equal(batch.input_ids, torch.tensor([ids_of(tokenizer, "3>")]))
