"""Bad inputs and the error each gets: checkpoints, model and tokenizer folders, reward functions and models, prompt
files, settings, the YAML command line. One case per row of the README's bad-input table (the table also cites
the cases tested elsewhere, e.g. tests/test_data_config.py); `test_readme_table_cites_only_existing_tests` keeps
the two in step."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, ConfigError, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.rewards.functions import RewardError, call_reward_fn
from lit_rlhf.tasks.digits import builtin_tokenizer
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO, CheckpointError, load_checkpoint_file

ROOT = Path(__file__).resolve().parents[2]
REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
CASES: dict[str, tuple] = {}


def case(case_id: str, error: type[BaseException], match: str):
    """Register `fn(env)` as the bad input `case_id`, which must raise `error` with a message matching `match`."""

    def register(fn):
        assert case_id not in CASES
        CASES[case_id] = (fn, error, match)
        return fn

    return register


class Env:
    def __init__(self, tmp_path: Path, ppo_checkpoint: Path):
        self.tmp = tmp_path
        self.ppo_checkpoint = ppo_checkpoint

    def module(self, name="grpo", **kwargs):
        settings = dict(
            policy=make_policy(),
            tokenizer=builtin_tokenizer(),
            reward_fns=[REWARD],
            algorithm=AlgorithmConfig(name=name, group_size=2),
            sampling=SamplingConfig(max_new_tokens=3),
        )
        return RLHFModule(**{**settings, **kwargs})

    def resume(self, module, ckpt_path, plugins=()):
        trainer = make_trainer(max_steps=2, plugins=list(plugins))
        trainer.fit(module, RolloutDataModule(prompts=["12>", "34>"], batch_size=2), ckpt_path=str(ckpt_path))


@pytest.fixture(scope="module")
def ppo_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of a one-step PPO run (tiny policy with a value head)."""
    folder = tmp_path_factory.mktemp("ppo_ckpt")
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=builtin_tokenizer(),
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="ppo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=3),
    )
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=0, save_last=True)],
    )
    trainer.fit(module, RolloutDataModule(prompts=["12>", "34>"], batch_size=2))
    return folder / "last.ckpt"


@pytest.fixture
def env(tmp_path, ppo_checkpoint) -> Env:
    return Env(tmp_path, ppo_checkpoint)


# ----------------------------------------------------------------------------- checkpoints


@case("checkpoint-missing", FileNotFoundError, "Checkpoint file not found")
def _(env):
    env.resume(env.module(), env.tmp / "no_such.ckpt", [AtomicCheckpointIO()])


@case("checkpoint-truncated", CheckpointError, r"truncated or not a torch checkpoint.*killed while writing")
def _(env):
    data = env.ppo_checkpoint.read_bytes()
    cut = env.tmp / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])
    env.resume(env.module("ppo"), cut, [AtomicCheckpointIO()])


@case("checkpoint-not-a-checkpoint", CheckpointError, "not a torch checkpoint")
def _(env):
    text = env.tmp / "notes.ckpt"
    text.write_text("these are not weights\n")
    load_checkpoint_file(str(text))


class RunsCodeWhenUnpickled:
    """Unpickling this creates a file: the stand-in for a malicious checkpoint's payload."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious_checkpoint(env) -> tuple[Path, Path]:
    marker, path = env.tmp / "payload_ran", env.tmp / "evil.ckpt"
    checkpoint = torch.load(env.ppo_checkpoint, weights_only=True)
    checkpoint["extra"] = RunsCodeWhenUnpickled(str(marker))
    torch.save(checkpoint, path)
    return path, marker


@case("checkpoint-with-code-trainer", CheckpointError, "weights-only load refuses")
def _(env):
    path, marker = malicious_checkpoint(env)
    try:
        env.resume(env.module("ppo"), path, [AtomicCheckpointIO()])
    finally:
        assert not marker.exists(), "the checkpoint's code ran"


@case("checkpoint-with-code-load-from-checkpoint", pickle.UnpicklingError, "Weights only load failed")
def _(env):
    path, marker = malicious_checkpoint(env)
    try:
        RLHFModule.load_from_checkpoint(path, policy=make_policy(), tokenizer=builtin_tokenizer())
    finally:
        assert not marker.exists(), "the checkpoint's code ran"


@case("checkpoint-other-algorithm", CheckpointError, r"weights do not fit this module.*\n  algorithm: ppo .* grpo")
def _(env):
    env.resume(env.module("grpo"), env.ppo_checkpoint)  # a PPO checkpoint (value head) into a GRPO module


@case(
    "checkpoint-other-model-size",
    CheckpointError,
    r"weights do not fit this module.*\n  model shape: \d+ weights differ",
)
def _(env):
    env.resume(env.module("ppo", policy=make_policy(n_embd=16)), env.ppo_checkpoint)


# ----------------------------------------------------------------------------- models and tokenizers


@case("policy-folder-without-model", ConfigError, r"model.policy: the folder .* holds none of config.json")
def _(env):
    from lit_rlhf.models.loading import load_causal_lm

    (env.tmp / "empty").mkdir()
    load_causal_lm(str(env.tmp / "empty"), "model.policy")


@case("policy-folder-without-tokenizer", ConfigError, r"model.tokenizer: the folder .* holds none of tokenizer.json")
def _(env):
    (env.tmp / "empty").mkdir()
    RLHFModule(policy=str(env.tmp / "empty"), reward_fns=[REWARD])  # the tokenizer is read from the policy folder


@case("policy-not-a-causal-lm", ConfigError, "model.policy: GPT2ForSequenceClassification has no language-model head")
def _(env):
    from lit_rlhf.tasks.digits import builtin_reward_model

    env.module(policy=builtin_reward_model(n_layer=1, n_embd=32, n_head=2))


@case("policy-folder-with-remote-code", ValueError, "trust_remote_code=True")
def _(env):
    from lit_rlhf.models.loading import load_causal_lm

    folder = env.tmp / "remote"
    make_policy().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="my_custom_model",
        auto_map={"AutoConfig": "my_code.MyConfig", "AutoModelForCausalLM": "my_code.MyModel"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    marker = env.tmp / "remote_code_ran"
    (folder / "my_code.py").write_text(f"open({str(marker)!r}, 'w')\n")
    try:
        load_causal_lm(str(folder), "model.policy")  # trust_remote_code is off unless the user turns it on
    finally:
        assert not marker.exists(), "the folder's code ran"


@case(
    "tokenizer-larger-than-model-vocabulary", ConfigError, r"model.tokenizer: 14 tokens, but model.policy embeds only 8"
)
def _(env):
    from transformers import GPT2Config, GPT2LMHeadModel

    small = GPT2LMHeadModel(
        GPT2Config(vocab_size=8, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=1)
    )
    env.module(policy=small)


@case(
    "reward-model-with-two-outputs",
    ConfigError,
    r"reward_model: expected a model with one output \(num_labels=1\), got 2",
)
def _(env):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    rm = GPT2ForSequenceClassification(
        GPT2Config(vocab_size=14, n_positions=32, n_embd=16, n_layer=1, n_head=2, num_labels=2, pad_token_id=0)
    )
    env.module(reward_model=rm)


@case("reward-model-folder-missing", ConfigError, r"model.reward_model: the folder .* does not exist")
def _(env):
    env.module(reward_model=str(env.tmp / "no_such_rm"))


# ----------------------------------------------------------------------------- reward functions


@case("reward-fn-returns-none", RewardError, "reward function .*none_reward must return numbers, got NoneType")
def _(env):
    def none_reward(prompts, responses, **meta):
        return None

    call_reward_fn(none_reward, ["1>", "2>"], ["1", "2"], {})


@case(
    "reward-fn-returns-a-matrix",
    RewardError,
    r"matrix_reward returned shape \(2, 2\); expected one score per response \(2,\)",
)
def _(env):
    def matrix_reward(prompts, responses, **meta):
        return torch.zeros(2, 2)

    call_reward_fn(matrix_reward, ["1>", "2>"], ["1", "2"], {})


# ----------------------------------------------------------------------------- settings and data


@case("max-consecutive-skips-zero", ConfigError, "model.max_consecutive_skips: must be >= 1")
def _(env):
    RLHFModule(policy="builtin:digits", reward_fns=[REWARD], max_consecutive_skips=0)


@case("kl-coef-negative", ConfigError, "algorithm.kl_coef: must be >= 0")
def _(env):
    AlgorithmConfig(name="ppo", kl_coef=-0.1)


@case("clip-eps-not-positive", ConfigError, "algorithm.clip_eps_low: must be > 0")
def _(env):
    AlgorithmConfig(name="ppo", clip_eps_low=0.0)


@case("gamma-above-one", ConfigError, r"algorithm.gamma: must be in \[0, 1\]")
def _(env):
    AlgorithmConfig(name="ppo", gamma=1.5)


@case("dual-clip-not-above-one", ConfigError, "algorithm.dual_clip: must be > 1")
def _(env):
    AlgorithmConfig(name="ppo", dual_clip=0.5)


@case("top-k-negative", ConfigError, "sampling.top_k: must be >= 0")
def _(env):
    SamplingConfig(top_k=-1)


@case(
    "jsonl-prompt-not-a-string",
    ConfigError,
    r"data.prompts: .*prompts.jsonl:2: field 'prompt' must be a string, got int",
)
def _(env):
    path = env.tmp / "prompts.jsonl"
    path.write_text('{"prompt": "12>"}\n{"prompt": 5}\n')
    RolloutDataModule(prompts=str(path))


@case("fewer-prompts-than-processes", ConfigError, "data.prompts: 1 prompts for 2 processes")
def _(env):
    from lit_rlhf.data.sources import PromptStream

    next(iter(PromptStream([{"prompt": "1>"}], seed=0, shuffle=True, rank=1, world_size=2)))


@case("fsdp-on-cpu", ValueError, "The strategy `fsdp` requires a GPU accelerator")
def _(env):
    L.Trainer(accelerator="cpu", devices=2, strategy="fsdp")


# ----------------------------------------------------------------------------- the YAML command line


def run_cli(env, capsys, *args):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lit_rlhf_train_script_bad_inputs", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    with pytest.raises(SystemExit) as info:
        train.main(["fit", *args, "--trainer.logger", "false"])
    assert info.value.code != 0
    raise ValueError(capsys.readouterr().err)  # the message the user sees, for the case's pattern


DEBUG = str(ROOT / "configs" / "debug.yaml")


@case("yaml-unknown-setting", ValueError, "Option 'nmae' is not accepted")
def _(env, capsys):
    run_cli(env, capsys, "--config", DEBUG, "--model.algorithm.nmae", "ppo")


@case("yaml-wrong-type", ValueError, r"Parser key \"model.lr\":\s+Expected a <class 'float'>. Got value: fast")
def _(env, capsys):
    run_cli(env, capsys, "--config", DEBUG, "--model.lr", "fast")


@case(
    "yaml-invalid-value",
    ValueError,
    r"Parser key \"name\":\s+Expected a typing.Literal\['ppo', 'grpo'\]. Got value: dpo",
)
def _(env, capsys):
    run_cli(env, capsys, "--config", DEBUG, "--model.algorithm.name", "dpo")


@case("python-invalid-choice", ConfigError, r"algorithm.name: unknown value 'dpo'; use one of 'ppo', 'grpo'")
def _(env, capsys):
    AlgorithmConfig(name="dpo")


@case("yaml-config-file-missing", ValueError, r"Parser key \"config\":\s+File does not exist")
def _(env, capsys):
    run_cli(env, capsys, "--config", str(env.tmp / "nope.yaml"))


@pytest.mark.filterwarnings("ignore:.*LightningCLI's args parameter.*")
@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*")
@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input_gets_a_clear_error(case_id, env, capsys):
    fn, error, match = CASES[case_id]
    with pytest.raises(error, match=match):
        if "capsys" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
            fn(env, capsys)
        else:
            fn(env)


def test_readme_table_cites_only_existing_tests():
    """Every row of the bad-input table (docs/bad-inputs.md) names a test that exists; every case here is in it."""
    section = (ROOT / "docs" / "bad-inputs.md").read_text(encoding="utf-8")
    rows = [
        line
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| Bad input") and not set(line) <= set("|- ")
    ]
    cited = [re.findall(r"`([\w/.]+\.py)::([\w\-\[\]./]+)`", row) for row in rows]
    assert all(cited), [row for row, refs in zip(rows, cited) if not refs]
    for refs in cited:
        for file, name in refs:
            if file == "test_bad_inputs.py":
                assert name in CASES, name
            else:
                (path,) = (ROOT / "tests").rglob(file)
                assert re.search(rf"def {re.escape(name.split('[')[0])}\(", path.read_text()), name
    in_table = {name for refs in cited for file, name in refs if file == "test_bad_inputs.py"}
    assert set(CASES) <= in_table, sorted(set(CASES) - in_table)
    assert len(rows) >= 20
