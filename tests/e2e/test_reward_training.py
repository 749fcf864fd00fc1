"""Reward-model training: the Bradley-Terry loss, preference data, the trained model's ranking on held-out
pairs, and the hand-off to PPO (from Python and from the CLI)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import make_trainer
from lit_rlhf.config import ConfigError
from lit_rlhf.tasks.digits import builtin_reward_model, digits_preference_pairs, sort_digits_score
from lit_rlhf.training.reward_model_training import HELD_OUT_SEED_OFFSET as VAL_SEED_OFFSET
from lit_rlhf.training.reward_model_training import (
    PairCollator,
    PreferenceDataModule,
    RewardModelModule,
    bradley_terry_loss,
    read_preference_file,
)

pytestmark = pytest.mark.slow  # end-to-end: a real fit, several processes or a pretrained model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bradley_terry_loss_hand_numbers():
    chosen = torch.tensor([2.0, 0.0, -1.0])
    rejected = torch.tensor([1.0, 0.0, 1.0])
    # -log sigmoid(1) = log(1 + e^-1); -log sigmoid(0) = log 2; -log sigmoid(-2) = log(1 + e^2)
    expected = (math.log(1 + math.exp(-1)) + math.log(2) + math.log(1 + math.exp(2))) / 3
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx((0.313262 + 0.693147 + 2.126928) / 3, abs=1e-5)
    # a huge margin neither overflows nor gives NaN
    assert bradley_terry_loss(torch.tensor([1e4]), torch.tensor([-1e4])).item() == 0.0
    assert bradley_terry_loss(torch.tensor([-1e4]), torch.tensor([1e4])).item() == pytest.approx(2e4)


def test_pair_collator_right_pads_appends_eos_and_puts_chosen_first(tokenizer):
    rows = [{"prompt": "31>", "chosen": "13", "rejected": ""}, {"prompt": "2>", "chosen": "2", "rejected": "22"}]
    batch = PairCollator(tokenizer, max_length=16)(rows)
    ids, mask, last = batch["input_ids"], batch["attention_mask"], batch["last_index"]
    texts = ["31>13", "2>2", "31>", "2>22"]
    assert ids.shape == (4, 6)
    for row, text in enumerate(texts):
        n = len(text) + 1
        assert tokenizer.decode(ids[row, : n - 1]) == text
        assert ids[row, n - 1] == tokenizer.eos_token_id
        assert mask[row].tolist() == [1] * n + [0] * (6 - n)
        assert (ids[row, n:] == tokenizer.pad_token_id).all()
        assert last[row] == n - 1
    # too long: the start is cut, the end (read by the score) is kept, with one warning
    with pytest.warns(UserWarning, match="max_length"):
        cut = PairCollator(tokenizer, max_length=3)([{"prompt": "1234>", "chosen": "1234", "rejected": "1"}])
    assert tokenizer.decode(cut["input_ids"][0, :2]) == "34" and cut["input_ids"][0, 2] == tokenizer.eos_token_id


def test_builtin_pairs_are_labelled_by_the_rule_and_reproducible():
    rows = digits_preference_pairs(300, seed=0)
    assert rows == digits_preference_pairs(300, seed=0)
    assert all(
        sort_digits_score(r["prompt"], r["chosen"]) > sort_digits_score(r["prompt"], r["rejected"]) for r in rows
    )
    held_out = digits_preference_pairs(300, seed=VAL_SEED_OFFSET)
    assert len({json.dumps(r) for r in rows} & {json.dumps(r) for r in held_out}) < 10
    assert len({r["chosen"] for r in rows}) > 100  # varied answers, not one template


def test_make_preferences_writes_files_the_datamodule_reads(tmp_path):
    from make_preferences import main

    main(["--out", str(tmp_path), "--train", "40", "--val", "8", "--seed", "1"])
    train = read_preference_file(str(tmp_path / "train.jsonl"))
    assert train == digits_preference_pairs(40, 1)
    data = PreferenceDataModule(train=str(tmp_path / "train.jsonl"), val=str(tmp_path / "val.jsonl"), batch_size=4)
    assert len(data.train_rows) == 40 and len(data.val_rows) == 8


def test_preference_file_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "1>", "chosen": "1", "rejected": ""}\n\n{"prompt": "2>", "chosen": "2"}\n')
    with pytest.raises(ConfigError, match=r"data\.train: .*pairs\.jsonl:3 has no field 'rejected'"):
        PreferenceDataModule(train=str(path), val=None)
    path.write_text('{"prompt": "1>", "chosen": "1", "rejected": ""}\n{"prompt": "2>", "chosen": 2, "rejected": ""}\n')
    with pytest.raises(ConfigError, match=r"pairs\.jsonl:2 field 'chosen' must be a string"):
        read_preference_file(str(path))
    path.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"pairs\.jsonl:1 is not valid JSON"):
        read_preference_file(str(path))
    with pytest.raises(ConfigError, match=r"data\.val: the preference file .*nope\.jsonl' does not exist"):
        PreferenceDataModule(val=str(tmp_path / "nope.jsonl"))
    path.write_text("\n")
    with pytest.raises(ConfigError, match="holds no pairs"):
        read_preference_file(str(path))


def test_reward_model_needs_one_output_and_an_existing_folder(tmp_path):
    from transformers import GPT2ForSequenceClassification

    config = builtin_reward_model().config
    config.num_labels = 2
    two = GPT2ForSequenceClassification(config)
    with pytest.raises(ConfigError, match="num_labels=1"):
        RewardModelModule(two, tokenizer="builtin:digits")
    with pytest.raises(ConfigError, match="model.tokenizer: the model was given as an instance"):
        RewardModelModule(builtin_reward_model())
    module = RewardModelModule(str(tmp_path / "missing"), tokenizer="builtin:digits")
    with pytest.raises(ConfigError, match="model.model: the folder .*missing' does not exist"):
        module.configure_model()


# ----------------------------------------------------------------------------- train, rank, hand off to PPO

RM_STEPS, RM_BATCH = 600, 32


@pytest.fixture(scope="module")
def trained_reward_model(tmp_path_factory):
    """A 1-layer, width-32 reward model trained for 600 steps of 32 new pairs (about 15 s), saved to a folder.
    (300 steps reached 0.83 held-out with earlier package versions; with torch 2.13 and transformers 5.24 they
    reach 0.76, and 600 steps give the numbers below.)"""
    import lightning as L

    L.seed_everything(0)
    folder = str(tmp_path_factory.mktemp("rm") / "digits_rm")
    module = RewardModelModule(
        builtin_reward_model(n_layer=1, n_embd=32, n_head=2), tokenizer="builtin:digits", lr=3e-3, save_dir=folder
    )
    data = PreferenceDataModule(
        val="builtin:digits",
        batch_size=RM_BATCH,
        num_builtin_train=RM_STEPS * RM_BATCH,
        num_builtin_val=64,
        max_length=32,
    )
    trainer = make_trainer(max_steps=RM_STEPS, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, data)
    return folder, {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_trained_reward_model_ranks_held_out_pairs_well_above_chance(trained_reward_model, tokenizer):
    """Read back with plain transformers (its own last-non-pad-token pooling): the folder is an ordinary
    Hugging Face reward model. Measured: 0.86 on these 400 held-out pairs (chance 0.5; 0.83 on the 64
    validation pairs)."""
    from transformers import AutoModelForSequenceClassification

    folder, metrics = trained_reward_model
    assert metrics["val/accuracy"] > 0.75 and metrics["val/margin"] > 0 and metrics["train/loss"] < 0.5
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    held_out = digits_preference_pairs(400, seed=VAL_SEED_OFFSET + 7)
    batch = PairCollator(tokenizer, max_length=32)(held_out)
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    chosen, rejected = scores.chunk(2)
    accuracy = float((chosen > rejected).float().mean())
    print(f"held-out accuracy {accuracy:.3f}, fit metrics {metrics}")
    assert accuracy > 0.8, accuracy


def test_ppo_with_the_trained_reward_model_raises_the_rules_score(trained_reward_model):
    """PPO whose only reward is the trained model; the rule it was trained from is measured on the side.

    Measured here: the rule's mean score over the first 20 rollouts 0.025, over the last 20 0.075, the reward
    model's score -1.8 -> 1.1. With a similar reward model and seeds 1-3: 0.03-0.04 -> 0.07-0.12 (PPO on the
    rule itself reaches about 0.07 in the same 100 rollouts). Without `truncated_score` the policy exploits
    the model instead: responses cut at max_new_tokens (no EOS, never seen in training) full of 9s score ~5.
    """
    import lightning as L

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    folder, _ = trained_reward_model
    L.seed_everything(0)
    rule, model_scores = [], []

    class Recorder(RLHFModule):
        def on_experience(self, exp):
            rule.append(sum(sort_digits_score(p, r) for p, r in zip(exp.prompts, exp.responses)) / exp.batch_size)
            model_scores.append(float(exp.scores.mean()))

    module = Recorder(
        policy="builtin:digits",
        reward_model=folder,
        algorithm=AlgorithmConfig(name="ppo", truncated_score=-5.0),
        sampling=SamplingConfig(max_new_tokens=8),
        lr=1e-3,
        log_samples_every_n_steps=0,
    )
    assert module.reward.reward_fns == []
    data = RolloutDataModule(batch_size=16, max_prompt_length=16)
    make_trainer(max_steps=100).fit(module, data)
    assert len(rule) == 100
    first, last = sum(rule[:20]) / 20, sum(rule[-20:]) / 20
    print(
        f"rule score first 20 rollouts {first:.3f}, last 20 {last:.3f}; reward model score "
        f"{sum(model_scores[:20]) / 20:.2f} -> {sum(model_scores[-20:]) / 20:.2f}"
    )
    assert last > 1.5 * first and last - first > 0.02, (first, last)
    assert sum(model_scores[-20:]) / 20 > sum(model_scores[:20]) / 20 + 1.0


def test_cli_trains_a_reward_model_and_ppo_config_uses_its_folder(tmp_path, monkeypatch):
    """configs/reward_model.yaml then configs/ppo_reward_model.yaml, as a user runs them (tiny step counts)."""
    from lightning.pytorch.cli import LightningCLI

    from lit_rlhf import RLHFModule, RolloutDataModule
    from lit_rlhf.cli import reward_main as main

    monkeypatch.chdir(tmp_path)
    quiet = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    cli = main(
        [
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "reward_model.yaml"),
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=2",
            "--data.num_builtin_train=128",
            "--data.num_builtin_val=16",
            *quiet,
        ]
    )
    folder = tmp_path / "models" / "digits_reward_model"  # the config's save_dir, relative to the run folder
    assert (folder / "config.json").is_file() and cli.trainer.global_step == 4
    cli = LightningCLI(
        RLHFModule,
        RolloutDataModule,
        save_config_kwargs={"overwrite": True},
        args=[
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "ppo_reward_model.yaml"),
            "--trainer.max_steps=2",
            "--data.batch_size=4",
            *quiet,
        ],
    )
    assert cli.model.reward_model is not None and cli.trainer.global_step == 2
    assert cli.model.hparams.reward_model == "./models/digits_reward_model"


def _letters_tokenizer(alphabet: str):
    """A character tokenizer over other symbols than the built-in one: a different vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.train_from_iterator([alphabet], trainer=trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize(
    "alphabet, words",
    [
        ("abcdefghijklmnopqrstuvwxyz>", "the reward model knows 14 token ids but the policy's tokenizer has 30"),
        ("abcdefghij>", "holds a tokenizer whose vocabulary differs from the policy's"),  # same size, other ids
    ],
)
def test_reward_model_with_another_tokenizer_is_an_error_unless_its_tokenizer_is_given(
    trained_reward_model, alphabet, words
):
    from transformers import GPT2Config, GPT2LMHeadModel

    from lit_rlhf import AlgorithmConfig, RLHFModule, SamplingConfig
    from lit_rlhf.types import PromptBatch

    folder, _ = trained_reward_model
    letters = _letters_tokenizer(alphabet)
    policy = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(letters),
            n_positions=32,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=letters.eos_token_id,
            eos_token_id=letters.eos_token_id,
            pad_token_id=letters.pad_token_id,
        )
    )
    settings = dict(
        policy=policy,
        tokenizer=letters,
        reward_model=folder,
        log_samples_every_n_steps=0,
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=3),
    )
    with pytest.raises(ConfigError, match=f"model.reward_tokenizer: .*{words}.*Set model.reward_tokenizer"):
        RLHFModule(**settings)
    module = RLHFModule(**settings, reward_tokenizer=folder)  # texts are re-tokenised for the reward model
    letters.padding_side = "left"
    enc = letters(["abc>", "z>"], padding=True, return_tensors="pt")
    exp = module.make_experience(
        module.make_rollout(PromptBatch(enc["input_ids"], enc["attention_mask"], ["abc>", "z>"], {}))[0]
    )[0]
    assert exp.scores.shape == (4,) and torch.isfinite(exp.scores).all()
