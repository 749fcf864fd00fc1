"""Decode steps over the unfinished rows only (`sample(skip_finished=True)`, the default): the same tokens and
log-probs as decoding every row, and the model runs fewer rows once enough have ended (`COMPACT_BELOW`)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from test_shared_prefill import gpt2_policy, llama_policy, prompt_batch

from lit_rlhf.rollout import sampler
from lit_rlhf.rollout.sampler import sample
from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer

T = 16


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


@contextmanager
def decode_rows(model):
    """Records the rows of each decode-step forward (one new column) of `model`."""
    rows: list[int] = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            rows.append(kwargs["input_ids"].shape[0])

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def run(policy, batch, eos, pad, seed, skip_finished, **settings):
    return sample(
        policy,
        batch.input_ids,
        batch.attention_mask,
        T,
        eos,
        pad,
        generator=torch.Generator().manual_seed(seed),
        return_logprobs=True,
        skip_finished=skip_finished,
        **settings,
    )


def frequent_eos(policy, batch, pad, **settings) -> int:
    """The token (not pad) whose first occurrence in a row falls at the most distinct steps: taken as EOS, rows
    end at many different steps."""
    ids = run(policy, batch, -1, pad, 0, False, **settings).response_ids
    first = {v: {int(row.nonzero()[0]) for row in ids == v if row.any()} for v in ids.unique().tolist() if v != pad}
    return max(first, key=lambda v: len(first[v]))


def end_steps(response_ids, eos) -> list[int]:
    """(B, T) -> each row's last decoded step: its EOS, or the last column."""
    is_eos = response_ids == eos
    return [int(row.nonzero()[0]) if row.any() else response_ids.shape[1] - 1 for row in is_eos]


def expected_decode_rows(response_ids, eos, check_every) -> list[int]:
    """The rows each decode step runs under the rule: at a stop check, the rows still running replace those the
    cache holds when they are at most `COMPACT_BELOW` of them."""
    ends = torch.tensor(end_steps(response_ids, eos))
    held, rows = response_ids.shape[0], []
    for t in range(response_ids.shape[1] - 1):  # the step after token t
        running = int((ends > t).sum())
        if (t + 1) % check_every == 0 and running <= sampler.COMPACT_BELOW * held:
            held = running
        rows.append(held)
    return rows


def assert_same_draws(policy, tokenizer, settings, seeds=(0, 1)):
    """With and without skipping: equal tokens, log-probs within 1e-5 (0 after EOS), rows ending at several
    steps, and the model run over fewer rows."""
    batch, pad = prompt_batch(tokenizer), tokenizer.pad_token_id
    eos = frequent_eos(policy, batch, pad, **settings)
    for seed in seeds:
        with decode_rows(policy) as rows:
            skipped = run(policy, batch, eos, pad, seed, True, **settings)
        full = run(policy, batch, eos, pad, seed, False, **settings)
        assert torch.equal(skipped.response_ids, full.response_ids), seed
        torch.testing.assert_close(skipped.logprobs, full.logprobs, atol=1e-5, rtol=0)
        ends = end_steps(skipped.response_ids, eos)
        assert len(set(ends) - {T - 1}) >= 3, ends  # rows end at three or more steps before the last
        assert min(rows) < skipped.response_ids.shape[0], rows
        after_eos = torch.arange(skipped.response_ids.shape[1]) > torch.tensor(ends)[:, None]
        assert (skipped.logprobs[after_eos] == 0).all()


def greedy_gpt2_policy():
    """A tiny GPT-2 whose greedy continuations switch token at different steps (seeds 0-2 repeat one token)."""
    torch.manual_seed(3)
    return builtin_policy(n_layer=2, n_embd=32, n_head=2).eval()


SETTINGS = {
    "plain": dict(group_size=4),
    "top_p": dict(group_size=4, temperature=1.3, top_p=0.8),
    "check_every_3": dict(group_size=4, stop_check_every=3),
    "greedy": dict(group_size=3, do_sample=False),
}
CASES = [
    pytest.param(make_policy, SETTINGS[name], id=f"{name}-{model}")
    for name in SETTINGS
    for model, make_policy in [
        ("gpt2", greedy_gpt2_policy if name == "greedy" else gpt2_policy),
        ("llama", llama_policy),
    ]
]


@pytest.mark.parametrize(("make_policy", "settings"), CASES)
def test_skipping_finished_rows_draws_the_same_tokens_and_logprobs(tokenizer, make_policy, settings):
    assert_same_draws(make_policy(), tokenizer, settings)


@pytest.mark.parametrize("check_every", [1, 3])
def test_the_model_runs_the_rows_the_compaction_rule_keeps(tokenizer, check_every):
    """Per decode step, the forward's rows are the running rows at the last compaction, taken at a stop check
    once they are at most COMPACT_BELOW of the rows held; before that, every row."""
    policy, batch, pad = gpt2_policy(), prompt_batch(tokenizer), tokenizer.pad_token_id
    eos = frequent_eos(policy, batch, pad, group_size=4)
    with decode_rows(policy) as rows:
        out = run(policy, batch, eos, pad, 0, True, group_size=4, stop_check_every=check_every)
    ends = torch.tensor(end_steps(out.response_ids, eos))
    running = [int((ends > t).sum()) for t in range(out.response_ids.shape[1] - 1)]
    assert rows == expected_decode_rows(out.response_ids, eos, check_every)
    assert rows[0] == len(ends) and min(rows) < len(ends)
    assert any(r > n for r, n in zip(rows, running, strict=True))  # finished rows kept until the threshold


def test_a_peft_lora_policy_draws_the_same_tokens(tokenizer):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    policy = peft.get_peft_model(llama_policy(), lora).eval()
    assert_same_draws(policy, tokenizer, dict(group_size=4), seeds=(0,))
