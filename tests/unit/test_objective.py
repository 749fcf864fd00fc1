"""Tests for lit_rlhf.algorithms.objective.ppo_objective as a pure function on hand-built tensors.

Every expected value is computed independently with slow Python loops and the `math` module over ragged
per-row lists of the valid tokens. B = 3 rows of response lengths 4, 2, 3 on a T = 4 grid with V = 5; the
padded positions of every (B, T) tensor hold garbage, so a leak through the loss mask would show.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import forward_from_logits
from lit_rlhf.algorithms.experience import PolicyForward
from lit_rlhf.algorithms.objective import MinibatchTotals, ppo_objective
from lit_rlhf.config import AlgorithmConfig
from lit_rlhf.types import Experience

LENGTHS = (4, 2, 3)
B, T, V = 3, 4, 5
MAX_NEW = 6  # max_new_tokens, deliberately not T
EPS_LOW, EPS_HIGH = 0.2, 0.28
# Valid tokens only. Row 0 clips r = e^0.5 > 1.28 (A > 0) and r = e^-0.4 < 0.8 (A < 0), row 2 clips
# r = e^0.25 = 1.284 (A > 0) and e^-0.3 (A < 0); row 1 leaves both ratios unclipped (advantage of the other sign).
OLD = [[-1.0, -0.5, -2.0, -1.2], [-0.3, -1.5], [-0.8, -2.2, -0.1]]
LOG_RATIO = [[0.5, -0.4, 0.1, -0.05], [0.3, -0.6], [0.0, 0.25, -0.3]]
NEW = [[o + d for o, d in zip(ro, rd)] for ro, rd in zip(OLD, LOG_RATIO)]
ADV = [[1.0, -0.5, 2.0, -1.0], [-1.5, 0.7], [0.3, 1.2, -0.8]]
REF = [[-1.3, -0.2, -1.9, -2.0], [-0.1, -1.0], [-1.5, -2.0, -0.4]]
VALUES = [[0.5, 1.0, -0.3, 0.2], [0.9, -0.6], [0.0, 0.45, 1.1]]
OLD_VALUES = [[0.2, 1.1, 0.1, 0.2], [0.5, -0.1], [0.3, 0.4, 0.5]]
RETURNS = [[1.0, 0.2, 0.4, -0.5], [0.3, 0.6], [-0.2, 1.5, 0.9]]
RESPONSE_IDS = torch.tensor([[2, 4, 1, 3], [0, 3, 0, 0], [4, 1, 2, 0]])
LOGITS = torch.randn(B, T, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
REF_LOGITS = torch.randn(B, T, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def grid(rows: list[list[float]], pad: float) -> torch.Tensor:
    """(B, T) float64 holding the ragged `rows` left-aligned and `pad` (garbage) elsewhere."""
    out = torch.full((B, T), pad, dtype=torch.float64)
    for b, row in enumerate(rows):
        for t, x in enumerate(row):
            out[b, t] = x
    return out


def ragged(x: torch.Tensor) -> list[list[float]]:
    """The valid tokens of a (B, T) tensor, row by row."""
    return [x[b, :n].tolist() for b, n in enumerate(LENGTHS)]


def experience(old: list[list[float]] = OLD) -> Experience:
    mask = grid([[1.0] * n for n in LENGTHS], 0.0).bool()
    return Experience(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=RESPONSE_IDS,
        response_mask=mask,
        truncated=torch.zeros(B, dtype=torch.bool),
        scores=torch.zeros(B),
        loss_mask=mask,
        old_logprobs=grid(old, -5.0),
        advantages=grid(ADV, 100.0),
        ref_logprobs=grid(REF, 3.0),
        values=grid(OLD_VALUES, 50.0),
        returns=grid(RETURNS, -50.0),
    )


def algo(**overrides) -> AlgorithmConfig:
    settings = dict(name="grpo", kl_coef=0.0, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    return AlgorithmConfig(**{**settings, **overrides})


def policy(logits, values, logprobs, temperature=1.0, ref_logits=None, rows=slice(None)) -> PolicyForward:
    """The forward `ppo_objective` reads: its entropy (and with `ref_logits` the exact KL) from `logits` (b, T, V)
    at the temperature (the rows `rows` of the grid)."""
    return forward_from_logits(logits, RESPONSE_IDS[rows], logprobs, values, temperature, ref_logits)


def run(current: PolicyForward, cfg: AlgorithmConfig, exp: Experience | None = None):
    exp = experience() if exp is None else exp
    return ppo_objective(current, exp, cfg, MinibatchTotals.of(exp, MAX_NEW))


def sampled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at RESPONSE_IDS: log-probs consistent with the logits."""
    return torch.log_softmax(logits / temperature, -1).gather(-1, RESPONSE_IDS[..., None]).squeeze(-1)


def hand_log_softmax(logits: list[float], temperature: float) -> list[float]:
    z = [x / temperature for x in logits]
    top = max(z)
    lse = top + math.log(sum(math.exp(x - top) for x in z))
    return [x - lse for x in z]


def hand_policy(new, old=OLD) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token PPO loss max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) and 1.0 where the clipped one is larger."""
    loss, clipped = [], []
    for n_row, o_row, a_row in zip(new, old, ADV):
        loss_row, clipped_row = [], []
        for n, o, a in zip(n_row, o_row, a_row):
            r = math.exp(n - o)
            unclipped, clipped_term = -a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            loss_row.append(max(unclipped, clipped_term))
            clipped_row.append(1.0 if clipped_term > unclipped else 0.0)
        loss.append(loss_row)
        clipped.append(clipped_row)
    return loss, clipped


def token_mean(rows: list[list[float]]) -> float:
    return sum(sum(row) for row in rows) / sum(len(row) for row in rows)


def per_token(fn, *rows):
    """fn applied token by token over ragged rows of equal shape."""
    return [[fn(*xs) for xs in zip(*row)] for row in zip(*rows)]


def test_token_mean_clipped_policy_loss_and_stats():
    loss, stats = run(policy(LOGITS, None, grid(NEW, 5.0)), algo())
    per_loss, clipped = hand_policy(NEW)
    assert float(loss) == pytest.approx(token_mean(per_loss), rel=1e-12)
    assert stats["policy/loss"] == pytest.approx(token_mean(per_loss), rel=1e-12)
    assert token_mean(clipped) == pytest.approx(4 / 9)  # the four tokens named above OLD
    assert stats["policy/clipfrac"] == pytest.approx(token_mean(clipped), rel=1e-6)
    assert stats["policy/approx_kl"] == pytest.approx(token_mean(per_token(lambda d: 0.5 * d * d, LOG_RATIO)))
    assert stats["policy/ratio_mean"] == pytest.approx(token_mean(per_token(math.exp, LOG_RATIO)), rel=1e-6)
    assert "value/loss" not in stats and "policy/kl_loss" not in stats


def test_clipped_value_loss_weighted_by_vf_coef():
    cfg = algo(name="ppo", value_clip=0.2, vf_coef=0.5)
    loss, stats = run(policy(LOGITS, grid(VALUES, -50.0), grid(NEW, 5.0)), cfg)

    def value_loss(v, v_old, ret):
        v_clipped = v_old + min(max(v - v_old, -0.2), 0.2)
        return 0.5 * max((v - ret) ** 2, (v_clipped - ret) ** 2), float((v_clipped - ret) ** 2 > (v - ret) ** 2)

    per_value = per_token(value_loss, VALUES, OLD_VALUES, RETURNS)
    expected_value = token_mean([[lv for lv, _ in row] for row in per_value])
    value_clipfrac = token_mean([[c for _, c in row] for row in per_value])
    assert 0 < value_clipfrac < 1
    assert stats["value/loss"] == pytest.approx(expected_value, rel=1e-12)
    assert stats["value/clipfrac"] == pytest.approx(value_clipfrac, rel=1e-6)
    assert float(loss) == pytest.approx(token_mean(hand_policy(NEW)[0]) + 0.5 * expected_value, rel=1e-12)


def test_k3_kl_in_the_loss():
    cfg = algo(kl_coef=0.04, kl_estimator="k3", kl_in_reward=False)
    loss, stats = run(policy(LOGITS, None, grid(NEW, 5.0)), cfg)
    expected_kl = token_mean(per_token(lambda n, ref: math.exp(ref - n) - (ref - n) - 1, NEW, REF))
    assert stats["policy/kl_loss"] == pytest.approx(expected_kl, rel=1e-10)
    assert float(loss) == pytest.approx(token_mean(hand_policy(NEW)[0]) + 0.04 * expected_kl, rel=1e-12)


def test_full_kl_in_the_loss_from_logits():
    cfg = algo(kl_coef=0.04, kl_estimator="full", kl_in_reward=False)
    new = sampled_logprobs(LOGITS, 1.0)
    loss, stats = run(policy(LOGITS, None, new, ref_logits=REF_LOGITS), cfg)
    kl = []
    for b, n in enumerate(LENGTHS):
        kl.append([])
        for t in range(n):
            logp = hand_log_softmax(LOGITS[b, t].tolist(), 1.0)
            logq = hand_log_softmax(REF_LOGITS[b, t].tolist(), 1.0)
            kl[-1].append(sum(math.exp(p) * (p - q) for p, q in zip(logp, logq)))
    assert stats["policy/kl_loss"] == pytest.approx(token_mean(kl), rel=1e-6)
    assert float(loss) == pytest.approx(token_mean(hand_policy(ragged(new))[0]) + 0.04 * token_mean(kl), rel=1e-6)
    with pytest.raises(ValueError, match="the exact KL needs a policy forward given the reference's"):
        run(policy(LOGITS, None, new), cfg)


def test_entropy_bonus_at_the_sampling_temperature():
    new = sampled_logprobs(LOGITS, 0.7)
    old = per_token(lambda n, d: n - d, ragged(new), LOG_RATIO)
    loss, stats = run(policy(LOGITS, None, new, 0.7), algo(entropy_coef=0.01), experience(old))
    entropy = []
    for b, n in enumerate(LENGTHS):
        logps = [hand_log_softmax(LOGITS[b, t].tolist(), 0.7) for t in range(n)]
        entropy.append([-sum(math.exp(lp) * lp for lp in logp) for logp in logps])
    assert stats["objective/entropy"] == pytest.approx(token_mean(entropy), rel=1e-6)
    expected = token_mean(hand_policy(ragged(new), old)[0]) - 0.01 * token_mean(entropy)
    assert float(loss) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "aggregation, reduce",
    [
        ("seq_mean_token_mean", lambda rows: sum(sum(row) / len(row) for row in rows) / len(rows)),
        ("seq_mean_token_sum_norm", lambda rows: sum(sum(row) for row in rows) / (MAX_NEW * len(rows))),
    ],
)
def test_sequence_aggregations(aggregation, reduce):
    loss, stats = run(policy(LOGITS, None, grid(NEW, 5.0)), algo(loss_aggregation=aggregation))
    assert float(loss) == pytest.approx(reduce(hand_policy(NEW)[0]), rel=1e-12)
    # the token-share statistics stay token means whatever the loss aggregation
    assert stats["policy/clipfrac"] == pytest.approx(4 / 9, rel=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_add_up_to_the_minibatch(aggregation):
    cfg = algo(
        name="ppo", kl_coef=0.05, kl_estimator="k3", kl_in_reward=False, entropy_coef=0.01, loss_aggregation=aggregation
    )
    whole_exp, current = experience(), policy(LOGITS, grid(VALUES, -50.0), grid(NEW, 5.0))
    whole_loss, whole_stats = run(current, cfg)
    totals = MinibatchTotals.of(whole_exp, MAX_NEW)
    shared, own = [], []
    for rows in ([0], [1, 2]):
        idx = torch.tensor(rows)
        piece = whole_exp.select(idx)
        piece_current = policy(LOGITS[idx], current.values[idx], current.logprobs[idx], rows=idx)
        shared.append(ppo_objective(piece_current, piece, cfg, totals))
        own.append(ppo_objective(piece_current, piece, cfg, MinibatchTotals.of(piece, MAX_NEW)))
    assert sum(float(loss) for loss, _ in shared) == pytest.approx(float(whole_loss), rel=1e-6)
    assert set(shared[0][1]) == set(whole_stats)
    for key, value in whole_stats.items():
        assert sum(stats[key] for _, stats in shared) == pytest.approx(value, rel=1e-5, abs=1e-7), key
    # control: normalised by each piece's own totals, the pieces do not add up
    assert abs(sum(float(loss) for loss, _ in own) - float(whole_loss)) > 1e-3
    assert abs(sum(stats["policy/clipfrac"] for _, stats in own) - whole_stats["policy/clipfrac"]) > 1e-3


def test_gradient_at_ratio_one_is_minus_advantage_over_tokens():
    logprobs = grid(OLD, -5.0).requires_grad_(True)  # current == old everywhere, padding included
    loss, stats = run(policy(LOGITS, None, logprobs), algo())
    loss.backward()
    assert stats["policy/clipfrac"] == 0.0
    expected = grid([[-a / 9 for a in row] for row in ADV], 0.0)  # 9 valid tokens, none through padding
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-12)
