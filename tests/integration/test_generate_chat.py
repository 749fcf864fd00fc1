"""`module.generate` and `trainer.predict` take chat conversations and render them with the policy's chat
template exactly as training prompts are."""

from __future__ import annotations

import pytest
import torch

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.tasks.digits import builtin_tokenizer
from lit_rlhf.training.evaluation import prompt_batch

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CONVERSATION = [{"role": "user", "content": "31 4"}]


def module(template: str | None = TEMPLATE) -> RLHFModule:
    tok = builtin_tokenizer()
    tok.chat_template = template
    return RLHFModule(
        policy=make_policy(),
        tokenizer=tok,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=6),
    )


def test_generate_renders_a_conversation_as_training_does():
    m = module()
    batch = prompt_batch(m.tokenizer, [CONVERSATION, "926 5"])
    training = PromptTokenizer(m.tokenizer, 64, "error", "prompt")([{"messages": CONVERSATION}, {"prompt": "926 5"}])
    assert torch.equal(batch.input_ids, training.input_ids) and batch.texts == training.texts
    one = m.generate(CONVERSATION)
    both = m.generate([CONVERSATION, "926 5"])
    assert len(one) == 1 and len(both) == 2 and both[0] == one[0] and both[1] == m.generate("926 5")[0]


def test_generate_with_a_conversation_and_no_chat_template_names_the_fix():
    with pytest.raises(ConfigError, match="generate: prompt 0 is a chat prompt .* no chat template"):
        module(template=None).generate(CONVERSATION)


def test_predict_answers_chat_rows_through_the_template(tmp_path):
    m = module()
    data = RolloutDataModule(prompts=["1 2"], predict_prompts=[{"messages": CONVERSATION}], batch_size=1)
    rows = make_trainer(1, default_root_dir=tmp_path).predict(m, data)
    assert rows[0][0]["prompt"] == "31 4 " and rows[0][0]["response"] == m.generate(CONVERSATION)[0]
