"""A chat model stops at the first of its stop ids (tokenizer EOS, generation config's list, chat template's end of
turn) in every backend, multi-turn, held-out evaluation, `generate`, and its exported generation config.

The policy here is forced to write the end-of-turn token (`<|eot_id|>`, `<|im_end|>`) first; the tokenizer's
`eos_token` alone (`<|end_of_text|>` for the Llama-3 style) would let it run to `max_new_tokens`.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from chat_models import chat_policy, llama3_style, qwen_style
from conftest import make_trainer, prompt_batch
from lit_rlhf import RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import AlgorithmConfig
from lit_rlhf.models.export import generation_config
from lit_rlhf.models.stop_ids import stop_token_ids
from lit_rlhf.rollout.backends.base import BackendContext
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.rollout.collect import RolloutSettings
from lit_rlhf.rollout.environment import Environment, StepResult
from lit_rlhf.rollout.multi_turn import Conversations, MultiTurnCollector

STYLES = {"llama3": (llama3_style, "<|eot_id|>"), "qwen": (qwen_style, "<|endoftext|>")}
"""Each style and the stop id its tokenizer's `eos_token` misses (Qwen's: the generation config's end of text)."""
MAX_NEW = 6


def forced_policy(style: str):
    """(tokenizer, policy, forced id): a policy whose every next token is the style's forced stop id (the final
    layer norm outputs one fixed vector, and only that token's tied embedding points along it)."""
    make, forced_token = STYLES[style]
    tok, config = make()
    policy = chat_policy(tok, config).eval()
    forced = tok.convert_tokens_to_ids(forced_token)
    with torch.no_grad():
        direction = torch.ones(policy.config.n_embd)
        policy.transformer.ln_f.weight.zero_()
        policy.transformer.ln_f.bias.copy_(direction)
        policy.transformer.wte.weight[forced] = 20 * direction / direction.norm() ** 2  # logit 20, others ~0
    return tok, policy, forced


def chat_prompts(tok, n: int = 2):
    texts = [tok.apply_chat_template([{"role": "user", "content": f"hi {i}"}], tokenize=False) for i in range(n)]
    return prompt_batch(tok, [t + ("<|im_start|>assistant\n" if "<|im_start|>" in t else "") for t in texts])


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("name", ["lean", "compiled", "generate"])
def test_every_backend_stops_at_the_first_stop_id(style, name):
    tok, policy, forced = forced_policy(style)
    assert tok.eos_token_id != forced  # the tokenizer alone would not stop here
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, backend=name)
    stops = stop_token_ids(tok, policy.generation_config)
    backend = make_backend(BackendContext(policy, stops, tok.pad_token_id, sampling))
    gen = backend.generate(chat_prompts(tok), 2, sampling)
    assert gen.response_ids.shape[1] == 1  # sampling stopped after the step every row ended at
    assert gen.response_ids[:, 0].tolist() == [forced] * 4
    assert gen.response_mask.sum(1).tolist() == [1] * 4  # the mask ends at the stop id
    assert not gen.truncated.any()


def length_reward(prompts, responses, **meta):
    return [float(len(r)) for r in responses]


class Metrics(L.Callback):
    """Every training step's logged metrics."""

    def __init__(self):
        self.logged: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


@pytest.mark.parametrize("style", list(STYLES))
def test_training_evaluation_and_generate_stop_at_end_of_turn(style):
    tok, policy, _ = forced_policy(style)
    module = RLHFModule(
        policy=policy,
        tokenizer=tok,
        reward_fns=[length_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2, truncated_score=-5.0),
        sampling=SamplingConfig(max_new_tokens=MAX_NEW),
        val_sampling=SamplingConfig(max_new_tokens=MAX_NEW, do_sample=False),
    )
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(4)]
    data = RolloutDataModule(prompts=rows, val_prompts=rows[:2], batch_size=2, max_prompt_length=64, seed=0)
    metrics = Metrics()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(max_steps=2, callbacks=[metrics], limit_val_batches=1, val_check_interval=1)
        trainer.fit(module, data)
    disagreements = [w for w in caught if "disagree" in str(w.message)]
    assert len(disagreements) == 1, [str(w.message) for w in caught]  # warned once, for every rollout and backend
    assert repr(tok.eos_token) in str(disagreements[0].message)
    logged = metrics.logged[-1]
    assert logged["rollout/frac_truncated"] == 0.0
    assert logged["val/frac_truncated"] == 0.0
    assert logged["val/response_len_mean"] == 1.0
    assert logged["rollout/score_mean"] == 0.0  # empty responses, not the truncation score
    assert module.generate("hi", SamplingConfig(max_new_tokens=MAX_NEW, do_sample=False)) == [""]


class Chatter(Environment):
    """Answers every turn and never ends an episode itself: only the policy's end of turn (or a limit) does."""

    def reset(self, rows):
        return [None] * len(rows)

    def step(self, states, actions):
        return StepResult(["go on"] * len(states), [0.0] * len(states), [False] * len(states), states)


def test_multi_turn_episodes_end_at_end_of_turn():
    tok, policy, _ = forced_policy("llama3")
    sampling = SamplingConfig(max_new_tokens=MAX_NEW)
    stops = stop_token_ids(tok, policy.generation_config)
    backend = make_backend(BackendContext(policy, stops, tok.pad_token_id, sampling))
    conversations = Conversations(Chatter(), max_turns=3, max_total_tokens=64)
    zero = lambda prompts, responses, meta, generation: torch.zeros(len(responses))  # noqa: E731
    collector = MultiTurnCollector(conversations, backend, tok, zero, RolloutSettings(2, sampling), stops)
    rollout, _ = collector.collect(chat_prompts(tok))
    assert not rollout.truncated.any()
    assert rollout.response_mask.sum(1).tolist() == [1] * 4  # one policy turn of one token: the end of turn
    assert rollout.context_mask.sum().item() == 0  # no environment turn after it
    assert rollout.responses == [""] * 4


@pytest.mark.parametrize("style", list(STYLES))
def test_the_exported_generation_config_lists_every_stop_id(style):
    tok, policy, _ = forced_policy(style)
    config = generation_config(policy, tok, None)
    assert sorted(config.eos_token_id) == sorted(stop_token_ids(tok, policy.generation_config))
    assert len(config.eos_token_id) == 2
