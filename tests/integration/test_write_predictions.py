"""`WritePredictions`: `trainer.predict`'s rows land in a JSON-lines file in prompt order, each score the reward
of its own response (recomputed here with the reward function); an existing file is refused before anything is
generated; a failed run leaves an earlier file as it was and its rows so far in `<path>.partial`."""

from __future__ import annotations

import json

import pytest

from conftest import make_policy, make_trainer
from lit_rlhf import ConfigError, RLHFModule, RolloutDataModule, SamplingConfig, WritePredictions
from lit_rlhf.tasks.digits import sort_digits_reward

PROMPTS = ["312>", "9051>", "77>", "4>", "860>"]

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*")


class FailingOnSecondBatch:
    """`sort_digits_reward` for the first batch of prompts, then an error."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, responses, **meta):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("reward server went away")
        return sort_digits_reward(prompts, responses)


def module(tokenizer, reward=sort_digits_reward) -> RLHFModule:
    return RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[reward],
        sampling=SamplingConfig(max_new_tokens=6),
        log_samples_every_n_steps=0,
    )


def predict(rlhf: RLHFModule, writer: WritePredictions) -> None:
    data = RolloutDataModule(prompts=["1>"], predict_prompts=PROMPTS, batch_size=1, val_batch_size=2)
    make_trainer(max_steps=1, callbacks=[writer]).predict(rlhf, datamodule=data, return_predictions=False)


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_in_prompt_order_scored_by_the_reward(tokenizer, tmp_path):
    path = tmp_path / "out" / "replies.jsonl"  # a folder that does not exist yet
    rlhf = module(tokenizer)
    predict(rlhf, WritePredictions(str(path)))
    rows = read_rows(path)
    assert [row["prompt"] for row in rows] == PROMPTS  # 3 batches of at most 2, none lost or repeated
    assert [row["response"] for row in rows] == rlhf.generate(PROMPTS)  # greedy, so the same replies
    expected = sort_digits_reward(PROMPTS, [row["response"] for row in rows])
    assert [row["score"] for row in rows] == pytest.approx(expected, abs=1e-6)
    assert not (tmp_path / "out" / "replies.jsonl.partial").exists()


def test_an_existing_file_is_refused_before_generating(tokenizer, tmp_path):
    path = tmp_path / "replies.jsonl"
    path.write_text("earlier\n")
    reward = FailingOnSecondBatch()
    with pytest.raises(ConfigError, match=r"WritePredictions.path: .*replies.jsonl.* already exists.*overwrite"):
        predict(module(tokenizer, reward), WritePredictions(str(path)))
    assert reward.calls == 0 and path.read_text() == "earlier\n"


def test_a_failed_run_keeps_the_earlier_file_and_its_rows_so_far(tokenizer, tmp_path):
    path = tmp_path / "replies.jsonl"
    path.write_text("earlier\n")
    with pytest.raises(RuntimeError, match="reward server went away"):
        predict(module(tokenizer, FailingOnSecondBatch()), WritePredictions(str(path), overwrite=True))
    assert path.read_text() == "earlier\n"
    assert [row["prompt"] for row in read_rows(tmp_path / "replies.jsonl.partial")] == PROMPTS[:2]
    predict(module(tokenizer), WritePredictions(str(path), overwrite=True))  # a complete run replaces it
    assert [row["prompt"] for row in read_rows(path)] == PROMPTS
