"""Multi-turn rollouts: the conversation grid and its masks, gradients only on the policy's tokens, the grid's
log-probs against each conversation alone, both sampling backends, the calculator, and bad environments."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from conftest import EOS_ID, PAD_ID, forward_from_logits, forward_logits, full_logprobs, make_policy, prompt_batch
from lit_rlhf.algorithms.experience import make_experience
from lit_rlhf.algorithms.objective import MinibatchTotals, ppo_objective
from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.rollout.backends.base import BackendContext
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.rollout.collect import RolloutSettings
from lit_rlhf.rollout.environment import Environment, EnvironmentConfig, StepResult, build_environment
from lit_rlhf.rollout.multi_turn import Conversations, MultiTurnCollector, conversations_from
from lit_rlhf.tasks.calculator import CalculatorEnvironment, CalculatorError, PeekEnvironment, evaluate
from lit_rlhf.types import Rollout

ID = {str(d): 3 + d for d in range(10)} | {">": 13, "<eos>": EOS_ID, "<pad>": PAD_ID}  # the built-in tokenizer's ids


def no_score(prompts, responses, meta, generation):
    return torch.zeros(len(prompts))


@dataclasses.dataclass
class Episodes:
    """An environment and its limits, collected with any policy and settings (a `MultiTurnCollector` per call)."""

    env: Environment
    max_turns: int
    max_total_tokens: int

    def collect(self, batch, policy, tokenizer, score, group_size, sampling, truncated_score=None):
        backend = make_backend(BackendContext(policy, tokenizer.eos_token_id, tokenizer.pad_token_id, sampling))
        settings = RolloutSettings(group_size, sampling, truncated_score)
        conversations = Conversations(self.env, self.max_turns, self.max_total_tokens)
        return MultiTurnCollector(conversations, backend, tokenizer, score, settings).collect(batch)


def scripted(model: torch.nn.Module, script: dict[int, str]) -> torch.nn.Module:
    """`model` made to write, at every position p, `script[p]` (by position id; '9' where the script is silent):
    a forward hook replaces the logits with -1e9 everywhere but that token."""

    def hook(module, args, kwargs, out):
        positions = kwargs["position_ids"][:, -out.logits.shape[1] :]  # the positions whose logits were kept
        logits = torch.full_like(out.logits, -1e9)
        for row in range(positions.shape[0]):
            for col in range(positions.shape[1]):
                logits[row, col, ID[script.get(int(positions[row, col]) + 1, "9")]] = 0.0
        out.logits = logits
        return out

    model.register_forward_hook(hook, with_kwargs=True)
    return model


def test_a_hand_built_conversation_masks_exactly_the_policys_tokens(tokenizer):
    # prompt '3142>' (positions 0-4, hidden digit (3+1+4+2) % 10 = 0): the policy asks '>' at 5, the environment
    # answers '0' at 6, the policy writes '0' at 7 and EOS at 8.
    policy = scripted(make_policy(), {5: ">", 7: "0", 8: "<eos>"}).eval()
    collector = Episodes(PeekEnvironment(ask_bonus=0.25), max_turns=3, max_total_tokens=10)
    batch = prompt_batch(tokenizer, ["3142>", "56>"])  # '56>' (hidden 1) is left padded by two: positions shift
    rollout, _ = collector.collect(batch, policy, tokenizer, no_score, 1, SamplingConfig(max_new_tokens=4))
    assert rollout.response_ids[0].tolist() == [ID[c] for c in [">", "0", "0", "<eos>"]] + [PAD_ID] * 2
    assert rollout.response_mask[0].tolist() == [True, False, True, True, False, False]
    assert rollout.context_mask[0].tolist() == [False, True, False, False, False, False]
    # row 2: positions 0-2 are the prompt, so '>' at 3 is silent in the script: it writes '9' '9' '>' (asks at 5)
    # -> '1' from the environment at 6 -> '0' (position 7) EOS: a wrong answer after an ask.
    assert rollout.response_ids[1].tolist() == [ID[c] for c in ["9", "9", ">", "1", "0", "<eos>"]]
    assert rollout.response_mask[1].tolist() == [True, True, True, False, True, True]
    assert rollout.context_mask[1].tolist() == [False, False, False, True, False, False]
    assert rollout.truncated.tolist() == [False, False]
    assert rollout.scores.tolist() == [1.25, 0.25]  # ask bonus + exact answer; ask bonus + wrong answer
    assert rollout.responses == [">00", "99>10"]
    # attention sees the environment's tokens; the grid's padding stays out
    assert rollout.attention_mask()[0, -6:].tolist() == [1, 1, 1, 1, 0, 0]
    assert rollout.attention_mask()[1, -6:].tolist() == [1, 1, 1, 1, 1, 1]


def test_limits_truncate_an_episode_as_a_single_turn_does(tokenizer):
    batch = prompt_batch(tokenizer, ["3142>"])
    sampling = SamplingConfig(max_new_tokens=3)
    # a turn that fills its token limit without EOS or a stop string: truncated, even though the env ends it
    rollout, _ = Episodes(PeekEnvironment(), 3, 10).collect(
        batch, scripted(make_policy(), {}).eval(), tokenizer, no_score, 1, sampling
    )
    assert rollout.response_ids[0].tolist() == [ID["9"]] * 3 and rollout.truncated.tolist() == [True]
    # asking at every turn: the episode runs out of turns (max_turns 2) -> truncated
    always_ask = scripted(make_policy(), {p: ">" for p in range(5, 20)}).eval()
    rollout, _ = Episodes(PeekEnvironment(), 2, 10).collect(batch, always_ask, tokenizer, no_score, 1, sampling)
    assert rollout.response_ids[0].tolist() == [ID[">"], ID["0"], ID[">"]] and rollout.truncated.tolist() == [True]
    # the token budget: 2 tokens in all -> '>' + the observation leaves no room for another policy token
    rollout, _ = Episodes(PeekEnvironment(), 5, 2).collect(batch, always_ask, tokenizer, no_score, 1, sampling)
    assert rollout.response_ids[0].tolist() == [ID[">"]] and rollout.truncated.tolist() == [True]
    # max_turns 1 with a single-turn answer and EOS is exactly a single-turn rollout, not truncated
    answer = scripted(make_policy(), {5: "0", 6: "<eos>"}).eval()
    rollout, _ = Episodes(PeekEnvironment(), 1, 10).collect(batch, answer, tokenizer, no_score, 1, sampling)
    assert rollout.response_mask.tolist() == [[True, True]] and rollout.truncated.tolist() == [False]
    assert rollout.scores.tolist() == [1.0]


def test_a_special_token_does_not_match_a_stop_string(tokenizer):
    """'<pad>' contains '>', the peek tool call; a turn ends only at a '>' the policy wrote as text."""
    policy = scripted(make_policy(), {5: "<pad>", 6: "0", 7: "<eos>"}).eval()
    batch = prompt_batch(tokenizer, ["3142>"])
    collector = Episodes(PeekEnvironment(), 2, 10)
    rollout, _ = collector.collect(batch, policy, tokenizer, no_score, 1, SamplingConfig(max_new_tokens=4))
    assert rollout.response_ids.tolist() == [[PAD_ID, ID["0"], EOS_ID]] and not rollout.context_mask.any()
    assert rollout.responses == ["<pad>0"] and rollout.scores.tolist() == [0.0]  # not exactly '0'


def hand_rollout() -> Rollout:
    """Two conversations of 6 tokens after a 3-token prompt; environment tokens at columns 1-2 and 3."""
    ids = torch.tensor([[5, 13, 4, 6, 7, EOS_ID], [13, 6, 8, 9, EOS_ID, PAD_ID]])
    policy = torch.tensor([[1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 1, 0]], dtype=torch.bool)
    env = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    return Rollout(
        prompt_ids=torch.tensor([[6, 4, 13], [PAD_ID, 7, 13]]),
        prompt_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]),
        response_ids=ids,
        response_mask=policy,
        context_mask=env,
        truncated=torch.zeros(2, dtype=torch.bool),
        scores=torch.tensor([1.0, 0.0]),
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_environments_tokens_get_no_gradient(aggregation):
    torch.manual_seed(0)
    rollout = hand_rollout()
    model = make_policy()
    algo = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.1, entropy_coef=0.01, loss_aggregation=aggregation)
    logits = forward_logits(model, rollout.input_ids(), rollout.attention_mask(), 6)
    ref_logits = logits.detach() + 0.3 * torch.randn_like(logits)
    sampling_forward = forward_from_logits(logits.detach(), rollout.response_ids)
    experience = make_experience(rollout, algo, sampling_forward, full_logprobs(ref_logits, rollout.response_ids))
    env = rollout.context_mask
    shift = 0.3 * torch.randn_like(logits)

    def loss_and_grad(exp):
        leaf = (logits.detach() + shift).requires_grad_(True)  # current != old: the ratio is not 1
        current = forward_from_logits(leaf, exp.response_ids)
        loss, _ = ppo_objective(current, exp, algo, MinibatchTotals.of(exp, 6))
        loss.backward()
        return loss.detach(), leaf.grad

    loss, grad = loss_and_grad(experience)
    assert torch.count_nonzero(grad[env]) == 0  # exactly zero at every environment position
    assert (grad.abs().sum(-1) > 0)[experience.response_mask].all()  # and nonzero at every policy position
    # whatever the experience holds at the environment's positions changes nothing
    junk = {
        name: torch.where(env, torch.full_like(getattr(experience, name), 7.0), getattr(experience, name))
        for name in ("advantages", "old_logprobs", "ref_logprobs")
    }
    loss2, grad2 = loss_and_grad(dataclasses.replace(experience, **junk))
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)


def test_the_environments_tokens_are_attended():
    rollout = hand_rollout()
    model = make_policy()
    before = forward_logits(model, rollout.input_ids(), rollout.attention_mask(), 6)
    changed = dataclasses.replace(rollout, response_ids=rollout.response_ids.clone())
    changed.response_ids[0, 1] = 11  # an environment token
    after = forward_logits(model, changed.input_ids(), changed.attention_mask(), 6)
    for column in (4, 5):  # the policy's tokens after it (their logits come from positions after column 1)
        assert not torch.allclose(before[0, column], after[0, column])
    assert torch.equal(before[1], after[1])


def test_the_grids_log_probs_are_those_of_each_conversation_alone(tokenizer):
    """Each turn re-prefills prompt + conversation (no KV cache across turns); the update's forward over the
    padded grid must give every policy token the log-prob it has in its own unpadded conversation."""
    torch.manual_seed(0)
    policy = make_policy().eval()
    collector = Episodes(PeekEnvironment(), max_turns=3, max_total_tokens=12)
    batch = prompt_batch(tokenizer, ["3142>", "9>", "55555>"])
    rollout, _ = collector.collect(batch, policy, tokenizer, no_score, 4, SamplingConfig(max_new_tokens=4))
    assert rollout.context_mask.any()  # some episodes asked
    T = rollout.response_ids.shape[1]
    with torch.no_grad():
        logits = forward_logits(policy, rollout.input_ids(), rollout.attention_mask(), T)
        grid = full_logprobs(logits, rollout.response_ids)
        for b in range(rollout.batch_size):
            attended = rollout.response_mask[b] | rollout.context_mask[b]
            n = int(attended.sum())
            assert attended[:n].all()  # the conversation is contiguous, then padding
            alone = torch.cat([rollout.prompt_ids[b][rollout.prompt_mask[b].bool()], rollout.response_ids[b, :n]])
            single = forward_logits(policy, alone[None], torch.ones_like(alone)[None], n)
            expected = full_logprobs(single, rollout.response_ids[b : b + 1, :n])[0]
            policy_cols = rollout.response_mask[b, :n]
            torch.testing.assert_close(grid[b, :n][policy_cols], expected[policy_cols], atol=1e-5, rtol=1e-5)
            assert rollout.response_mask[b, n - 1]  # every conversation ends with a policy token


def test_both_sampling_backends_give_the_same_conversations(tokenizer):
    policy = make_policy().eval()
    batch = prompt_batch(tokenizer, ["3142>", "9>"])
    rollouts = []
    for backend in ("lean", "generate"):
        torch.manual_seed(3)
        sampling = SamplingConfig(max_new_tokens=3, backend=backend, share_prefill=False)
        rollout, _ = Episodes(PeekEnvironment(), 3, 10).collect(batch, policy, tokenizer, no_score, 4, sampling)
        rollouts.append(rollout)
    lean, hf = rollouts
    assert lean.context_mask.any()
    for name in ("response_ids", "response_mask", "context_mask", "truncated", "scores"):
        assert torch.equal(getattr(lean, name), getattr(hf, name)), name


# ----------------------------------------------------------------------------- the calculator


@pytest.mark.parametrize(
    ("text", "value"),
    [("12*7", 84), ("2+3*4", 14), ("(2+3)*4", 20), ("10-4-3", 3), ("8/4/2", 1), ("7/2", Fraction(7, 2)),
     ("-3*-2", 6), ("-(2+3)", -5), (" 1 + 2 ", 3), ("1.5*2", 3)],
)  # fmt: skip
def test_the_calculator_evaluates_arithmetic(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize("text", ["", "1/0", "2**3", "__import__('os')", "(1+2", "1+", "3 4", "1.2.3", "9" * 201])
def test_the_calculator_refuses_anything_else(text):
    with pytest.raises(CalculatorError):
        evaluate(text)


def test_the_calculator_environment_answers_tool_calls_and_checks_the_answer():
    env = CalculatorEnvironment()
    states = env.reset([{"prompt": "Calculate 12 * 7 - 4.", "answer": "80"}] * 4)
    actions = ["I compute <calc>12*7</calc>", "<calc>1/0</calc>", "So 12*7-4 = 80", "#### 81"]
    result = env.step(states, actions)
    assert result.observations[:2] == ["<result>84</result>", "<result>error: division by zero</result>"]
    assert result.done == [False, False, True, True]
    assert result.rewards == [0.0, 0.0, 1.0, 0.0]
    with pytest.raises(KeyError, match="answer_column"):
        env.reset([{"prompt": "1+1"}])


# ----------------------------------------------------------------------------- bad environments and settings


class Scripted(Environment):
    """Returns whatever `answer(n)` makes of a step of n episodes."""

    def __init__(self, answer, states=None):
        self.answer, self.states = answer, states

    def reset(self, rows):
        return self.states(len(rows)) if self.states else [None] * len(rows)

    def step(self, states, actions):
        return self.answer(len(actions))


def ok(n, **change):
    return StepResult(
        **{"observations": ["1"] * n, "rewards": [0.0] * n, "done": [True] * n, "states": [None] * n} | change
    )


@pytest.mark.parametrize(
    ("env", "error", "match"),
    [
        (Scripted(lambda n: ok(n, rewards=[0.0] * (n - 1))), ValueError, "rewards has 7 entries for 8 episodes"),
        (Scripted(lambda n: ok(n, observations=[1] * n)), TypeError, r"observations\[0\] is a int, not a str"),
        (Scripted(lambda n: ok(n, rewards=[float("nan")] * n)), ValueError, r"rewards\[0\] is nan; give a finite"),
        (Scripted(lambda n: ok(n, done=[1] * n)), TypeError, r"done\[0\] is 1; give a bool"),
        (Scripted(lambda n: ok(n, states="x")), ValueError, "states has a str for 8 episodes"),
        (Scripted(lambda n: (["x"] * n, [0.0] * n)), TypeError, "returned a tuple; return a lit_rlhf"),
        (Scripted(lambda n: ok(n), states=lambda n: [None]), ValueError, "reset returned 1 states for 8 episodes"),
    ],
    ids=["wrong-batch-size", "observation-not-str", "nan-reward", "done-not-bool", "states-a-str", "not-a-result",
         "reset-wrong-size"],
)  # fmt: skip
def test_a_bad_environment_is_named(tokenizer, env, error, match):
    collector = Episodes(env, 2, 8)
    batch = prompt_batch(tokenizer, ["31>", "4>"])
    with pytest.raises(error, match=match):
        collector.collect(batch, make_policy().eval(), tokenizer, no_score, 4, SamplingConfig(max_new_tokens=2))


def test_a_conversation_longer_than_the_context_window_is_refused(tokenizer):
    from lit_rlhf.training.module import RLHFModule

    environment = EnvironmentConfig("builtin:peek", max_turns=2, max_total_tokens=60)
    module = RLHFModule(policy=make_policy(), tokenizer=tokenizer, algorithm={"name": "grpo"}, environment=environment)
    batch = prompt_batch(tokenizer, ["3142>"])  # 5 prompt + 60 > the built-in policy's 64 positions
    with pytest.raises(ConfigError, match=r"model.environment.max_total_tokens: 5 \+ 60 = 65 tokens, but model.policy"):
        module.on_train_batch_start(batch, 0)
    with pytest.raises(ConfigError, match=r"model.environment.max_total_tokens: 5 \+ 60 = 65 tokens, but model.policy"):
        module.on_validation_batch_start(batch, 0)


class NotAnEnvironment:
    pass


@pytest.mark.parametrize(
    ("settings", "algorithm", "match"),
    [
        ({"name": "builtin:chess"}, {}, "unknown built-in environment 'builtin:chess'; available: builtin:calc"),
        ({"name": "no_such_module.Env"}, {}, "model.environment.name: cannot import module 'no_such_module'"),
        ({"name": f"{__name__}.NotAnEnvironment"}, {}, "built a NotAnEnvironment, not a lit_rlhf"),
        ({"name": "builtin:peek", "options": {"bonus": 1}}, {}, r"model.environment.options: .* rejected \{'bonus'"),
        ({"name": "builtin:peek", "max_turns": 0}, {}, "model.environment.max_turns"),
        ({"name": "builtin:peek", "max_total_tokens": 0}, {}, "model.environment.max_total_tokens"),
        ({"name": "builtin:peek"}, {"name": "ppo"}, "'gae' .* not supported with model.environment"),
        ({"name": "builtin:peek"}, {"name": "grpo", "overlong_buffer": 2}, "model.algorithm.overlong_buffer"),
        (
            {"name": "builtin:peek"},
            {"advantage_estimator": "reinforce_pp", "gamma": 0.9, "group_size": 1},
            "model.algorithm.gamma: 0.9",
        ),
    ],
)
def test_bad_multi_turn_settings_are_config_errors(settings, algorithm, match):
    algo = AlgorithmConfig(**({"name": "grpo"} | algorithm))
    with pytest.raises(ConfigError, match=match):
        conversations_from(settings, algo)


def test_the_module_takes_an_environment_instead_of_reward_functions(tokenizer):
    from lit_rlhf.training.module import RLHFModule

    module = RLHFModule(
        policy=make_policy(), tokenizer=tokenizer, algorithm={"name": "grpo"},
        environment=EnvironmentConfig("builtin:peek", max_turns=2, max_total_tokens=16),
    )  # fmt: skip
    assert isinstance(module.conversations.env, PeekEnvironment)
    rollout, _ = module.make_rollout(prompt_batch(tokenizer, ["3142>"]))
    assert rollout.context_mask is not None and rollout.batch_size == 8
    # held-out prompts are answered in conversations too (greedy by default), and metric functions see them
    answers = module.answer(prompt_batch(tokenizer, ["3142>", "9>"]))
    assert answers.batch_size == 2 and answers.context_mask is not None
    with pytest.raises(ConfigError, match="give at least one reward function, a reward model or an environment"):
        RLHFModule(policy=make_policy(), tokenizer=tokenizer, algorithm={"name": "grpo"})


def test_build_environment_passes_options():
    env = build_environment(EnvironmentConfig("lit_rlhf.tasks.calculator.PeekEnvironment", options={"ask_bonus": 0.5}))
    assert isinstance(env, PeekEnvironment) and env.ask_bonus == 0.5


def test_a_calculator_episode_end_to_end():
    """A scripted policy calls the calculator, reads '<result>35</result>', and answers: text tokenizer, real env."""
    from lit_rlhf.tasks.text import text_policy, text_tokenizer

    tok = text_tokenizer()
    prompt, call, result, answer = "Calculate 5 * 7.", "<calc>5*7</calc>", "<result>35</result>", "#### 35"
    ids = [tok.encode(c, add_special_tokens=False) for c in (prompt, call, result, answer)]
    assert all(len(piece) == len(text) for piece, text in zip(ids, (prompt, call, result, answer), strict=True))
    L, C, R = len(prompt), len(call), len(result)
    script = {L + i: ch for i, ch in enumerate(call)} | {L + C + R + i: ch for i, ch in enumerate(answer)}
    script[L + C + R + len(answer)] = "<eos>"
    vocab = tok.get_vocab() | {"<eos>": tok.eos_token_id}

    model = text_policy().eval()

    def hook(module, args, kwargs, out):
        positions = kwargs["position_ids"][:, -out.logits.shape[1] :]
        logits = torch.full_like(out.logits, -1e9)
        for row in range(positions.shape[0]):
            for col in range(positions.shape[1]):
                logits[row, col, vocab[script.get(int(positions[row, col]) + 1, " ")]] = 0.0
        out.logits = logits
        return out

    model.register_forward_hook(hook, with_kwargs=True)
    batch = prompt_batch(tok, [prompt], {"answer": ["35"]})
    collector = Episodes(CalculatorEnvironment(), max_turns=3, max_total_tokens=64)
    rollout, _ = collector.collect(batch, model, tok, no_score, 1, SamplingConfig(max_new_tokens=20))
    assert rollout.responses == [call + result + answer]
    assert rollout.context_mask[0].tolist()[: C + R + 1] == [False] * C + [True] * R + [False]
    assert int(rollout.response_mask.sum()) == C + len(answer) + 1  # the call, the answer and EOS
    assert rollout.scores.tolist() == [1.0] and rollout.truncated.tolist() == [False]
