"""`builtin:arithmetic` end to end: the task's own tokenizer and tiny policy, its prompt stream, and the answer
column reaching the verifiable reward and metric functions row by row."""

from __future__ import annotations

import ast
import itertools
import operator
import re
from fractions import Fraction

from conftest import make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.rewards.verifiable import exact_answer
from lit_rlhf.tasks.arithmetic import arithmetic_prompts


def expression_value(prompt: str) -> Fraction:
    """The value of the prompt's 'Calculate <expression>.' by Python's own parser, exactly."""
    text = re.fullmatch(r"Calculate (.+)\. Give the final answer.*", prompt).group(1)
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def walk(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](walk(node.left), walk(node.right))
        return Fraction(node.value)

    return walk(ast.parse(text, mode="eval").body)


def test_arithmetic_task_fits_with_its_answers_reaching_reward_and_metric():
    seen: list[tuple[str, str, str]] = []

    def recording_exact_answer(prompts, responses, answer, **meta):
        seen.extend(zip(prompts, answer, meta["answer_format"]))
        return exact_answer(prompts, responses, answer, **meta)

    module = RLHFModule(
        policy="builtin:arithmetic",
        reward_fns=[recording_exact_answer, "lit_rlhf.rewards.verifiable.format_reward"],
        metric_fns=["lit_rlhf.rewards.verifiable.exact_answer"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=6),
    )
    dm = RolloutDataModule(
        prompts="builtin:arithmetic", batch_size=2, max_prompt_length=128, val_prompts="builtin:arithmetic", val_size=2
    )
    trainer = make_trainer(max_steps=2, num_sanity_val_steps=0)
    trainer.fit(module, dm)
    trainer.validate(module, datamodule=dm, verbose=False)
    assert len(seen) >= 2 * 2 * 2  # two steps of 2 prompts x 2 samples
    assert all(answer == str(expression_value(prompt)) and fmt == "####" for prompt, answer, fmt in seen)
    assert float(trainer.callback_metrics["val/exact_answer"]) == 0.0  # 6 random characters never hold the answer


def test_chat_variant_renders_through_the_tiny_tokenizers_chat_template():
    dm = RolloutDataModule(
        prompts="builtin:arithmetic_chat", tokenizer="builtin:arithmetic_chat", batch_size=3, max_prompt_length=128
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    # the template writes each message's text on its own line; the plain variant's prompt is that text
    plain = [row["prompt"] for row in itertools.islice(arithmetic_prompts(dm.seed), 3)]
    assert batch.texts == [text + "\n" for text in plain]
    assert batch.meta["answer"] == [str(expression_value(text)) for text in plain]
