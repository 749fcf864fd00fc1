"""GSPO ratios, REINFORCE++ advantages, DAPO over-long shaping and entropy token selection.

Expected values come from hand-derived numbers, slow Python loops over ragged per-row lists, or known properties
(GSPO's sequence and sequence-token gradients agree when unclipped). Padded positions hold garbage, so a leak
through a mask would show. B = 3 rows of lengths 4, 2, 3 on a T = 4 grid.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

from conftest import forward_from_logits
from lit_rlhf.algorithms import losses as L
from lit_rlhf.algorithms.experience import PolicyForward, compute_advantages, make_experience, shaping_metrics
from lit_rlhf.algorithms.objective import MinibatchTotals, ppo_objective
from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.types import Experience, Rollout

LENGTHS = (4, 2, 3)
B, T, V = 3, 4, 5
OLD = [[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.5], [-0.8, -2.2, -0.1]]
LOG_RATIO = [[0.002, -0.001, 0.0005, 0.0], [0.3, 0.1], [0.00005, -0.0002, 0.00012]]
NEW = [[o + d for o, d in zip(ro, rd)] for ro, rd in zip(OLD, LOG_RATIO)]
SEQ_ADV = [1.5, -0.7, 0.4]  # one advantage per sequence, as the group estimators give


def grid(rows: list[list[float]], pad: float) -> torch.Tensor:
    out = torch.full((B, T), pad, dtype=torch.float64)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out


MASK = grid([[1.0] * n for n in LENGTHS], 0.0).bool()


def experience(loss_mask: torch.Tensor = MASK, advantages: torch.Tensor | None = None) -> Experience:
    adv = grid([[a] * n for a, n in zip(SEQ_ADV, LENGTHS)], 99.0) if advantages is None else advantages
    return Experience(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=torch.zeros(B, T, dtype=torch.long),
        response_mask=MASK,
        truncated=torch.zeros(B, dtype=torch.bool),
        scores=torch.zeros(B),
        loss_mask=loss_mask,
        old_logprobs=grid(OLD, -7.0),
        advantages=adv,
    )


def algo(**overrides) -> AlgorithmConfig:
    settings = dict(name="grpo", kl_coef=0.0, clip_eps_low=3e-4, clip_eps_high=4e-4)
    return AlgorithmConfig(**{**settings, **overrides})


def forward(new=NEW) -> PolicyForward:
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return forward_from_logits(logits, torch.zeros(B, T, dtype=torch.long), grid(new, 4.0).requires_grad_(True))


# ----------------------------------------------------------------------------- GSPO


def test_sequence_log_ratio_is_the_mean_over_valid_tokens():
    new, old = grid(NEW, 4.0), grid(OLD, -7.0)
    seq = L.policy_log_ratio(new, old, MASK, "sequence")
    for b, row in enumerate(LOG_RATIO):
        expected = sum(row) / len(row)
        assert seq[b].tolist() == pytest.approx([expected] * T, abs=1e-12)  # padding too: it is masked later
    torch.testing.assert_close(L.policy_log_ratio(new, old, MASK, "token"), new - old)
    empty = L.policy_log_ratio(new, old, torch.zeros_like(MASK), "sequence")
    assert empty.abs().max() == 0  # a row without valid tokens: s = 1
    with pytest.raises(ValueError, match="ratio level"):
        L.policy_log_ratio(new, old, MASK, "group")


def test_sequence_token_ratio_has_the_sequence_value_and_per_token_gradient():
    new = grid(NEW, 4.0).requires_grad_(True)
    log_ratio = L.policy_log_ratio(new, grid(OLD, -7.0), MASK, "sequence_token")
    torch.testing.assert_close(log_ratio, L.policy_log_ratio(new, grid(OLD, -7.0), MASK, "sequence").detach())
    weights = torch.arange(1.0, B * T + 1, dtype=torch.float64).view(B, T)
    (log_ratio.exp() * weights * MASK).sum().backward()
    # d/d logp_t of sg[s] * exp(logp_t - sg[logp_t]) is s: each token's own gradient, scaled by the sequence ratio
    for b, row in enumerate(LOG_RATIO):
        s = math.exp(sum(row) / len(row))
        for t in range(T):
            expected = s * weights[b, t].item() if t < len(row) else 0.0
            assert new.grad[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def hand_gspo_loss(eps_low: float, eps_high: float) -> float:
    """GSPO's objective (eq. 5) negated: mean over sequences of max(-A s, -A clip(s, 1-eps_low, 1+eps_high))."""
    per_seq = []
    for row, a in zip(LOG_RATIO, SEQ_ADV):
        s = math.exp(sum(row) / len(row))
        per_seq.append(max(-a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high)))
    return sum(per_seq) / len(per_seq)


def test_gspo_loss_with_sequence_clipping_matches_hand_formula():
    cfg = algo(ratio_level="sequence", loss_aggregation="seq_mean_token_mean")
    current = forward()
    loss, stats = ppo_objective(current, experience(), cfg, MinibatchTotals.of(experience(), 8))
    assert float(loss.detach()) == pytest.approx(hand_gspo_loss(3e-4, 4e-4), rel=1e-9)
    # row 0: s = e^0.000375 < 1 + 4e-4 with A > 0; row 1: s = e^0.2 with A < 0 (the max takes -A s); row 2:
    # s = e^-0.00001 > 1 - 3e-4: none is clipped. With clip_eps_high = 1e-4 row 0 is.
    assert stats["policy/clipfrac"] == 0.0
    loss.backward()
    # the clipped branch of a sequence stops the gradient of all its tokens
    cfg_tight = algo(ratio_level="sequence", loss_aggregation="seq_mean_token_mean", clip_eps_high=1e-4)
    current_tight = forward()
    loss_t, stats_t = ppo_objective(current_tight, experience(), cfg_tight, MinibatchTotals.of(experience(), 8))
    assert float(loss_t.detach()) == pytest.approx(hand_gspo_loss(3e-4, 1e-4), rel=1e-9)
    loss_t.backward()
    assert current_tight.logprobs.grad[0].abs().max() == 0  # row 0: s = 1.000375 > 1 + 1e-4 with A > 0
    assert current_tight.logprobs.grad[2].abs().max() > 0
    assert stats_t["policy/clipfrac"] == pytest.approx(4 / 9)  # row 0's 4 of the 9 valid tokens


def test_gspo_and_gspo_token_gradients_agree_with_sequence_advantages():
    """GSPO paper, sec. 4.3: with one advantage per sequence, GSPO-token's gradient equals GSPO's."""
    grads = {}
    for level in ("sequence", "sequence_token"):
        cfg = algo(ratio_level=level, loss_aggregation="seq_mean_token_mean", clip_eps_low=1.0, clip_eps_high=1.0)
        current = forward()
        loss, _ = ppo_objective(current, experience(), cfg, MinibatchTotals.of(experience(), 8))
        loss.backward()
        grads[level] = current.logprobs.grad
    torch.testing.assert_close(grads["sequence"], grads["sequence_token"], rtol=1e-12, atol=1e-15)
    # and it is -A s / |y_i| / B on every valid token of row i (independent derivation)
    for b, (row, a) in enumerate(zip(LOG_RATIO, SEQ_ADV)):
        s = math.exp(sum(row) / len(row))
        assert grads["sequence"][b, : len(row)].tolist() == pytest.approx([-a * s / len(row) / B] * len(row))
    assert grads["sequence"][~MASK].abs().max() == 0


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_give_the_minibatch_gradient(level, aggregation):
    cfg = algo(ratio_level=level, loss_aggregation=aggregation, clip_eps_high=1e-4)
    exp = experience()
    whole = forward()
    loss, _ = ppo_objective(whole, exp, cfg, MinibatchTotals.of(exp, 6))
    loss.backward()
    pieces = forward()
    totals = MinibatchTotals.of(exp, 6)
    for rows in ([0, 2], [1]):
        idx = torch.tensor(rows)
        piece = dataclasses.replace(pieces, logprobs=pieces.logprobs[idx], entropy=pieces.entropy[idx])
        ppo_objective(piece, exp.select(idx), cfg, totals)[0].backward()
    torch.testing.assert_close(pieces.logprobs.grad, whole.logprobs.grad, rtol=1e-12, atol=1e-15)
    assert whole.logprobs.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- REINFORCE++


def slow_returns(rewards: list[float], gamma: float) -> list[float]:
    return [sum(gamma**k * r for k, r in enumerate(rewards[t:])) for t in range(len(rewards))]


def slow_whiten(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def test_discounted_returns_match_a_loop():
    rewards = [[0.5, -1.0, 2.0, 0.25], [1.0, 3.0], [-0.5, 0.0, 4.0]]
    out = L.discounted_returns(grid(rewards, 1e4), MASK, 0.9)
    for b, row in enumerate(rewards):
        assert out[b, : len(row)].tolist() == pytest.approx(slow_returns(row, 0.9), rel=1e-6)
        assert out[b, len(row) :].abs().sum() == 0


def test_reinforce_pp_hand_example_with_k1_kl_in_the_reward():
    scores, beta = torch.tensor([1.0, 0.0, 2.0]), 0.1
    kl = [[0.2, -0.1, 0.05, 0.3], [0.4, 0.1], [0.0, -0.2, 0.6]]
    cfg = algo(advantage_estimator="reinforce_pp", group_size=1, kl_coef=beta, kl_estimator="k1", kl_in_reward=True)
    adv, returns = compute_advantages(cfg, scores, grid(kl, 1e4), None, MASK)
    assert returns is None
    token_rewards = [[-beta * k for k in row] for row in kl]
    for b, row in enumerate(token_rewards):
        row[-1] += float(scores[b])
    expected = slow_whiten([slow_returns(row, 1.0) for row in token_rewards])
    for b, row in enumerate(expected):
        assert adv[b, : len(row)].tolist() == pytest.approx(row, rel=1e-5)
        assert adv[b, len(row) :].abs().sum() == 0


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_batch_whitening():
    mask = torch.ones(4, 2, dtype=torch.bool)
    scores = torch.tensor([1.0, 3.0, 0.5, 0.5])  # group 1 is tied: its centred scores are exactly 0
    cfg = algo(advantage_estimator="reinforce_pp_baseline", group_size=2)
    adv, _ = compute_advantages(cfg, scores, None, None, mask)
    centred = [-1.0, 1.0, 0.0, 0.0]  # every token of a row has the return = the row's centred score (gamma 1)
    expected = slow_whiten([[c, c] for c in centred])
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    # plain REINFORCE++ on the same scores differs: it whitens the raw scores
    plain, _ = compute_advantages(algo(advantage_estimator="reinforce_pp", group_size=2), scores, None, None, mask)
    expected_plain = slow_whiten([[s, s] for s in scores.tolist()])
    torch.testing.assert_close(plain, torch.tensor(expected_plain, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_reinforce_pp_all_equal_returns_give_no_signal():
    adv, _ = compute_advantages(algo(advantage_estimator="reinforce_pp", group_size=1), torch.ones(3), None, None, MASK)
    assert adv.abs().max() < 1e-3


# ----------------------------------------------------------------------------- DAPO over-long shaping


def test_overlong_penalty_hand_numbers():
    lengths = torch.arange(0, 10)
    out = L.overlong_penalty(lengths, max_len=8, buffer=4, penalty=0.5)
    expected = [0, 0, 0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5]
    assert out.tolist() == pytest.approx(expected)
    assert L.overlong_penalty(torch.tensor([7, 8]), 8, 1, 1.0).tolist() == [0.0, -1.0]  # buffer 1: a step at L_max


def test_overlong_shaping_in_the_single_turn_collector(tokenizer, tiny_policy):
    from conftest import prompt_batch
    from lit_rlhf.rollout.backends.lean import LeanBackend
    from lit_rlhf.rollout.collect import RolloutSettings, SingleTurnCollector

    def score(texts, responses, meta, generation):
        return torch.full((len(texts),), 2.0)

    sampling = SamplingConfig(max_new_tokens=6)
    prompts = prompt_batch(tokenizer, ["3 1 2", "9 8"])
    torch.manual_seed(5)
    backend = LeanBackend(tiny_policy, tokenizer.eos_token_id, tokenizer.pad_token_id)
    collector = SingleTurnCollector(backend, tokenizer, score, RolloutSettings(4, sampling, overlong=(3, 1.0)))
    shaped, _ = collector.collect(prompts)
    lengths = shaped.response_mask.sum(1).tolist()
    expected = [2.0 - min(max((n - 3) / 3, 0.0), 1.0) for n in lengths]
    assert shaped.scores.tolist() == pytest.approx(expected)
    assert len(set(lengths)) > 1 and min(expected) < 2.0  # the sample covers shaped and unshaped lengths


def test_shaping_metrics_report_the_mean_penalty_and_selected_share():
    exp = experience()
    cfg = algo(overlong_buffer=2, overlong_penalty=1.0)
    # lengths 4, 2, 3 past 4 - 2 tokens: -1, 0, -0.5
    assert shaping_metrics(exp, cfg, max_new_tokens=4) == {"rollout/overlong_penalty_mean": pytest.approx(-0.5)}
    assert shaping_metrics(exp, algo(), 4) == {}


# ----------------------------------------------------------------------------- entropy token selection


def test_top_entropy_mask_hand_example_with_ties_and_padding():
    entropy = grid([[0.1, 0.9, 0.5, 0.2], [0.5, 0.3], [0.05, 0.7, 0.6]], 50.0)  # padding: huge, never chosen
    out = L.top_entropy_mask(entropy, MASK, 0.3)  # ceil(0.3 * 9) = 3 -> 0.9, 0.7, 0.6
    assert out.tolist() == grid([[0, 1, 0, 0], [0, 0], [0, 1, 1]], 0.0).bool().tolist()
    tied = L.top_entropy_mask(entropy, MASK, 0.4)  # ceil(3.6) = 4 -> threshold 0.5, held by two tokens: 5 kept
    assert tied.tolist() == grid([[0, 1, 1, 0], [1, 0], [0, 1, 1]], 0.0).bool().tolist()
    assert L.top_entropy_mask(entropy, MASK, 1.0).tolist() == MASK.tolist()
    assert not L.top_entropy_mask(entropy, torch.zeros_like(MASK), 0.5).any()


def rollout_for_entropy() -> tuple[Rollout, PolicyForward, torch.Tensor]:
    rollout = Rollout(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=torch.tensor([[2, 4, 1, 3], [0, 3, 0, 0], [4, 1, 2, 0]]),
        response_mask=MASK,
        truncated=torch.tensor([False, False, True]),
        scores=torch.tensor([1.0, 0.0, 0.5]),
    )
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(7)) * 3
    return rollout, forward_from_logits(logits, rollout.response_ids, temperature=2.0), logits


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_make_experience_keeps_the_top_entropy_tokens_of_the_rollout(mask_truncated):
    rollout, policy, logits = rollout_for_entropy()  # the forward's entropy at temperature 2
    cfg = algo(name="grpo", group_size=3, entropy_top_fraction=0.5, mask_truncated=mask_truncated)
    exp = make_experience(rollout, cfg, policy, None)
    candidates = [(b, t) for b, n in enumerate(LENGTHS) for t in range(n) if not (mask_truncated and b == 2)]

    def entropy(b: int, t: int) -> float:
        p = torch.softmax(logits[b, t].double() / 2.0, -1).tolist()
        return -sum(q * math.log(q) for q in p)

    ranked = sorted(candidates, key=lambda bt: -entropy(*bt))
    keep = set(ranked[: math.ceil(0.5 * len(candidates))])
    expected = [[(b, t) in keep for t in range(T)] for b in range(B)]
    assert exp.loss_mask.tolist() == expected
    assert torch.equal(exp.response_mask, MASK)  # advantages and metrics still see every token
    frac = shaping_metrics(exp, cfg, 4)["policy/entropy_selected_frac"]
    assert frac == pytest.approx(len(keep) / len(candidates))


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(ratio_level="seq"), "algorithm.ratio_level"),
        (dict(overlong_buffer=0), "algorithm.overlong_buffer"),
        (dict(overlong_buffer=2.5), "algorithm.overlong_buffer"),
        (dict(overlong_penalty=0.0), "algorithm.overlong_penalty"),
        (dict(entropy_top_fraction=0.0), "algorithm.entropy_top_fraction"),
        (dict(entropy_top_fraction=1.2), "algorithm.entropy_top_fraction"),
        (dict(advantage_estimator="reinforce_pp_baseline", group_size=1), "algorithm.group_size"),
        (dict(advantage_estimator="reinforce", group_size=2), "algorithm.advantage_estimator"),
    ],
)
def test_bad_new_settings_name_their_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        AlgorithmConfig(**overrides)


def test_plain_reinforce_pp_runs_with_one_response_per_prompt_and_no_critic():
    cfg = AlgorithmConfig(name="grpo", advantage_estimator="reinforce_pp", group_size=1)
    assert not cfg.uses_critic


def test_overlong_buffer_must_fit_in_max_new_tokens():
    cfg = AlgorithmConfig(overlong_buffer=9)
    with pytest.raises(ConfigError, match=r"algorithm\.overlong_buffer: 9 tokens is more than sampling\.max_new"):
        cfg.check_sampling(SamplingConfig(max_new_tokens=8))
    cfg.check_sampling(SamplingConfig(max_new_tokens=9))
