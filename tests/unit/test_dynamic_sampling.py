"""DAPO dynamic sampling's parts: tie detection, concatenation of rollouts of different widths, the refill loop
(with a scripted collect function), the refill stream's slot arithmetic, its settings and the refill rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from lit_rlhf import AlgorithmConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.data import sources
from lit_rlhf.data.datamodule import REFILL_SEED_OFFSET, RolloutDataModule
from lit_rlhf.data.sources import PromptStream
from lit_rlhf.rollout.collect import RolloutTimings
from lit_rlhf.rollout.dynamic import concat_rollouts, dynamic_rollout, refill_position, refill_source, tied_groups
from lit_rlhf.tasks.digits import builtin_tokenizer
from lit_rlhf.types import PromptBatch, Rollout

PAD = 0


def test_tied_groups_are_groups_of_exactly_equal_scores():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.3, 0.3 + 1e-7, 0.0, 0.0, float("nan"), float("nan")])
    assert tied_groups(scores, 2).tolist() == [True, False, False, True, False]
    assert tied_groups(torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0, 2.0]), 3).tolist() == [True, False]


def _rollout(prompt_rows, response_rows, scores, tag, context=None, version=3) -> Rollout:
    """A rollout from lists of real tokens: prompts left padded, responses right padded, by hand."""
    P = max(map(len, prompt_rows))
    T = max(map(len, response_rows))
    prompt_ids = torch.tensor([[PAD] * (P - len(r)) + r for r in prompt_rows])
    prompt_mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in prompt_rows])
    response_ids = torch.tensor([r + [PAD] * (T - len(r)) for r in response_rows])
    response_mask = torch.tensor([[True] * len(r) + [False] * (T - len(r)) for r in response_rows])
    n = len(prompt_rows)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        truncated=torch.tensor([r[-1] != 1 for r in response_rows]),  # no EOS (id 1) at the end
        scores=torch.tensor(scores),
        prompts=[f"{tag}p{i}" for i in range(n)],
        responses=[f"{tag}r{i}" for i in range(n)],
        meta={"answer": [f"{tag}a{i}" for i in range(n)]},
        policy_version=version,
        context_mask=context,
    )


def test_concat_of_rollouts_of_different_widths_equals_the_hand_padded_batch():
    a = _rollout([[5, 6], [7]], [[9, 1], [8, 8, 1]], [0.5, 1.0], "a")  # P=2, T=3
    b = _rollout([[4, 4, 4, 4]], [[2]], [0.0], "b")  # P=4, T=1
    out = concat_rollouts([a, b], PAD)
    assert out.prompt_ids.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7], [4, 4, 4, 4]]
    assert out.prompt_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert out.response_ids.tolist() == [[9, 1, 0], [8, 8, 1], [2, 0, 0]]
    assert out.response_mask.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    assert out.truncated.tolist() == [False, False, True]
    assert out.scores.tolist() == [0.5, 1.0, 0.0]
    assert out.prompts == ["ap0", "ap1", "bp0"] and out.responses == ["ar0", "ar1", "br0"]
    assert out.meta == {"answer": ["aa0", "aa1", "ba0"]}
    assert out.policy_version == 3 and out.context_mask is None
    # every row keeps its real tokens: what its attention mask selects is its own prompt and response
    for rollout, rows in ((a, range(0, 2)), (b, range(2, 3))):
        for i, row in enumerate(rows):
            mine = out.input_ids()[row][out.attention_mask()[row].bool()]
            assert mine.tolist() == rollout.input_ids()[i][rollout.attention_mask()[i].bool()].tolist()


def test_concat_pads_a_missing_context_mask_with_false_and_refuses_different_versions():
    context = torch.tensor([[False, True, False], [False, False, False]])
    a = _rollout([[5, 6], [7]], [[9, 1], [8, 8, 1]], [0.5, 1.0], "a", context=context)
    b = _rollout([[4]], [[2, 3, 4, 1]], [0.0], "b")
    out = concat_rollouts([a, b], PAD)
    assert out.context_mask.tolist() == [[False, True, False, False], [False] * 4, [False] * 4]
    with pytest.raises(ValueError, match="policy_version"):
        concat_rollouts([a, _rollout([[4]], [[2]], [0.0], "c", version=4)], PAD)


# ---------------------------------------------------------------------------------------------- the refill loop

G = 2


def _scripted_collect(script: dict[str, tuple[float, float]], calls: list[list[str]]):
    """A collect function: prompt text -> its group's two scores; records each batch's prompts."""

    def collect(batch: PromptBatch):
        calls.append(list(batch.texts))
        rows = [[ord(c) % 50 + 2 for c in text] for text in batch.texts for _ in range(G)]
        scores = [s for text in batch.texts for s in script[text]]
        rollout = _rollout(rows, [[3, 1]] * len(rows), scores, "")
        rollout.prompts = [text for text in batch.texts for _ in range(G)]
        return rollout, RolloutTimings(generate_s=1.0, score_s=0.5)

    return collect


def _batch(texts: list[str]) -> PromptBatch:
    return PromptBatch(torch.ones(len(texts), 1, dtype=torch.long), torch.ones(len(texts), 1, dtype=torch.long), texts)


def _refills(rounds: dict[int, list[str]]):
    """Extra round j's prompts."""
    return lambda j: _batch(rounds[j])


TIE, SPLIT = (1.0, 1.0), (0.0, 1.0)


def test_the_refill_loop_keeps_the_first_untied_groups_in_order():
    # round 1: t1 and t3 tie; round 2: u4, u5 untied (u5 is one too many: discarded), t6 ties
    script = {"u0": SPLIT, "t1": TIE, "u2": SPLIT, "t3": TIE, "u4": SPLIT, "t6": TIE, "u5": SPLIT, "u7": SPLIT}
    script["x"] = SPLIT
    refills = {1: ["t6", "u4", "u5", "u7"], 2: ["x"] * 4}
    calls: list[list[str]] = []
    rollout, timings = dynamic_rollout(
        _scripted_collect(script, calls), _batch(["u0", "t1", "u2", "t3"]), _refills(refills), G, 3, PAD
    )
    assert calls == [["u0", "t1", "u2", "t3"], ["t6", "u4", "u5", "u7"]]  # stopped once full: no third round
    assert rollout.prompts == ["u0", "u0", "u2", "u2", "u4", "u4", "u5", "u5"]
    assert rollout.batch_size == 8 and not tied_groups(rollout.scores, G).any()
    assert timings.metrics == {
        "rollout/sampling_rounds": 2.0,
        "rollout/dropped_groups": 3.0,
        "rollout/kept_fraction": 1.0,
    }
    assert (timings.generate_s, timings.score_s) == (2.0, 1.0)


def test_the_refill_loop_stops_at_the_cap_and_tops_up_with_tied_groups_in_order():
    script = {"t0": TIE, "u1": SPLIT, "t2": TIE, "t3": TIE, "t4": TIE, "t5": (0.0, 0.0), "t6": TIE, "u7": SPLIT}
    refills = {1: ["t4", "t5", "t6"], 2: ["u7", "t2", "t3"]}
    calls: list[list[str]] = []
    collect = _scripted_collect(script, calls)
    rollout, timings = dynamic_rollout(collect, _batch(["t0", "u1", "t2"]), _refills(refills), G, 2, PAD)
    assert calls == [["t0", "u1", "t2"], ["t4", "t5", "t6"]]  # cap of 2 rounds: the second refill is never read
    assert rollout.prompts == ["u1", "u1", "t0", "t0", "t2", "t2"]  # the untied group, then the first tied ones
    assert timings.metrics["rollout/sampling_rounds"] == 2.0
    assert timings.metrics["rollout/dropped_groups"] == 5.0
    assert timings.metrics["rollout/kept_fraction"] == pytest.approx(1 / 3)


def test_nothing_tied_returns_the_first_rollout_and_one_round():
    script = {"u0": SPLIT, "u1": (0.2, 0.1)}
    calls: list[list[str]] = []
    rollout, timings = dynamic_rollout(_scripted_collect(script, calls), _batch(["u0", "u1"]), _refills({}), G, 3, 0)
    assert calls == [["u0", "u1"]] and rollout.prompts == ["u0", "u0", "u1", "u1"]
    assert timings.metrics == {
        "rollout/sampling_rounds": 1.0,
        "rollout/dropped_groups": 0.0,
        "rollout/kept_fraction": 1.0,
    }


def test_all_tied_after_every_round_trains_the_first_round_tied_groups():
    script = {"a": TIE, "b": TIE, "c": TIE, "d": TIE}
    calls: list[list[str]] = []
    rollout, timings = dynamic_rollout(
        _scripted_collect(script, calls), _batch(["a", "b"]), _refills({1: ["c", "d"]}), G, 2, PAD
    )
    assert rollout.prompts == ["a", "a", "b", "b"] and timings.metrics["rollout/kept_fraction"] == 0.0


# ------------------------------------------------------------------------------------- refill stream and settings


def test_refill_slots_follow_the_rollout_number_and_never_overlap():
    assert refill_position(1, 1, 3, 4) == 0
    assert refill_position(1, 2, 3, 4) == 4
    assert refill_position(2, 1, 3, 4) == 8
    assert refill_position(5, 2, 3, 4) == ((5 - 1) * 2 + 1) * 4
    starts = [refill_position(k, j, 4, 5) for k in range(1, 7) for j in range(1, 4)]
    assert starts == list(range(0, 6 * 3 * 5, 5))  # consecutive slots of batch_size rows, in (k, j) order


def test_a_forward_jump_in_a_builtin_stream_skips_ahead_without_restarting(monkeypatch):
    fresh = PromptStream("builtin:digits", 7, True, rank=1, world_size=2)
    expected = fresh.rows(0, 40)
    made = []
    original = sources.get_task

    def counting(*args, **kwargs):
        made.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(sources, "get_task", counting)
    stream = PromptStream("builtin:digits", 7, True, rank=1, world_size=2)
    assert stream.rows(0, 4) == expected[0:4]
    assert stream.rows(12, 4) == expected[12:16]  # forward: skipped
    assert stream.rows(30, 3) == expected[30:33]
    assert len(made) == 1  # one generator for all three reads
    assert stream.rows(2, 3) == expected[2:5]  # backward: a new generator (a resume)
    assert len(made) == 2


def test_refill_batches_come_from_a_second_seeded_stream():
    data = RolloutDataModule(
        prompts="builtin:digits", batch_size=3, max_prompt_length=16, tokenizer=builtin_tokenizer()
    )
    data.setup("fit")
    refill_rows = PromptStream("builtin:digits", REFILL_SEED_OFFSET, True).rows(0, 9)
    batch = data.refill_batch(6)
    assert batch.texts == [row["prompt"] for row in refill_rows[6:9]]
    main = [row["prompt"] for row in itertools.islice(iter(data.stream), 9)]
    assert batch.texts != main[6:9]


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(name="ppo", dynamic_sampling=True), "algorithm.dynamic_sampling.*'gae'"),
        (dict(advantage_estimator="reinforce_pp", group_size=1, dynamic_sampling=True), "'reinforce_pp'"),
        (dict(advantage_estimator="reinforce_pp_baseline", dynamic_sampling=True), "'reinforce_pp_baseline'"),
        (dict(kl_in_reward=True, kl_coef=0.05, dynamic_sampling=True), "kl_in_reward: false"),
        (dict(dynamic_sampling=1), "algorithm.dynamic_sampling: must be true or false"),
        (dict(dynamic_sampling=True, max_sampling_rounds=0), "algorithm.max_sampling_rounds: must be >= 1"),
        (dict(max_sampling_rounds=2.0), "algorithm.max_sampling_rounds: must be >= 1"),
    ],
)
def test_dynamic_sampling_settings_are_checked(settings, match):
    with pytest.raises(ConfigError, match=match):
        AlgorithmConfig(**settings)


def test_dynamic_sampling_is_accepted_for_group_estimators():
    for estimator in ("grpo", "rloo", "dr_grpo", "batch_std"):
        assert AlgorithmConfig(advantage_estimator=estimator, dynamic_sampling=True).dynamic_sampling
    assert AlgorithmConfig(kl_in_reward=True, kl_coef=0.0, dynamic_sampling=True).dynamic_sampling


def test_dynamic_sampling_without_a_rollout_datamodule_is_refused(tokenizer):
    from conftest import make_policy, prompt_batch
    from lit_rlhf import RLHFModule

    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sorted_exactly"],  # 0 everywhere: every group ties, a refill is needed
        algorithm=AlgorithmConfig(group_size=2, dynamic_sampling=True),
        sampling={"max_new_tokens": 2},
    )  # no DataModule handed a prompt supply over (fit with plain dataloaders)
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling: needs more prompts .* RolloutDataModule"):
        module.make_rollout(prompt_batch(tokenizer, ["31>"]))


def test_refill_source_reads_each_rollouts_own_slots():
    reads = []
    refill = refill_source(lambda start: reads.append(start), batch_size=4, rollout=3, max_rounds=3)
    refill(1), refill(2)
    assert reads == [refill_position(3, 1, 3, 4), refill_position(3, 2, 3, 4)] == [16, 20]
