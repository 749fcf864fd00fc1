"""Models (position ids, padding invariance, value head) and the rollout (masks, generation, advantages,
experience collection, reward-function errors), each against hand numbers or an independent computation."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from conftest import EOS_ID, PAD_ID, forward_logits, generate, make_policy, prompt_batch, response_logits
from lit_rlhf.algorithms import losses
from lit_rlhf.algorithms.experience import (
    compute_advantages,
    frozen_forward,
    make_experience,
    policy_forward,
    response_stats,
)
from lit_rlhf.config import AlgorithmConfig, SamplingConfig
from lit_rlhf.models.actor_critic import ActorCritic
from lit_rlhf.models.forward import position_ids_from_mask
from lit_rlhf.models.loading import frozen_copy
from lit_rlhf.rewards.composer import RewardComposer
from lit_rlhf.rewards.functions import RewardError, call_reward_fn
from lit_rlhf.rollout.backends.base import BackendContext
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.rollout.collect import RolloutSettings, SingleTurnCollector
from lit_rlhf.rollout.generation import response_mask_from_ids
from lit_rlhf.types import PromptBatch

# ----------------------------------------------------------------------------- helpers


def plain_response_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """Log-probs of `response_ids` after `prompt_ids`: one unpadded sequence, default positions, full logits,
    log_softmax then gather. Independent of every helper in the library. -> (len(response_ids),) float64."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # (S, V)
    logp = torch.log_softmax(logits, dim=-1)
    P = len(prompt_ids)
    return torch.stack([logp[P - 1 + t, tok] for t, tok in enumerate(response_ids)])


def left_pad(ids: list[int], n_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([[PAD_ID] * n_pad + ids]), torch.tensor([[0] * n_pad + [1] * len(ids)])


# ----------------------------------------------------------------------------- models


def test_position_ids_from_mask_hand_cases():
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1],  # left padded prompt
            [1, 1, 1, 1, 1],  # no padding
            [0, 1, 1, 1, 0],  # left padded prompt + a response padded on the right
            [0, 0, 0, 0, 1],  # one real token
        ]
    )
    expected = torch.tensor(
        [
            [0, 0, 0, 1, 2],
            [0, 1, 2, 3, 4],
            [0, 0, 1, 2, 2],
            [0, 0, 0, 0, 0],
        ]
    )
    assert torch.equal(position_ids_from_mask(mask), expected)


@pytest.mark.parametrize("n_pad", [0, 3])
def test_response_logprobs_ignore_left_padding(tiny_policy, n_pad):
    model = tiny_policy.eval()
    prompt, response = [6, 4, 7, 13], [4, 6, 7, EOS_ID]  # '314>' -> '134' EOS
    expected = plain_response_logprobs(model, prompt, response)

    ids, mask = left_pad(prompt + response, n_pad)
    with torch.no_grad():
        logits = forward_logits(model, ids, mask, len(response))
    assert logits.shape == (1, len(response), model.config.vocab_size)
    got = torch.log_softmax(logits[0].double(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_actor_critic_logprobs_same_with_and_without_extra_padding(tiny_policy):
    """Same prompt with 0 and 3 extra pad columns, and in a batch next to a longer prompt."""
    ac = ActorCritic(tiny_policy, value_head=True).eval()
    prompt, response = [5, 8, 13], [5, 8, EOS_ID, PAD_ID]  # response padded after its EOS
    resp_mask = [1, 1, 1, 0]
    out = []
    for n_pad in (0, 3):
        ids = torch.tensor([[PAD_ID] * n_pad + prompt + response])
        mask = torch.tensor([[0] * n_pad + [1] * len(prompt) + resp_mask])
        with torch.no_grad():
            forward, values = ac(ids, mask, len(response))
            logits = response_logits(forward)
        logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor([response])[..., None])[..., 0]
        out.append((logp[0, :3], values[0, :3]))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=0)
    # and both equal the plain unpadded forward
    torch.testing.assert_close(out[0][0], plain_response_logprobs(tiny_policy, prompt, response[:3]), atol=1e-5, rtol=0)


def test_actor_critic_values_read_last_hidden_state_at_p_minus_1_to_p_plus_t_minus_2(tiny_policy):
    ac = ActorCritic(tiny_policy, value_head=True).eval()
    with torch.no_grad():
        ac.value_head.bias.fill_(0.25)  # a non-zero bias must show up too
    ids = torch.tensor([[0, 0, 6, 4, 13, 4, 6, 1], [9, 3, 7, 5, 13, 3, 1, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0]])
    P, T = 5, 3
    with torch.no_grad():
        forward, values = ac(ids, mask, T)
        logits = response_logits(forward)
        # explicit forward through the backbone: its last hidden state is what the LM head reads
        hidden = tiny_policy.transformer(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).last_hidden_state  # (B, P+T, H)
        full_logits = tiny_policy.lm_head(hidden)
    assert values.shape == (2, T) and values.dtype == torch.float32
    w, b = ac.value_head.weight[0].detach(), ac.value_head.bias[0].detach()
    for row in range(2):
        for t in range(T):
            pos = P - 1 + t  # the position that predicts response token t
            expected_value = float(hidden[row, pos] @ w + b)
            assert values[row, t].item() == pytest.approx(expected_value, abs=1e-5)
            torch.testing.assert_close(logits[row, t], full_logits[row, pos], atol=1e-5, rtol=0)


def test_actor_critic_separate_critic_backbone_and_no_value_head(tiny_policy):
    critic = make_policy(seed=1)
    ac = ActorCritic(tiny_policy, value_head=True, critic_backbone=critic).eval()
    ids = torch.tensor([[6, 4, 13, 4, 6]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        _, values = ac(ids, mask, 2)
        hidden = critic.transformer(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = ac.value_head(hidden[:, 2:4]).squeeze(-1)
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)

    no_head = ActorCritic(make_policy(), value_head=False)
    assert no_head.value_head is None
    assert no_head(ids, mask, 2)[1] is None


# ----------------------------------------------------------------------------- response masks


@pytest.mark.parametrize(
    "ids, eos, mask, truncated",
    [
        ([5, 6, 1, 0, 0], 1, [1, 1, 1, 0, 0], False),  # EOS in the middle, pad after
        ([1, 5, 6, 7, 8], 1, [1, 0, 0, 0, 0], False),  # EOS first: only the EOS counts
        ([5, 6, 7, 8, 9], 1, [1, 1, 1, 1, 1], True),  # no EOS: truncated, all valid
        ([5, 1, 6, 1, 7], 1, [1, 1, 0, 0, 0], False),  # only the first EOS ends it
        ([5, 6, 7, 8, 1], 1, [1, 1, 1, 1, 1], False),  # EOS at the last slot is not truncation
        ([5, 6, 0, 0, 0], 0, [1, 1, 1, 0, 0], False),  # pad == eos: padding after the EOS is not valid
        ([5, 6, 7, 8, 9], 0, [1, 1, 1, 1, 1], True),  # pad == eos, no EOS
    ],
)
def test_response_mask_from_ids_hand_cases(ids, eos, mask, truncated):
    got_mask, got_truncated = response_mask_from_ids(torch.tensor([ids]), eos)
    assert got_mask.dtype == torch.bool
    assert got_mask[0].int().tolist() == mask
    assert bool(got_truncated[0]) is truncated


def test_response_mask_batch_matches_slow_loop():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 4, (64, 7), generator=g)  # many EOS (id 1)
    mask, truncated = response_mask_from_ids(ids, 1)
    for row in range(ids.shape[0]):
        seen = False
        for t in range(ids.shape[1]):
            assert bool(mask[row, t]) is (not seen)
            seen = seen or int(ids[row, t]) == 1
        assert bool(truncated[row]) is (not seen)


# ----------------------------------------------------------------------------- generation


def test_generate_group_copies_in_order_and_pads_after_eos(tiny_policy, tokenizer):
    texts = ["31>", "98765>", "0>"]
    batch = prompt_batch(tokenizer, texts)
    G = 4
    torch.manual_seed(1)
    gen = generate(tiny_policy.eval(), batch, G, SamplingConfig(max_new_tokens=8), EOS_ID, PAD_ID)
    B = len(texts) * G
    assert gen.prompt_ids.shape == (B, batch.input_ids.shape[1])
    assert gen.response_ids.shape[0] == B and 1 <= gen.response_ids.shape[1] <= 8
    for b in range(len(texts)):
        for g in range(G):
            assert torch.equal(gen.prompt_ids[b * G + g], batch.input_ids[b])
            assert torch.equal(gen.prompt_mask[b * G + g], batch.attention_mask[b])
    saw_eos_before_end = saw_truncated = False
    for row in range(B):
        r = gen.response_ids[row].tolist()
        if EOS_ID in r:
            end = r.index(EOS_ID)
            assert r[end + 1 :] == [PAD_ID] * (len(r) - end - 1)  # pad after the EOS
            assert gen.response_mask[row].tolist() == [True] * (end + 1) + [False] * (len(r) - end - 1)
            assert not gen.truncated[row]
            saw_eos_before_end |= end < len(r) - 1
        else:
            assert gen.response_mask[row].all() and gen.truncated[row]
            assert len(r) == 8  # no EOS means the limit was hit
            saw_truncated = True
    assert saw_eos_before_end and saw_truncated  # the seed exercises both branches


def test_generate_is_unaffected_by_left_padding(tokenizer):
    """Near-greedy sampling from a model whose output depends strongly on positions: the short prompt gives
    the same tokens alone and left-padded next to a long one (and different tokens with shifted positions)."""
    model = make_policy().eval()
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(10)
    greedy = SamplingConfig(max_new_tokens=6, temperature=1e-4)
    alone = generate(model, prompt_batch(tokenizer, ["31>"]), 1, greedy, EOS_ID, PAD_ID)
    padded = generate(model, prompt_batch(tokenizer, ["31>", "98765>"]), 1, greedy, EOS_ID, PAD_ID)
    T = min(alone.response_ids.shape[1], padded.response_ids.shape[1])
    assert torch.equal(alone.response_ids[0, :T], padded.response_ids[0, :T])
    # control: attending to the pads (positions shifted by 3) changes the answer, so the check has teeth
    ids = padded.prompt_ids[:1]
    shifted = generate(model, PromptBatch(ids, torch.ones_like(ids), ["31>"]), 1, greedy, EOS_ID, PAD_ID)
    assert not torch.equal(shifted.response_ids[0, :T], alone.response_ids[0, :T])


# ----------------------------------------------------------------------------- advantages


MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ],
    dtype=torch.bool,
)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_compute_advantages_group_estimators_match_hand_normalisation(estimator):
    algo = AlgorithmConfig(name="grpo", group_size=3, advantage_estimator=estimator)
    scores = torch.tensor([0.0, 1.0, 5.0, 2.0, 2.0, 2.0])
    kl = torch.rand(6, 5)  # GRPO keeps the KL out of the reward: must not matter
    advantages, returns = compute_advantages(algo, scores, kl, None, MASK)
    assert returns is None
    expected_per_seq = []
    for start in (0, 3):
        group = scores[start : start + 3].tolist()
        mean = statistics.mean(group)
        for i, s in enumerate(group):
            if estimator == "grpo":
                a = 0.0 if len(set(group)) == 1 else (s - mean) / (statistics.stdev(group) + algo.group_eps)
            elif estimator == "rloo":
                others = group[:i] + group[i + 1 :]
                a = s - sum(others) / len(others)
            else:
                a = s - mean
            expected_per_seq.append(a)
    # hand numbers for the first group, grpo: mean 2, stdev sqrt(7)
    if estimator == "grpo":
        assert expected_per_seq[0] == pytest.approx(-2 / math.sqrt(7), rel=1e-5)
    for b in range(6):
        for t in range(5):
            expected = expected_per_seq[b] if MASK[b, t] else 0.0
            assert advantages[b, t].item() == pytest.approx(expected, abs=1e-5)


def slow_gae(scores, kl, values, mask, beta, gamma, lam):
    """Token rewards and GAE for one row at a time with plain Python floats."""
    B, T = mask.shape
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    totals = []
    for b in range(B):
        L = int(mask[b].sum())
        r = [-beta * float(kl[b, t]) for t in range(L)]
        r[L - 1] += float(scores[b])
        totals.append(sum(r))
        v = [float(values[b, t]) for t in range(L)] + [0.0]
        a_next = 0.0
        for t in reversed(range(L)):
            delta = r[t] + gamma * v[t + 1] - v[t]
            a_next = delta + gamma * lam * a_next
            adv[b][t] = a_next
            ret[b][t] = a_next + v[t]
    return torch.tensor(adv), torch.tensor(ret), torch.tensor(totals)


def test_compute_advantages_ppo_matches_slow_gae_on_hand_built_rewards():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, generator=g)
    kl = torch.randn(6, 5, generator=g)
    values = torch.randn(6, 5, generator=g) * 100  # garbage on padding must not leak
    algo = AlgorithmConfig(name="ppo", kl_coef=0.1, gamma=0.9, lam=0.8, whiten_advantages=False)
    advantages, returns = compute_advantages(algo, scores, kl, values, MASK)
    total = losses.token_rewards(scores, kl, MASK, 0.1).sum(1)  # the KL-penalised sequence reward
    exp_adv, exp_ret, exp_total = slow_gae(scores, kl, values, MASK, 0.1, 0.9, 0.8)
    torch.testing.assert_close(advantages, exp_adv, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(returns, exp_ret, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(total, exp_total, atol=1e-5, rtol=1e-5)

    # whitened: a positive affine map of the raw advantages with mean 0, std ~1 over valid tokens, 0 elsewhere
    whitened, returns_w = compute_advantages(
        AlgorithmConfig(name="ppo", kl_coef=0.1, gamma=0.9, lam=0.8), scores, kl, values, MASK
    )
    torch.testing.assert_close(returns_w, exp_ret, atol=1e-4, rtol=1e-5)  # returns before whitening
    valid_raw, valid_w = exp_adv[MASK].double(), whitened[MASK].double()
    assert abs(valid_w.mean().item()) < 1e-5
    assert valid_w.std().item() == pytest.approx(1.0, abs=0.05)
    expected_w = (valid_raw - valid_raw.mean()) / valid_raw.std() * valid_w.std()
    torch.testing.assert_close(valid_w, expected_w, atol=1e-4, rtol=1e-4)
    assert (whitened[~MASK] == 0).all()


def test_compute_advantages_ppo_without_kl_in_reward_uses_score_only():
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, 1.0])
    kl = torch.full((6, 5), 7.0)
    values = torch.zeros(6, 5)
    algo = AlgorithmConfig(name="ppo", kl_in_reward=False, gamma=1.0, lam=1.0, whiten_advantages=False)
    advantages, returns = compute_advantages(algo, scores, kl, values, MASK)
    # gamma = lambda = 1, V = 0: every valid token's advantage is the score (return-to-go)
    torch.testing.assert_close(advantages, scores[:, None] * MASK.float())
    torch.testing.assert_close(returns, scores[:, None] * MASK.float())


# ----------------------------------------------------------------------------- collect_experience


@torch.no_grad()
def collect_experience(
    prompts, actor_critic, reference, reward_model, composer, tokenizer, algo, sampling, policy_version=0
):
    """Phases 2 and 3 of a training step outside a Trainer: rollout, then a no-grad evaluation."""

    def score(texts, responses, meta, generation):
        ids, mask, last = generation.input_ids(), generation.attention_mask(), generation.last_index()
        return composer(texts, responses, meta, reward_model, ids, mask, last)

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    backend = make_backend(BackendContext(actor_critic.policy, eos, pad, sampling))
    settings = RolloutSettings(algo.group_size, sampling, algo.truncated_score)
    rollout, timings = SingleTurnCollector(backend, tokenizer, score, settings).collect(prompts, policy_version)
    ref = frozen_forward(reference, rollout) if reference is not None else None
    exact_kl = ref is not None and algo.kl_estimator == "full"
    ref_logprobs = None
    if ref is not None and not exact_kl:
        ref_logprobs = response_stats(ref, rollout, sampling.temperature, None, entropy=False).logprobs
    sampling_policy = policy_forward(actor_critic, rollout, sampling.temperature, None, ref if exact_kl else None)
    return make_experience(rollout, algo, sampling_policy, ref_logprobs), timings


def decode_by_hand(tok, ids: list[int]) -> str:
    """Tokens up to (not including) the first EOS; other special tokens stay visible as their text, so a
    policy cannot hide padding inside an answer."""
    vocab = {i: s for s, i in tok.get_vocab().items()}
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        out.append(vocab[i])
    return "".join(out)


def digit_count_reward(prompts, responses, target):
    """Score: number of digits in the response plus 10 x the first digit of the meta column."""
    return [sum(c.isdigit() for c in r) + 10 * int(t[0]) for r, t in zip(responses, target)]


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_collect_experience_scores_logprobs_and_shapes(tiny_policy, tokenizer, name):
    texts, targets = ["314>", "27>", "9055>"], ["134", "27", "0559"]
    G = 2 if name == "grpo" else 1
    algo = AlgorithmConfig(name=name, group_size=G, ppo_epochs=2)  # two passes: old log-probs are computed
    ac = ActorCritic(tiny_policy, value_head=algo.uses_critic).eval()
    reference = frozen_copy(tiny_policy)
    calls = []

    def reward(prompts, responses, **meta):
        calls.append((list(prompts), list(responses), meta))
        return digit_count_reward(prompts, responses, **meta)

    torch.manual_seed(2)
    exp, timings = collect_experience(
        prompt_batch(tokenizer, texts, {"target": targets}),
        ac,
        reference,
        None,
        RewardComposer([reward]),
        tokenizer,
        algo,
        SamplingConfig(max_new_tokens=6),
        policy_version=7,
    )
    B, T = 3 * G, exp.response_ids.shape[1]
    assert exp.batch_size == B and exp.policy_version == 7
    for field in ("old_logprobs", "advantages", "ref_logprobs", "kl", "response_mask", "loss_mask"):
        assert getattr(exp, field).shape == (B, T), field
    assert (exp.values is not None) == (name == "ppo") and (exp.returns is not None) == (name == "ppo")

    # the reward function saw the prompts (repeated G times, in order), the decoded responses and the meta
    ((seen_prompts, seen_responses, seen_meta),) = calls
    assert seen_prompts == [t for t in texts for _ in range(G)]
    assert seen_meta == {"target": [t for t in targets for _ in range(G)]}
    hand_texts = [decode_by_hand(tokenizer, exp.response_ids[b].tolist()) for b in range(B)]
    assert seen_responses == hand_texts == exp.responses
    hand_scores = [sum(c.isdigit() for c in r) + 10 * int(t[0]) for r, t in zip(hand_texts, seen_meta["target"])]
    assert exp.scores.tolist() == pytest.approx(hand_scores)

    # old log-probs = a fresh, unpadded forward of each sampled sequence
    for b in range(B):
        prompt = exp.prompt_ids[b][exp.prompt_mask[b].bool()].tolist()
        L = int(exp.response_mask[b].sum())
        response = exp.response_ids[b, :L].tolist()
        expected = plain_response_logprobs(tiny_policy, prompt, response).float()
        torch.testing.assert_close(exp.old_logprobs[b, :L], expected, atol=1e-5, rtol=0)
        # the reference is an identical frozen copy: same log-probs, zero KL
        torch.testing.assert_close(exp.ref_logprobs[b, :L], expected, atol=1e-5, rtol=0)
    assert exp.kl[exp.response_mask].abs().max() < 1e-6
    assert timings.generate_s > 0


def test_collect_experience_truncation_handling(tiny_policy, tokenizer):
    algo = AlgorithmConfig(name="grpo", group_size=4, truncated_score=-3.0, mask_truncated=True, kl_coef=0.0)
    ac = ActorCritic(tiny_policy, value_head=False).eval()
    torch.manual_seed(1)
    exp, _ = collect_experience(
        prompt_batch(tokenizer, ["31>", "98765>"]),
        ac,
        None,
        None,
        RewardComposer([lambda p, r: [1.0] * len(p)]),
        tokenizer,
        algo,
        SamplingConfig(max_new_tokens=4),
    )
    assert exp.ref_logprobs is None and exp.kl is None  # no reference when kl_coef = 0
    assert exp.truncated.any() and not exp.truncated.all()  # the seed gives both kinds
    for b in range(exp.batch_size):
        has_eos = EOS_ID in exp.response_ids[b].tolist()
        assert bool(exp.truncated[b]) is (not has_eos)
        assert exp.scores[b].item() == (-3.0 if not has_eos else 1.0)
        if has_eos:
            assert torch.equal(exp.loss_mask[b], exp.response_mask[b])
        else:
            assert not exp.loss_mask[b].any()


# ----------------------------------------------------------------------------- reward function errors

PROMPTS, RESPONSES = ["1>", "2>", "3>"], ["1", "x", "3"]


def exploding_reward(prompts, responses, **meta):
    raise ValueError("boom")


def short_reward(prompts, responses, **meta):
    return [1.0] * (len(prompts) - 1)


def nan_reward(prompts, responses, **meta):
    return [1.0, float("nan"), 3.0]


def inf_reward(prompts, responses, **meta):
    return [1.0, float("inf"), float("nan")]


def test_reward_fn_that_raises_is_named():
    with pytest.raises(RewardError, match="exploding_reward") as info:
        call_reward_fn(exploding_reward, PROMPTS, RESPONSES, {})
    assert "boom" in str(info.value) and "ValueError" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_reward_fn_wrong_length_is_named():
    with pytest.raises(RewardError, match="short_reward.*\\(3,\\)"):
        call_reward_fn(short_reward, PROMPTS, RESPONSES, {})


def test_reward_fn_returning_non_numbers_is_named():
    with pytest.raises(RewardError, match="text_reward"):

        def text_reward(prompts, responses):
            return ["good"] * len(prompts)

        call_reward_fn(text_reward, PROMPTS, RESPONSES, {})


def test_reward_fn_nan_is_an_error_unless_nan_score():
    with pytest.raises(RewardError, match="nan_reward.*'2>'.*'x'"):
        call_reward_fn(nan_reward, PROMPTS, RESPONSES, {})
    scores = call_reward_fn(nan_reward, PROMPTS, RESPONSES, {}, nan_score=-5.0)
    assert scores.tolist() == [1.0, -5.0, 3.0]
    # nan_score replaces NaN only; an infinite score is still an error
    with pytest.raises(RewardError, match="inf_reward"):
        call_reward_fn(inf_reward, PROMPTS, RESPONSES, {}, nan_score=-5.0)


def test_reward_composer_weights_and_nan_score():
    composer = RewardComposer([nan_reward, lambda p, r: [10.0, 20.0, 30.0]], weights=[2.0, 0.5], nan_score=0.0)
    assert composer(PROMPTS, RESPONSES, {}).tolist() == [2.0 + 5.0, 0.0 + 10.0, 6.0 + 15.0]


def test_reward_error_propagates_from_collect_experience(tiny_policy, tokenizer):
    ac = ActorCritic(tiny_policy, value_head=False).eval()
    with pytest.raises(RewardError, match="exploding_reward"):
        collect_experience(
            prompt_batch(tokenizer, ["31>"]),
            ac,
            None,
            None,
            RewardComposer([exploding_reward]),
            tokenizer,
            AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.0),
            SamplingConfig(max_new_tokens=2),
        )
