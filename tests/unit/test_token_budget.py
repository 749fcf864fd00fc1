"""Micro-batches by a token budget (`algorithm.micro_batch_tokens`), cut to their own width: the packing by hand,
the cut by hand, and the gradient equal to the whole minibatch's."""

from __future__ import annotations

import pytest
import torch

from conftest import make_policy, make_trainer, prompt_batch
from lit_rlhf import AlgorithmConfig, RLHFModule, SamplingConfig
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.config import ConfigError
from lit_rlhf.training.batching import micro_batches, padding_fraction, row_lengths, token_budget_rows, trim_padding

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
# prompts of 2 to 6 tokens: left padding that some micro-batches can drop
TEXTS = ["31425>", "9>", "55>", "1234>", "8>", "602>", "71>", "4>"]


def test_rows_are_packed_longest_first_under_the_budget():
    prompt = torch.tensor([3, 3, 3, 3, 3])
    response = torch.tensor([2, 7, 4, 7, 1])  # totals 5, 10, 7, 10, 4
    # longest first: rows 1, 3 (10 each; stable order), 2 (7), 0 (5), 4 (4)
    # budget 20: [1, 3] costs 2 x 10 = 20; adding 2 -> 3 x 10 = 30 > 20; [2, 0] 2 x 7 = 14, [2, 0, 4] 3 x 7 = 21 > 20
    pieces = token_budget_rows(prompt, response, 20)
    assert [p.tolist() for p in pieces] == [[1, 3], [2, 0], [4]]
    # the widest prompt and the widest response of a piece can come from different rows: 2 x (5 + 4) = 18
    pieces = token_budget_rows(torch.tensor([5, 1]), torch.tensor([1, 4]), 18)
    assert [p.tolist() for p in pieces] == [[0, 1]]
    assert [p.tolist() for p in token_budget_rows(torch.tensor([5, 1]), torch.tensor([1, 4]), 17)] == [[0], [1]]


def test_a_budget_below_one_sequence_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"algorithm.micro_batch_tokens: 9 .* at least 10"):
        token_budget_rows(torch.tensor([3, 3]), torch.tensor([7, 2]), 9)
    with pytest.raises(ConfigError, match="algorithm.micro_batch_tokens"):
        AlgorithmConfig(micro_batch_tokens=0)
    with pytest.raises(ConfigError, match="algorithm.micro_batch_tokens.*micro_batch_size=2"):
        AlgorithmConfig(micro_batch_tokens=64, micro_batch_size=2)


def experience(tokenizer, **algorithm):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(**algorithm),
        sampling=SamplingConfig(max_new_tokens=8),
    )
    torch.manual_seed(5)
    rollout = module.make_rollout(prompt_batch(tokenizer, TEXTS[: 8 // module.algorithm.filled.group_size]))[0]
    return module, module.make_experience(rollout)[0]


def test_trim_cuts_the_columns_that_are_padding_in_every_row(tokenizer):
    _, exp = experience(tokenizer, name="ppo", micro_batch_tokens=64)
    prompt_len, response_len = row_lengths(exp.prompt_mask, exp.response_mask)
    # by hand: a row's response length is its mask's count (contiguous from column 0), its prompt the mask's count
    assert torch.equal(response_len, exp.response_mask.sum(1))
    assert torch.equal(prompt_len, exp.prompt_mask.sum(1))
    rows = torch.tensor([1, 4])  # "9>" and "8>": 2 prompt tokens of 6
    cut = trim_padding(exp.select(rows))
    keep_t = int(response_len[rows].max())
    assert cut.prompt_ids.tolist() == exp.prompt_ids[rows, -2:].tolist()
    assert torch.equal(cut.response_ids, exp.response_ids[rows, :keep_t])
    for name in ("response_mask", "loss_mask", "old_logprobs", "advantages", "values", "returns", "kl"):
        assert torch.equal(getattr(cut, name), getattr(exp, name)[rows, :keep_t]), name
    assert torch.equal(cut.scores, exp.scores[rows]) and cut.responses == [exp.responses[i] for i in rows.tolist()]
    assert not (~cut.prompt_mask.bool()).all(0).any()  # no column left that is padding in every row
    # padding share by hand: computed cells minus valid cells
    valid = int(cut.prompt_mask.sum() + cut.response_mask.sum())
    assert padding_fraction([cut]) == pytest.approx(1 - valid / (2 * (2 + keep_t)))


def grads_after(module, pieces, totals):
    module.actor_critic.zero_grad(set_to_none=True)
    for piece in pieces:
        loss, _ = module.micro_batch_loss(piece, totals)
        loss.backward()
    return {n: p.grad.clone() for n, p in module.actor_critic.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize(
    "extra",
    [
        dict(name="ppo", mask_truncated=True),  # critic: values and returns are cut too
        dict(name="grpo", group_size=4, kl_coef=0.04, kl_estimator="k3", entropy_coef=0.01),
        dict(name="grpo", group_size=2, kl_coef=0.04, kl_estimator="full"),  # the reference forward of the cut batch
    ],
)
def test_token_budget_micro_batches_give_the_gradient_of_the_whole_minibatch(tokenizer, extra, aggregation):
    module, exp = experience(tokenizer, loss_aggregation=aggregation, micro_batch_tokens=30, **extra)
    assert len(set(exp.response_mask.sum(1).tolist())) > 1  # uneven responses: something to cut
    with torch.no_grad():  # move the policy off the sampling policy: ratio, clipping and KL gradients live
        g = torch.Generator().manual_seed(0)
        for p in module.actor_critic.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    module.train()
    totals = MinibatchTotals.of(exp, module.sampling.max_new_tokens)
    whole = grads_after(module, [exp], totals)
    pieces = micro_batches(exp, exp.batch_size, module.algorithm.micro_batch_tokens)
    assert len(pieces) > 2 and sorted(i for p in pieces for i in p.responses) == sorted(exp.responses)
    assert all(p.batch_size * (p.prompt_len + p.response_ids.shape[1]) <= 30 for p in pieces)
    assert any(p.response_ids.shape[1] < exp.response_ids.shape[1] for p in pieces)  # some were cut
    assert padding_fraction(pieces) < padding_fraction([exp])
    budgeted = grads_after(module, pieces, totals)
    assert whole.keys() == budgeted.keys() and whole
    for name in whole:
        torch.testing.assert_close(budgeted[name], whole[name], atol=1e-6, rtol=1e-4, msg=name)


def test_training_with_a_token_budget_logs_the_padding_share(tokenizer):
    """A real update through the Trainer: token-budget micro-batches, and the logged padding share matches the
    pieces recomputed by hand from the step's experience."""
    from lit_rlhf import RolloutDataModule

    seen = []

    class Recording(RLHFModule):
        def on_experience(self, experience):
            seen.append(experience)

    module = Recording(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(group_size=4, micro_batch_tokens=40),
        sampling=SamplingConfig(max_new_tokens=8),
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    make_trainer(1).fit(module, data)
    pieces = micro_batches(seen[0], 8, 40)
    assert len(pieces) > 1
    assert module.step_metrics["perf/update_padding"] == pytest.approx(padding_fraction(pieces))
