"""Tests for lit_rlhf.losses.

Every expected value here is computed independently of the code under test: a number derived by hand in
the comment next to it, a slow reference written with Python loops and the `math` module, or a known
mathematical property. Per-token tests use a right-padded (B, T) response grid with False mask positions,
usually including an all-False row, and put garbage values into padded positions so that a leak would show.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.algorithms import losses as L

HYP = settings(max_examples=50, deadline=None)


# ----------------------------------------------------------------------------- helpers


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    """(B, T) bool mask, row b True on its first lengths[b] positions; built with loops."""
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            mask[b, t] = True
    return mask


def with_garbage(x: torch.Tensor, mask: torch.Tensor, value: float = 1.0e4) -> torch.Tensor:
    """A copy of `x` holding `value` on every masked-out position."""
    x = x.clone()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not mask[b, t]:
                x[b, t] = value
    return x


def assert_close(actual: torch.Tensor, expected, atol: float) -> None:
    """Elementwise |actual - expected| <= atol, expected given as (nested) Python numbers."""
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# A padded grid shared by several tests: 4 sequences, T = 5, lengths 5, 3, 0 (all-False row), 1.
LENGTHS = [5, 3, 0, 1]
T_GRID = 5


# ----------------------------------------------------------------------------- masked statistics


def test_masked_mean_var_hand_numbers():
    # valid values 1, 2, 3 (the 100 is padding): mean 2, unbiased var (1+0+1)/2 = 1, biased var 2/3
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    assert L.masked_mean(x, mask).item() == pytest.approx(2.0)
    assert L.masked_var(x, mask).item() == pytest.approx(1.0)
    assert L.masked_var(x, mask, unbiased=False).item() == pytest.approx(2.0 / 3.0)
    assert L.masked_sum(x, mask).item() == pytest.approx(6.0)


def test_masked_mean_and_var_match_loops_with_padding():
    mask = right_padded_mask(LENGTHS, T_GRID)
    x = with_garbage(torch.randn(4, T_GRID, generator=gen(0)), mask)
    vals = [x[b, t].item() for b in range(4) for t in range(T_GRID) if mask[b, t]]
    n = len(vals)
    mean = sum(vals) / n
    var_unbiased = sum((v - mean) ** 2 for v in vals) / (n - 1)
    var_biased = sum((v - mean) ** 2 for v in vals) / n
    assert L.masked_mean(x, mask).item() == pytest.approx(mean, rel=1e-5, abs=1e-6)
    assert L.masked_var(x, mask).item() == pytest.approx(var_unbiased, rel=1e-5)
    assert L.masked_var(x, mask, unbiased=False).item() == pytest.approx(var_biased, rel=1e-5)

    # per-row mean (dim=1): the all-False row gives 0, never NaN
    row_means = L.masked_mean(x, mask, dim=1)
    for b in range(4):
        row = [x[b, t].item() for t in range(T_GRID) if mask[b, t]]
        expected = sum(row) / len(row) if row else 0.0
        assert row_means[b].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)

    # per-column mean (dim=0)
    col_means = L.masked_mean(x, mask, dim=0)
    for t in range(T_GRID):
        col = [x[b, t].item() for b in range(4) if mask[b, t]]
        expected = sum(col) / len(col) if col else 0.0
        assert col_means[t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_masked_stats_empty_mask_and_nan_padding():
    x = torch.randn(3, 4, generator=gen(1))
    empty = torch.zeros(3, 4, dtype=torch.bool)
    for value in (L.masked_mean(x, empty), L.masked_var(x, empty), L.masked_var(x, empty, unbiased=False)):
        assert torch.isfinite(value) and value.item() == 0.0
    assert torch.equal(L.masked_whiten(x, empty), torch.zeros_like(x))
    # a single valid element: unbiased variance is defined as 0 here, not NaN
    one = torch.zeros(3, 4, dtype=torch.bool)
    one[1, 2] = True
    assert torch.isfinite(L.masked_var(x, one))
    assert torch.isfinite(L.masked_whiten(x, one)).all()
    # NaN / inf in padded positions must not reach the statistics
    mask = right_padded_mask([4, 2, 0], 4)
    y = with_garbage(x, mask, float("nan"))
    y[2, 3] = float("inf")
    vals = [x[b, t].item() for b in range(3) for t in range(4) if mask[b, t]]
    assert L.masked_mean(y, mask).item() == pytest.approx(sum(vals) / len(vals), rel=1e-5)
    assert torch.isfinite(L.masked_var(y, mask))
    w = L.masked_whiten(y, mask)
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop(shift_mean):
    mask = right_padded_mask(LENGTHS, T_GRID)
    x = with_garbage(3.0 + 2.0 * torch.randn(4, T_GRID, generator=gen(2)), mask)
    vals = [x[b, t].item() for b in range(4) for t in range(T_GRID) if mask[b, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    out = L.masked_whiten(x, mask, shift_mean=shift_mean)
    for b in range(4):
        for t in range(T_GRID):
            if mask[b, t]:
                expected = (x[b, t].item() - mean) / (std + 1e-8)
                if not shift_mean:
                    expected += mean
                assert out[b, t].item() == pytest.approx(expected, rel=1e-4, abs=1e-5)
            else:
                assert out[b, t].item() == 0.0
    if shift_mean:
        # property: whitened valid values have mean 0 and (unbiased) variance 1
        w = [out[b, t].item() for b in range(4) for t in range(T_GRID) if mask[b, t]]
        assert statistics.fmean(w) == pytest.approx(0.0, abs=1e-5)
        assert statistics.variance(w) == pytest.approx(1.0, rel=1e-4)


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_hand_numbers():
    lp = torch.tensor([[-1.0, -2.5, -0.3]])
    ref = torch.tensor([[-2.0, -2.0, -0.3]])
    # d = 1, -0.5, 0
    k1 = L.kl_from_logprobs(lp, ref, "k1")
    k2 = L.kl_from_logprobs(lp, ref, "k2")
    k3 = L.kl_from_logprobs(lp, ref, "k3")
    assert_close(k1, [[1.0, -0.5, 0.0]], atol=1e-6)
    assert_close(k2, [[0.5, 0.125, 0.0]], atol=1e-6)
    # k3 = e^-d + d - 1: e^-1 = 0.36787944; e^0.5 - 1.5 = 0.14872127; 0
    assert k3[0, 0].item() == pytest.approx(0.36787944, abs=1e-6)
    assert k3[0, 1].item() == pytest.approx(0.14872127, abs=1e-6)
    assert k3[0, 2].item() == 0.0


def test_kl_estimators_match_loop():
    lp = torch.randn(4, 6, generator=gen(13)) - 2.0
    ref = torch.randn(4, 6, generator=gen(14)) - 2.0
    out = {e: L.kl_from_logprobs(lp, ref, e) for e in ("k1", "k2", "k3")}
    for b in range(4):
        for t in range(6):
            d = lp[b, t].item() - ref[b, t].item()
            assert out["k1"][b, t].item() == pytest.approx(d, abs=1e-6)
            assert out["k2"][b, t].item() == pytest.approx(d * d / 2, abs=1e-5)
            assert out["k3"][b, t].item() == pytest.approx(math.exp(-d) + d - 1, rel=1e-5, abs=1e-6)


def test_kl_unknown_estimator_raises():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        L.kl_from_logprobs(x, x, "full")
    with pytest.raises(ValueError):
        L.kl_from_logprobs(x, x, "k4")


finite_logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, allow_infinity=False)


@HYP
@given(st.lists(st.tuples(finite_logprob, finite_logprob), min_size=1, max_size=20))
def test_k3_nonnegative(pairs):
    lp = torch.tensor([[p for p, _ in pairs]])
    ref = torch.tensor([[r for _, r in pairs]])
    assert (L.kl_from_logprobs(lp, ref, "k3") >= 0).all()
    assert (L.kl_from_logprobs(lp, ref, "k2") >= 0).all()


@HYP
@given(
    st.floats(min_value=-10.0, max_value=0.0, allow_nan=False),
    st.floats(min_value=-1e-2, max_value=1e-2, allow_nan=False),
)
def test_k3_close_to_k2_for_tiny_d(ref_value, d):
    lp = torch.tensor([[ref_value + d]], dtype=torch.float64)
    ref = torch.tensor([[ref_value]], dtype=torch.float64)
    dd = lp.item() - ref.item()  # the d the function sees
    k2 = L.kl_from_logprobs(lp, ref, "k2").item()
    k3 = L.kl_from_logprobs(lp, ref, "k3").item()
    # k3 = d^2/2 - d^3/6 + d^4/24 - ...: the gap to k2 is about |d|^3 / 6
    assert abs(k3 - k2) <= abs(dd) ** 3 / 6 * 1.01 + 1e-15
    assert k2 == pytest.approx(dd * dd / 2, rel=1e-12, abs=1e-300)


# ----------------------------------------------------------------------------- token rewards


def test_last_token_index():
    mask = right_padded_mask(LENGTHS, T_GRID)
    assert L.last_token_index(mask).tolist() == [4, 2, 0, 0]


def test_token_rewards_hand_numbers():
    mask = right_padded_mask([3, 4, 0], 4)
    kl = torch.tensor([[1.0, 2.0, 3.0, 99.0], [0.5, -0.5, 1.0, 2.0], [7.0, 7.0, 7.0, 7.0]])
    scores = torch.tensor([10.0, 20.0, 30.0])
    r = L.token_rewards(scores, kl, mask, kl_coef=0.1)
    expected = torch.tensor(
        [
            [-0.1, -0.2, -0.3 + 10.0, 0.0],  # score on the last valid token (t=2); padding gets 0
            [-0.05, 0.05, -0.1, -0.2 + 20.0],
            [0.0, 0.0, 0.0, 0.0],  # no tokens: no KL and no score
        ]
    )
    assert r.dtype == torch.float32
    assert torch.allclose(r, expected, atol=1e-6)


def test_token_rewards_match_loop():
    mask = right_padded_mask(LENGTHS, T_GRID)
    kl = with_garbage(torch.randn(4, T_GRID, generator=gen(19)).abs(), mask, 123.0)
    scores = torch.randn(4, generator=gen(20))
    beta = 0.05
    r = L.token_rewards(scores, kl, mask, kl_coef=beta)
    for b in range(4):
        n = LENGTHS[b]
        for t in range(T_GRID):
            if t < n:
                expected = -beta * kl[b, t].item() + (scores[b].item() if t == n - 1 else 0.0)
            else:
                expected = 0.0
            assert r[b, t].item() == pytest.approx(expected, abs=1e-6)


# ----------------------------------------------------------------------------- GAE


def gae_reference(rewards, values, lengths, gamma, lam):
    """Slow GAE over right-padded rows: V after the last valid token is 0; padding is 0."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        last_adv = 0.0
        for t in reversed(range(n)):
            next_value = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last_adv = delta + gamma * lam * last_adv
            adv[b][t] = last_adv
            ret[b][t] = last_adv + values[b][t]
    return adv, ret


def test_gae_hand_numbers():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # gamma = lam = 1: every advantage is 1 - 0.5 = 0.5 and every return is 1
    adv, ret = L.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(adv, [[0.5, 0.5, 0.5]], atol=1e-6)
    assert_close(ret, [[1.0, 1.0, 1.0]], atol=1e-6)
    # gamma = lam = 0.5:
    #   A2 = 1 + 0 - 0.5 = 0.5
    #   d1 = 0 + 0.5*0.5 - 0.5 = -0.25, A1 = -0.25 + 0.25*0.5 = -0.125
    #   d0 = -0.25, A0 = -0.25 + 0.25*(-0.125) = -0.28125
    adv, ret = L.gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    assert_close(adv, [[-0.28125, -0.125, 0.5]], atol=1e-6)
    assert_close(ret, [[0.21875, 0.375, 1.0]], atol=1e-6)
    # the same row right-padded with garbage: the padding changes nothing and stays 0
    rewards_p = torch.tensor([[0.0, 0.0, 1.0, 50.0, -50.0]])
    values_p = torch.tensor([[0.5, 0.5, 0.5, 9.0, 9.0]])
    mask_p = torch.tensor([[True, True, True, False, False]])
    adv, ret = L.gae_advantages(rewards_p, values_p, mask_p, gamma=0.5, lam=0.5)
    assert_close(adv, [[-0.28125, -0.125, 0.5, 0.0, 0.0]], atol=1e-6)
    assert_close(ret, [[0.21875, 0.375, 1.0, 0.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (0.0, 0.5)])
def test_gae_matches_loop_with_padding(gamma, lam):
    mask = right_padded_mask(LENGTHS, T_GRID)
    rewards = with_garbage(torch.randn(4, T_GRID, generator=gen(21)), mask, 77.0)
    values = with_garbage(torch.randn(4, T_GRID, generator=gen(22)), mask, -55.0)
    adv, ret = L.gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    adv_ref, ret_ref = gae_reference(rewards.tolist(), values.tolist(), LENGTHS, gamma, lam)
    assert adv.dtype == torch.float32
    for b in range(4):
        for t in range(T_GRID):
            assert adv[b, t].item() == pytest.approx(adv_ref[b][t], abs=1e-5)
            assert ret[b, t].item() == pytest.approx(ret_ref[b][t], abs=1e-5)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    assert (adv[2] == 0).all()  # the all-False row


small_float = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def padded_grid(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    rewards = draw(st.lists(st.lists(small_float, min_size=T, max_size=T), min_size=B, max_size=B))
    values = draw(st.lists(st.lists(small_float, min_size=T, max_size=T), min_size=B, max_size=B))
    return lengths, T, rewards, values


@HYP
@given(padded_grid())
def test_gae_gamma_lam_one_is_reward_to_go_minus_value(grid):
    lengths, T, rewards, values = grid
    mask = right_padded_mask(lengths, T)
    r = torch.tensor(rewards)
    v = torch.tensor(values)
    adv, ret = L.gae_advantages(r, v, mask, gamma=1.0, lam=1.0)
    for b, n in enumerate(lengths):
        for t in range(T):
            if t < n:
                to_go = sum(rewards[b][k] for k in range(t, n))
                assert adv[b, t].item() == pytest.approx(to_go - values[b][t], abs=1e-3)
                assert ret[b, t].item() == pytest.approx(to_go, abs=1e-3)
            else:
                assert adv[b, t].item() == 0.0 and ret[b, t].item() == 0.0
    # returns = advantages + values on valid tokens
    assert torch.allclose(ret[mask], adv[mask] + v[mask], atol=1e-4)


@HYP
@given(padded_grid(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_returns_are_advantages_plus_values(grid, gamma, lam):
    lengths, T, rewards, values = grid
    mask = right_padded_mask(lengths, T)
    v = torch.tensor(values)
    adv, ret = L.gae_advantages(torch.tensor(rewards), v, mask, gamma=gamma, lam=lam)
    adv_ref, ret_ref = gae_reference(rewards, values, lengths, gamma, lam)
    assert torch.allclose(ret[mask], adv[mask] + v[mask], atol=1e-4)
    assert torch.allclose(adv, torch.tensor(adv_ref), atol=1e-3)
    assert torch.allclose(ret, torch.tensor(ret_ref), atol=1e-3)


# ----------------------------------------------------------------------------- group advantages


def test_group_advantages_hand_numbers():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0])
    # group 1: mean 3, centred (-2, -1, 0, 3), unbiased std sqrt(14/3)
    # group 2: mean 0.5, centred (-0.5, -0.5, 0.5, 0.5), unbiased std sqrt(1/3)
    s1, s2 = math.sqrt(14 / 3), math.sqrt(1 / 3)
    grpo = L.group_advantages(scores, 4, "grpo")
    expected = [-2 / s1, -1 / s1, 0.0, 3 / s1, -0.5 / s2, -0.5 / s2, 0.5 / s2, 0.5 / s2]
    assert grpo.tolist() == pytest.approx(expected, abs=1e-5)
    dr = L.group_advantages(scores, 4, "dr_grpo")
    assert dr.tolist() == pytest.approx([-2, -1, 0, 3, -0.5, -0.5, 0.5, 0.5], abs=1e-6)
    # rloo: s_i - mean of the others. group 1: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3; group 2: 0 - 2/3, 1 - 1/3
    rloo = L.group_advantages(scores, 4, "rloo")
    assert rloo.tolist() == pytest.approx([-8 / 3, -4 / 3, 0.0, 4.0, -2 / 3, -2 / 3, 2 / 3, 2 / 3], abs=1e-5)
    # batch_std: group-centred, divided by the unbiased std of all 8 scores: mean 14/8 = 1.75,
    # deviations -0.75, 0.25, 1.25, 4.25, -1.75, -1.75, -0.75, -0.75 -> squares sum 27.5, var 27.5/7
    sb = math.sqrt(27.5 / 7)
    bs = L.group_advantages(scores, 4, "batch_std")
    assert bs.tolist() == pytest.approx(
        [-2 / sb, -1 / sb, 0.0, 3 / sb, -0.5 / sb, -0.5 / sb, 0.5 / sb, 0.5 / sb], abs=1e-5
    )


def group_reference(scores: list[float], G: int, estimator: str, eps: float = 1e-6) -> list[float]:
    out = []
    batch_std = statistics.stdev(scores) if len(scores) > 1 else 0.0
    for g in range(0, len(scores), G):
        group = scores[g : g + G]
        mean = sum(group) / G
        std = statistics.stdev(group) if G > 1 else 0.0
        for i, s in enumerate(group):
            if estimator == "grpo":
                out.append((s - mean) / (std + eps))
            elif estimator == "batch_std":
                out.append((s - mean) / (batch_std + eps))
            elif estimator == "dr_grpo":
                out.append(s - mean)
            elif estimator == "rloo":
                others = [group[j] for j in range(G) if j != i]
                out.append(s - sum(others) / len(others))
    return out


@pytest.mark.parametrize("estimator", L.GROUP_ESTIMATORS)
@pytest.mark.parametrize("G", [2, 3, 8])
def test_group_advantages_match_loop(estimator, G):
    scores = (2.0 * torch.randn(4 * G, generator=gen(23 + G))).tolist()
    out = L.group_advantages(torch.tensor(scores), G, estimator)
    assert out.shape == (4 * G,)
    assert out.tolist() == pytest.approx(group_reference(scores, G, estimator), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("estimator", L.GROUP_ESTIMATORS)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.3, 0.7, -2.5, 1 / 3, 1e6 + 0.1])
@pytest.mark.parametrize("G", [2, 3, 7, 8, 16])
def test_group_advantages_all_equal_group_is_exactly_zero(estimator, value, G):
    # one varied group and one all-equal group: the equal group gets exactly zero, never NaN or float noise
    varied = [0.0] * G
    varied[0] = 1.0
    scores = torch.tensor(varied + [value] * G)
    out = L.group_advantages(scores, G, estimator)
    assert torch.isfinite(out).all()
    assert (out[G:] == 0).all(), out[G:]
    # a batch in which every score is equal (batch std 0 too)
    out_all = L.group_advantages(torch.full((2 * G,), value), G, estimator)
    assert torch.isfinite(out_all).all()
    assert (out_all == 0).all(), out_all


def test_group_advantages_group_size_one_and_errors():
    s = torch.tensor([0.3, 1.7, -2.0])
    for estimator in ("grpo", "batch_std", "dr_grpo"):
        out = L.group_advantages(s, 1, estimator)
        assert torch.isfinite(out).all() and (out == 0).all()
    with pytest.raises(ValueError):
        L.group_advantages(s, 1, "rloo")
    with pytest.raises(ValueError):
        L.group_advantages(s, 2, "grpo")  # 3 scores do not split into groups of 2
    with pytest.raises(ValueError):
        L.group_advantages(s, 3, "nope")


# ----------------------------------------------------------------------------- policy loss


def policy_reference(lp, old, adv, clip_low, clip_high, dual_clip=None):
    loss, clipped = [], []
    for a_row, lp_row, old_row in zip(adv, lp, old):
        loss_row, clip_row = [], []
        for a, x, y in zip(a_row, lp_row, old_row):
            r = math.exp(x - y)
            unclipped = -a * r
            clipped_term = -a * min(max(r, 1 - clip_low), 1 + clip_high)
            value = max(unclipped, clipped_term)
            was = clipped_term > unclipped
            if dual_clip is not None and a < 0 and value > -dual_clip * a:
                value = -dual_clip * a
                was = True
            loss_row.append(value)
            clip_row.append(was)
        loss.append(loss_row)
        clipped.append(clip_row)
    return loss, clipped


def test_policy_loss_hand_numbers():
    ratios = [1.5, 0.5, 1.25, 1.3, 3.0, 1.0]
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, -1.0, 2.0]])
    old = torch.zeros(1, 6)
    lp = torch.tensor([[math.log(r) for r in ratios]])
    # symmetric 0.2:
    #   A=1,  r=1.5 : max(-1.5, -1.2) = -1.2 clipped
    #   A=-1, r=0.5 : max(0.5, 0.8) = 0.8 clipped
    #   A=1,  r=1.25: max(-1.25, -1.2) = -1.2 clipped
    #   A=1,  r=1.3 : -1.2 clipped
    #   A=-1, r=3   : max(3, 1.2) = 3 not clipped
    #   A=2,  r=1   : -2 not clipped
    loss, clipped = L.clipped_policy_loss(lp, old, adv, 0.2, 0.2)
    assert_close(loss, [[-1.2, 0.8, -1.2, -1.2, 3.0, -2.0]], atol=1e-5)
    assert clipped.tolist() == [[True, True, True, True, False, False]]
    # asymmetric (clip_low 0.2, clip_high 0.28): r=1.25 now inside (-1.25, not clipped), r=1.3 -> -1.28
    loss, clipped = L.clipped_policy_loss(lp, old, adv, 0.2, 0.28)
    assert_close(loss, [[-1.28, 0.8, -1.25, -1.28, 3.0, -2.0]], atol=1e-5)
    assert clipped.tolist() == [[True, True, False, True, False, False]]
    # dual clip c = 2: A=-1, r=3 is capped at -c*A = 2; the rest is unchanged
    loss, clipped = L.clipped_policy_loss(lp, old, adv, 0.2, 0.2, dual_clip=2.0)
    assert_close(loss, [[-1.2, 0.8, -1.2, -1.2, 2.0, -2.0]], atol=1e-5)
    assert clipped.tolist() == [[True, True, True, True, True, False]]


@pytest.mark.parametrize("clip_low,clip_high,dual_clip", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_policy_loss_matches_loop(clip_low, clip_high, dual_clip):
    lp = torch.randn(4, 6, generator=gen(40)) * 0.5 - 1.0
    old = lp + 0.4 * torch.randn(4, 6, generator=gen(41))
    adv = torch.randn(4, 6, generator=gen(42))
    loss, clipped = L.clipped_policy_loss(lp, old, adv, clip_low, clip_high, dual_clip)
    ref_loss, ref_clipped = policy_reference(lp.tolist(), old.tolist(), adv.tolist(), clip_low, clip_high, dual_clip)
    assert torch.allclose(loss, torch.tensor(ref_loss), atol=1e-5)
    # flags compared where the two branches are not within rounding of each other
    for b in range(4):
        for t in range(6):
            r = math.exp(lp[b, t].item() - old[b, t].item())
            near_edge = min(abs(r - (1 - clip_low)), abs(r - (1 + clip_high))) < 1e-5
            if not near_edge:
                assert clipped[b, t].item() == ref_clipped[b][t]
    assert clipped.any() and not clipped.all()  # the data exercises both branches


def test_policy_loss_gradient_is_zero_on_clipped_tokens():
    lp = torch.tensor([[math.log(1.5), math.log(1.1), math.log(0.5), math.log(0.9)]], requires_grad=True)
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -2.0, -2.0]])
    loss, clipped = L.clipped_policy_loss(lp, old, adv, 0.2, 0.2)
    loss.sum().backward()
    # d(-A r)/d logp = -A r on unclipped tokens; 0 where the clipped constant branch is taken
    assert clipped.tolist() == [[True, False, True, False]]
    assert_close(lp.grad, [[0.0, -1.1, 0.0, 2 * 0.9]], atol=1e-5)


@HYP
@given(st.lists(st.tuples(st.floats(-3, 0), st.floats(-3, 0), st.floats(-5, 5)), min_size=1, max_size=16))
def test_policy_loss_huge_clip_is_plain_surrogate(triples):
    lp = torch.tensor([[a for a, _, _ in triples]], dtype=torch.float64)
    old = torch.tensor([[b for _, b, _ in triples]], dtype=torch.float64)
    adv = torch.tensor([[c for _, _, c in triples]], dtype=torch.float64)
    loss, clipped = L.clipped_policy_loss(lp, old, adv, clip_low=1e9, clip_high=1e9)
    expected = [-c * math.exp(a - b) for a, b, c in triples]
    assert loss[0].tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert not clipped.any()


# ----------------------------------------------------------------------------- value loss


def test_value_loss_hand_numbers():
    values = torch.tensor([[1.5, 1.1, 0.7]])
    old = torch.tensor([[1.0, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    # t0: unclipped (1.5-2)^2 = 0.25; clipped value 1.2 -> (1.2-2)^2 = 0.64; loss 0.32, clipped
    # t1: V-V_old = 0.1 is inside the clip: both 1.21 -> 0.605, not clipped
    # t2: unclipped 0.49; clipped value 0.8 -> 0.64; loss 0.32, clipped
    loss, clipped = L.clipped_value_loss(values, old, returns, clip=0.2)
    assert_close(loss, [[0.32, 0.605, 0.32]], atol=1e-5)
    assert clipped.tolist() == [[True, False, True]]
    loss, clipped = L.clipped_value_loss(values, old, returns, clip=None)
    assert_close(loss, [[0.125, 0.605, 0.245]], atol=1e-5)
    assert not clipped.any()


@pytest.mark.parametrize("clip", [0.2, 0.05, None])
def test_value_loss_matches_loop(clip):
    values = torch.randn(3, 5, generator=gen(50))
    old = values + 0.3 * torch.randn(3, 5, generator=gen(51))
    returns = torch.randn(3, 5, generator=gen(52))
    loss, clipped = L.clipped_value_loss(values, old, returns, clip)
    for b in range(3):
        for t in range(5):
            v, vo, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            unclipped = (v - r) ** 2
            if clip is None:
                expected, was = 0.5 * unclipped, False
            else:
                vc = vo + min(max(v - vo, -clip), clip)
                expected = 0.5 * max(unclipped, (vc - r) ** 2)
                was = (vc - r) ** 2 > unclipped
            assert loss[b, t].item() == pytest.approx(expected, abs=1e-5)
            if abs(abs(v - vo) - (clip or 0.0)) > 1e-5:
                assert clipped[b, t].item() == was


# ----------------------------------------------------------------------------- explained variance


def test_explained_variance_hand_numbers():
    mask = torch.tensor([[True, True, True, False]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 40.0]])
    # perfect prediction -> 1 (padding value differs and must not matter)
    perfect = torch.tensor([[1.0, 2.0, 3.0, -7.0]])
    assert L.explained_variance(perfect, returns, mask).item() == pytest.approx(1.0, abs=1e-6)
    # residual (0, 0, 1): var 2/9; Var(R) = 2/3 -> 1 - 1/3 = 2/3
    values = torch.tensor([[1.0, 2.0, 2.0, 5.0]])
    assert L.explained_variance(values, returns, mask).item() == pytest.approx(2 / 3, abs=1e-6)
    # a constant prediction equal to the mean of R explains nothing -> 0
    const = torch.tensor([[2.0, 2.0, 2.0, 0.0]])
    assert L.explained_variance(const, returns, mask).item() == pytest.approx(0.0, abs=1e-6)


# ----------------------------------------------------------------------------- aggregation


def test_aggregate_loss_hand_numbers():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # valid: 1, 2 | 4
    assert L.aggregate_loss(per_token, mask, "token_mean").item() == pytest.approx(7 / 3)
    assert L.aggregate_loss(per_token, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert L.aggregate_loss(per_token, mask, "seq_mean_token_sum_norm").item() == pytest.approx(7 / (3 * 2))
    assert L.aggregate_loss(per_token, mask, "seq_mean_token_sum_norm", max_response_len=5).item() == pytest.approx(
        7 / 10
    )
    # explicit totals (as a micro-batch of a bigger minibatch would pass them)
    assert L.aggregate_loss(per_token, mask, "token_mean", total_tokens=10).item() == pytest.approx(0.7)
    assert L.aggregate_loss(per_token, mask, "token_mean", total_tokens=torch.tensor(10)).item() == pytest.approx(0.7)
    assert L.aggregate_loss(per_token, mask, "seq_mean_token_mean", total_sequences=5).item() == pytest.approx(5.5 / 5)
    assert L.aggregate_loss(
        per_token, mask, "seq_mean_token_sum_norm", total_sequences=4, max_response_len=5
    ).item() == pytest.approx(7 / 20)
    # an all-False row adds nothing to the sums (it still counts as one of the batch's sequences)
    per_token3 = torch.cat([per_token, torch.tensor([[100.0, 100.0, 100.0]])])
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    assert L.aggregate_loss(per_token3, mask3, "token_mean").item() == pytest.approx(7 / 3)
    assert L.aggregate_loss(per_token3, mask3, "seq_mean_token_mean").item() == pytest.approx(5.5 / 3)
    assert L.aggregate_loss(per_token3, mask3, "seq_mean_token_sum_norm").item() == pytest.approx(7 / 9)
    # nothing valid at all: 0, not NaN
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in L.LOSS_AGGREGATIONS:
        assert L.aggregate_loss(per_token, empty, mode).item() == 0.0
    with pytest.raises(ValueError):
        L.aggregate_loss(per_token, mask, "mean")


@pytest.mark.parametrize("mode", L.LOSS_AGGREGATIONS)
def test_aggregate_loss_micro_batching_invariant(mode):
    B, T = 7, 6
    lengths = [6, 1, 0, 4, 2, 6, 3]  # uneven lengths and an all-False row
    mask = right_padded_mask(lengths, T)
    base = torch.randn(B, T, generator=gen(60), dtype=torch.float64)
    weight = torch.randn(B, T, generator=gen(61), dtype=torch.float64)

    def per_token_loss(x, w):
        return (x - 0.3) ** 2 * w + torch.sin(x)

    # whole batch, default counts
    x_full = base.clone().requires_grad_(True)
    full = L.aggregate_loss(per_token_loss(x_full, weight), mask, mode, max_response_len=T)
    full.backward()

    # micro-batches with the whole batch's counts, summed
    x_micro = base.clone().requires_grad_(True)
    total_tokens = mask.sum()
    total = 0.0
    for lo, hi in ((0, 2), (2, 3), (3, 7)):
        part = L.aggregate_loss(
            per_token_loss(x_micro[lo:hi], weight[lo:hi]),
            mask[lo:hi],
            mode,
            total_tokens=total_tokens,
            total_sequences=B,
            max_response_len=T,
        )
        part.backward()
        total = total + part.item()
    assert total == pytest.approx(full.item(), rel=1e-6)
    assert torch.allclose(x_micro.grad, x_full.grad, rtol=1e-6, atol=1e-9)
    assert (x_full.grad[~mask] == 0).all()

    # the whole-batch value against a plain loop over sequences and tokens
    pt = per_token_loss(base, weight).tolist()
    if mode == "token_mean":
        expected = sum(pt[b][t] for b in range(B) for t in range(lengths[b])) / sum(lengths)
    elif mode == "seq_mean_token_mean":
        expected = sum(sum(pt[b][:n]) / n if n else 0.0 for b, n in enumerate(lengths)) / B
    else:
        expected = sum(pt[b][t] for b in range(B) for t in range(lengths[b])) / (T * B)
    assert full.item() == pytest.approx(expected, rel=1e-6)

    # the gradient of token_mean is mask / N: an independent check that the totals are really used
    if mode == "token_mean":
        x = base.clone().requires_grad_(True)
        parts = [
            L.aggregate_loss(x[lo:hi], mask[lo:hi], mode, total_tokens=total_tokens) for lo, hi in ((0, 3), (3, 7))
        ]
        sum(parts).backward()
        assert torch.allclose(x.grad, mask.double() / sum(lengths))
