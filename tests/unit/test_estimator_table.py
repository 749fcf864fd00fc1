"""The advantage-estimator table: every entry of `ESTIMATORS` does what it declares, on real numbers, and the
settings checks read those declarations; registering a new entry is all it takes to add one.

B = 4 rows (two groups of G = 2) of lengths 3, 2, 4, 1 on a T = 6 grid; padded positions hold garbage (99), so a
leak through the mask would show.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lit_rlhf.algorithms.estimators import ESTIMATORS, AdvantageInputs, Advantages, Estimator
from lit_rlhf.algorithms.experience import compute_advantages
from lit_rlhf.config import AlgorithmConfig, ConfigError
from lit_rlhf.rollout.multi_turn import check_multi_turn_settings

LENGTHS = (3, 2, 4, 1)
B, T, G = 4, 6, 2
NAMES = sorted(ESTIMATORS)


def compact_mask(lengths=LENGTHS) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def holed_mask(lengths=LENGTHS) -> torch.Tensor:
    """Each row's first token, two masked positions (an environment turn in a multi-turn rollout), the rest."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, 0] = True
        mask[b, 3 : 3 + n - 1] = True
    return mask


def on_grid(per_row: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Row b's values in order on the True positions of mask[b]; 99 elsewhere."""
    out = torch.full((B, T), 99.0)
    for b, row in enumerate(per_row):
        out[b, mask[b]] = torch.tensor(row)
    return out


def valid(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [x[b, mask[b]].tolist() for b in range(B)]


def config(name: str, group_size: int = G, **settings) -> AlgorithmConfig:
    return AlgorithmConfig(name="grpo", advantage_estimator=name, group_size=group_size, kl_coef=0.0, **settings)


def advantages(name, scores, mask, values=None, group_size: int = G, **settings) -> Advantages:
    return compute_advantages(config(name, group_size, **settings), scores, None, values, mask)


GEN = torch.Generator().manual_seed(0)
SCORES = torch.randn(B, generator=GEN)
VALUE_ROWS = [torch.randn(n, generator=GEN).tolist() for n in LENGTHS]
OTHER_VALUE_ROWS = [[v + 0.5 * (i + 1) for i, v in enumerate(row)] for row in VALUE_ROWS]


# ----------------------------------------------------------------------------- each entry's declarations


def test_every_entry_declares_sensible_values():
    assert {"gae", "grpo", "batch_std", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(NAMES)
    for name, estimator in ESTIMATORS.items():
        assert isinstance(estimator, Estimator) and callable(estimator.compute), name
        assert isinstance(estimator.min_group_size, int) and estimator.min_group_size >= 1, name
        assert estimator.walks_token_grid in ("never", "when_discounted", "always"), name


@pytest.mark.parametrize("name", NAMES)
def test_needs_critic_says_whether_the_values_are_read(name):
    mask = compact_mask()
    values, other = on_grid(VALUE_ROWS, mask), on_grid(OTHER_VALUE_ROWS, mask)
    assert config(name).uses_critic == ESTIMATORS[name].needs_critic
    if ESTIMATORS[name].needs_critic:
        with pytest.raises(ValueError, match="values"):
            advantages(name, SCORES, mask)
        adv, returns = advantages(name, SCORES, mask, values)
        adv_other, returns_other = advantages(name, SCORES, mask, other)
        assert returns is not None and returns_other is not None
        assert valid(adv, mask) != valid(adv_other, mask)
        assert valid(returns, mask) != valid(returns_other, mask)
    else:
        adv, returns = advantages(name, SCORES, mask)
        assert returns is None
        assert torch.equal(advantages(name, SCORES, mask, values)[0], adv)


@pytest.mark.parametrize("name", NAMES)
def test_a_tied_group_gets_exactly_zero_advantage_iff_the_entry_says_so(name):
    mask = compact_mask()
    scores = torch.tensor([0.1, 0.1, 1.0, 0.0])  # group 0 tied (0.1 is not exact in binary), group 1 not
    adv, _ = advantages(name, scores, mask, on_grid(VALUE_ROWS, mask))
    tied_rows_zero = bool((adv[:2][mask[:2]] == 0).all())
    assert tied_rows_zero == ESTIMATORS[name].zeroes_tied_groups
    assert bool((adv[~mask] == 0).all())  # never anything outside the mask


@pytest.mark.parametrize("name", NAMES)
def test_min_group_size_is_enforced_by_the_config(name):
    fewest = ESTIMATORS[name].min_group_size
    if fewest > 1:
        with pytest.raises(ConfigError, match=rf"algorithm\.group_size: .*{name!r} needs at least {fewest}"):
            config(name, group_size=fewest - 1)
    rows = fewest * 2
    adv, _ = compute_advantages(
        config(name, group_size=fewest),
        torch.randn(rows, generator=GEN),
        None,
        torch.randn(rows, 3, generator=GEN),
        torch.ones(rows, 3, dtype=torch.bool),
    )
    assert adv.shape == (rows, 3) and bool(adv.isfinite().all())
    assert bool((adv != 0).any())  # a learning signal: below its minimum a group estimator gives all zeros


def refused_with_multi_turn(name: str, gamma: float) -> bool:
    try:
        check_multi_turn_settings(config(name, gamma=gamma))
    except ConfigError:
        return True
    return False


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("name", NAMES)
def test_multi_turn_refuses_exactly_the_estimators_whose_advantages_see_environment_tokens(name, gamma):
    """Masked positions between a row's tokens (an environment turn) change the policy tokens' advantages only
    for an estimator that walks the grid; multi-turn refuses exactly those, as its declaration says."""
    compact, holed = compact_mask(), holed_mask()
    scores = torch.tensor([0.3, -1.2, 0.8, 0.5])
    plain, _ = advantages(name, scores, compact, on_grid(VALUE_ROWS, compact), gamma=gamma)
    with_holes, _ = advantages(name, scores, holed, on_grid(VALUE_ROWS, holed), gamma=gamma)
    same = all(
        torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
        for a, b in zip(valid(plain, compact), valid(with_holes, holed), strict=True)
    )
    walk = ESTIMATORS[name].walks_token_grid
    declared_walk = walk == "always" or (walk == "when_discounted" and gamma != 1.0)
    assert same == (not declared_walk)
    assert refused_with_multi_turn(name, gamma) == declared_walk


# ----------------------------------------------------------------------------- the table is the one list


def test_an_unknown_estimator_is_refused_with_the_tables_names():
    with pytest.raises(ConfigError, match="algorithm.advantage_estimator: unknown value 'vtrace'") as info:
        config("vtrace")
    assert all(repr(name) in str(info.value) for name in ESTIMATORS)


def toy_max_baseline(inputs: AdvantageInputs) -> Advantages:
    """s - the best score of its group, broadcast: a tied group gets exactly 0."""
    grouped = inputs.scores.float().view(-1, inputs.group_size)
    per_seq = (grouped - grouped.amax(dim=1, keepdim=True)).reshape(-1)
    return per_seq[:, None] * inputs.mask.float(), None


TOY = Estimator(
    toy_max_baseline, needs_critic=False, min_group_size=3, zeroes_tied_groups=True, walks_token_grid="never"
)


def test_adding_an_estimator_is_one_function_and_one_entry(monkeypatch):
    with pytest.raises(ConfigError, match="algorithm.advantage_estimator"):
        config("toy", group_size=3)
    monkeypatch.setitem(ESTIMATORS, "toy", TOY)

    cfg = config("toy", group_size=3, dynamic_sampling=True)  # accepted, with dynamic sampling (it zeroes ties)
    assert not cfg.uses_critic
    check_multi_turn_settings(cfg)  # accepted with an environment (it does not walk the grid)
    with pytest.raises(ConfigError, match=r"algorithm\.group_size: .*'toy' needs at least 3"):
        config("toy", group_size=2)
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling: .*one of .*'toy'"):
        config("reinforce_pp", group_size=3, dynamic_sampling=True)

    scores = torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0, 5.0])
    mask = torch.ones(6, 2, dtype=torch.bool)
    adv, returns = compute_advantages(cfg, scores, None, None, mask)
    assert returns is None
    assert adv[:, 0].tolist() == [-2.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    # the entry, not a name comparison, decides: a different function under the same name is what runs
    monkeypatch.setitem(ESTIMATORS, "toy", dataclasses.replace(TOY, compute=lambda inputs: (-adv, None)))
    assert torch.equal(compute_advantages(cfg, scores, None, None, mask)[0], -adv)
