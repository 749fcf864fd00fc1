"""DDP on two CPU processes (gloo), PPO and GRPO: prompts sharded per rank with each prompt's G samples on one
rank, logged metrics reduced across ranks, weights identical on both ranks after every step, and an exact
resume with every rank's own RNG stream.

The fits run in `tests/ddp_run.py`, one process per rank with `strategy="ddp"`; each rank writes what it saw to
JSON and this test compares the files.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest

from conftest import free_port, run_ranks
from lit_rlhf.tasks.digits import sort_digits_prompts

pytestmark = pytest.mark.slow  # end-to-end: a real fit, several processes or a pretrained model

SCRIPT = Path(__file__).with_name("ddp_run.py")
ALGORITHMS = ("ppo", "grpo")
ROLLOUTS, BATCH, STEPS_PER_ROLLOUT = 4, 2, 2  # as in ddp_run.py: batch of 2 prompts per rank, 2 minibatches
UNTIMED = ("time/", "perf/")


@pytest.fixture(scope="module")
def ddp_records(tmp_path_factory):
    """Both ranks started here with LOCAL_RANK set, as torchrun or a cluster would, so Lightning's DDP strategy
    does not launch rank 1 itself and the two processes import in parallel (half the start-up time)."""
    out = tmp_path_factory.mktemp("ddp")
    command = [
        sys.executable,
        str(SCRIPT),
        "--out",
        str(out),
        "--algorithms",
        ",".join(ALGORITHMS),
        "--rollouts",
        str(ROLLOUTS),
        "--batch-size",
        str(BATCH),
        "--resume",
    ]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", NODE_RANK="0")
    ranks = run_ranks(
        [command, command],
        [dict(env, LOCAL_RANK=str(rank)) for rank in (0, 1)],
        out,
        240,
        "the DDP run did not finish in time (a hung collective?)",
    )
    errors = {p.name: p.read_text() for p in out.glob("error_rank*.txt")}
    assert [rank.returncode for rank in ranks] == [0, 0] and not errors, f"{errors}\n{ranks[0].stderr[-3000:]}"
    records = {}
    for name, run, rank in itertools.product(ALGORITHMS, ("full", "resumed"), (0, 1)):
        records[name, run, rank] = json.loads((out / f"{name}_{run}_rank{rank}.json").read_text())
    return records


@pytest.mark.parametrize("name", ALGORITHMS)
def test_prompts_are_sharded_by_rank_and_groups_stay_on_one_rank(ddp_records, name):
    ranks = [ddp_records[name, "full", r] for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    G = ranks[0]["group_size"]
    # the global prompt order of the built-in stream (data seed 0): row i goes to rank i % 2
    stream = [row["prompt"] for row in itertools.islice(sort_digits_prompts(seed=0), 2 * BATCH * ROLLOUTS)]
    for rank, record in enumerate(ranks):
        assert len(record["rollouts"]) == ROLLOUTS
        seen = []
        for rollout in record["rollouts"]:
            texts = rollout["prompts"]
            assert len(texts) == BATCH * G
            groups = [texts[i : i + G] for i in range(0, len(texts), G)]
            assert all(len(set(group)) == 1 for group in groups)  # a prompt's G samples are consecutive, here
            seen.extend(group[0] for group in groups)
        assert seen == stream[rank::2]
    # the two ranks sampled different prompts at every step
    for a, b in zip(ranks[0]["rollouts"], ranks[1]["rollouts"]):
        assert a["prompts"] != b["prompts"]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_weights_are_identical_on_both_ranks_after_every_step(ddp_records, name):
    r0, r1 = (ddp_records[name, "full", r]["steps"] for r in (0, 1))
    assert [s["global_step"] for s in r0] == [STEPS_PER_ROLLOUT * (i + 1) for i in range(ROLLOUTS)]
    assert [s["checksum"] for s in r0] == [s["checksum"] for s in r1]
    assert len({s["checksum"] for s in r0}) == ROLLOUTS  # and they moved at every step


@pytest.mark.parametrize("name", ALGORITHMS)
def test_logged_metrics_are_the_mean_over_ranks(ddp_records, name):
    records = [ddp_records[name, "full", r] for r in (0, 1)]
    for step in range(ROLLOUTS):
        logged = [rec["steps"][step]["logged"] for rec in records]
        local = [rec["rollouts"][step]["local"] for rec in records]
        # both ranks hold the same reduced value...
        assert {k: v for k, v in logged[0].items() if not k.startswith(UNTIMED)} == {
            k: v for k, v in logged[1].items() if not k.startswith(UNTIMED)
        }
        # ...which is the mean of the two ranks' own values
        for key in ("rollout/score_mean", "rollout/response_len_mean", "rollout/frac_truncated", "objective/kl"):
            assert logged[0][key] == pytest.approx((local[0][key] + local[1][key]) / 2, rel=1e-5, abs=1e-7), key
        if step == 0:  # the reduction is visible: the ranks' own values differ somewhere
            assert any(local[0][k] != local[1][k] for k in ("rollout/score_mean", "rollout/response_len_mean"))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_ddp_resume_from_the_midway_checkpoint_is_exact_on_every_rank(ddp_records, name):
    for rank in (0, 1):
        full, resumed = ddp_records[name, "full", rank], ddp_records[name, "resumed", rank]
        half = len(full["steps"]) // 2
        assert [s["global_step"] for s in resumed["steps"]] == [s["global_step"] for s in full["steps"][half:]]
        assert [s["checksum"] for s in resumed["steps"]] == [s["checksum"] for s in full["steps"][half:]]
        for a, b in zip(full["steps"][half:], resumed["steps"]):
            assert {k: v for k, v in a["logged"].items() if not k.startswith(UNTIMED)} == {
                k: v for k, v in b["logged"].items() if not k.startswith(UNTIMED)
            }
        # the ranks sampled with different random streams, so restoring only rank 0's would not be exact
        assert [r["prompts"] for r in resumed["rollouts"]] == [r["prompts"] for r in full["rollouts"][half:]]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_validation_means_are_exact_over_uneven_shards(ddp_records, name):
    """5 held-out prompts on 2 ranks (3 and 2, none dropped or repeated): the logged mean is the mean over all 5
    answers (sums and counts reduced), not the mean of the two ranks' means."""
    first, second = ddp_records[name, "full", 0]["val"], ddp_records[name, "full", 1]["val"]
    assert (len(first["prompts"]), len(second["prompts"])) == (3, 2)
    assert sorted(first["prompts"] + second["prompts"]) == sorted(["312>", "9051>", "77>", "4820>", "16>"])
    exact = (sum(first["scores"]) + sum(second["scores"])) / 5
    mean_of_means = (sum(first["scores"]) / 3 + sum(second["scores"]) / 2) / 2
    assert first["metric"] == pytest.approx(exact, abs=1e-6) and second["metric"] == pytest.approx(exact, abs=1e-6)
    assert abs(exact - mean_of_means) > 1e-3  # the two reductions differ here, so the check above can tell
