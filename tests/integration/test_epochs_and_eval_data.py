"""Epochs and held-out prompts in `RolloutDataModule`: one epoch is one pass over this rank's share of a finite
prompt set (or `rollouts_per_epoch` batches), resume mid-epoch yields exactly the rest of the epoch, and the
validation/test/predict sets are read in file order, sharded row by row without loss or duplication. Expected
values are written out by hand or computed here independently of the library."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_rlhf import AlgorithmConfig, ConfigError, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.tasks.digits import sort_digits_prompts

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*"),
]


@dataclass
class FakeTrainer:
    """What `RolloutDataModule.setup` and the dataloaders read from a Trainer."""

    global_rank: int = 0
    world_size: int = 1
    current_epoch: int | None = None
    lightning_module: object = None
    training: bool = False


def prompts(n: int) -> list[str]:
    return [f"{i}>" for i in range(n)]


def datamodule(tokenizer, rank: int = 0, world: int = 1, stage: str = "fit", **kwargs) -> RolloutDataModule:
    kwargs = {"batch_size": 2, "max_prompt_length": 16, "tokenizer": tokenizer, **kwargs}
    dm = RolloutDataModule(**kwargs)
    dm.trainer = FakeTrainer(global_rank=rank, world_size=world)
    dm.setup(stage)
    return dm


def epoch(loader) -> list[list[str]]:
    """One `iter()`: the texts of each batch."""
    return [batch.texts for batch in loader]


def rows_of(loader) -> list[str]:
    """One `iter()`: the texts of all batches in order."""
    return [text for batch in loader for text in batch.texts]


# ----------------------------------------------------------------------------- epochs over a finite prompt set


def test_batches_per_epoch_with_one_and_two_ranks_drop_the_tail(tokenizer):
    # 11 prompts, one rank, 3 per batch: 3 batches (rows 9 and 10 are the dropped tail)
    loader = datamodule(tokenizer, prompts=prompts(11), batch_size=3, shuffle=False).train_dataloader()
    assert len(loader) == 3
    assert epoch(loader) == [["0>", "1>", "2>"], ["3>", "4>", "5>"], ["6>", "7>", "8>"]]
    # 11 prompts, two ranks, 2 per batch: row 10 is left out so both ranks get 5; 2 batches each (tail of 1)
    rank0 = datamodule(tokenizer, 0, 2, prompts=prompts(11), shuffle=False).train_dataloader()
    rank1 = datamodule(tokenizer, 1, 2, prompts=prompts(11), shuffle=False).train_dataloader()
    assert len(rank0) == len(rank1) == 2
    assert epoch(rank0) == [["0>", "2>"], ["4>", "6>"]]
    assert epoch(rank1) == [["1>", "3>"], ["5>", "7>"]]
    # the next iter() is the next pass, and then the iterable stops again
    assert epoch(rank0) == [["0>", "2>"], ["4>", "6>"]]


def test_each_epoch_is_a_new_shuffle_of_the_same_rows(tokenizer):
    loader = datamodule(tokenizer, prompts=prompts(8), seed=5).train_dataloader()
    seen = [rows_of(loader) for _ in range(3)]
    for number, rows in enumerate(seen):  # pass p is random.Random(seed + p).shuffle of the rows
        order = list(range(8))
        random.Random(5 + number).shuffle(order)
        assert rows == [f"{i}>" for i in order]
        assert sorted(rows) == sorted(prompts(8))
    assert seen[0] != seen[1] != seen[2]


def test_the_last_batch_of_a_pass_is_stamped_with_the_next_pass_start(tokenizer):
    # 9 rows, batches of 2: positions 2, 4, 6, then 9 (row 8 is the dropped tail), then 11, ...
    loader = datamodule(tokenizer, prompts=prompts(9), shuffle=False).train_dataloader()
    assert [b.position for b in loader] == [2, 4, 6, 9]
    assert [b.position for b in loader] == [11, 13, 15, 18]


@pytest.mark.parametrize("world", [1, 2])
def test_resume_mid_epoch_yields_exactly_the_rest_of_the_epoch(tokenizer, world):
    kwargs = dict(prompts=prompts(13), batch_size=2, seed=3)
    for rank in range(world):
        full = datamodule(tokenizer, rank, world, **kwargs).train_dataloader()
        epochs = [list(full) for _ in range(4)]
        per_epoch = len(epochs[0])
        assert per_epoch == (13 // world) // 2
        texts = [[b.texts for b in batches] for batches in epochs]
        for e, k in [(0, 0), (0, 1), (1, 0), (1, per_epoch - 1), (2, 2)]:  # stopped after batch k of epoch e
            resumed = RolloutDataModule(tokenizer=tokenizer, max_prompt_length=16, **kwargs)
            resumed.load_state_dict({"prompt_stream": {"rows_consumed": epochs[e][k].position}})
            resumed.trainer = FakeTrainer(global_rank=rank, world_size=world, current_epoch=e)
            resumed.setup("fit")
            loader = resumed.train_dataloader()
            if k + 1 < per_epoch:
                assert epoch(loader) == texts[e][k + 1 :]
                resumed.trainer.current_epoch = e + 1
            # then the next epoch in full (at once when the epoch's last batch was the last one trained)
            assert epoch(loader) == texts[e + 1]


def test_an_epoch_cut_short_is_not_continued_by_the_next(tokenizer):
    """After `limit_train_batches` stopped epoch 0 early, epoch 1 starts at the first batch of pass 1."""
    dm = datamodule(tokenizer, prompts=prompts(6), shuffle=False)
    loader = dm.train_dataloader()
    first = next(iter(loader))
    assert first.texts == ["0>", "1>"]
    dm.trainer.current_epoch = 1
    assert epoch(loader) == [["0>", "1>"], ["2>", "3>"], ["4>", "5>"]]
    assert loader.prompts.rows_consumed == 12  # end of pass 1


# ----------------------------------------------------------------------------- rollouts_per_epoch


def test_rollouts_per_epoch_on_a_builtin_stream(tokenizer):
    stream = [row["prompt"] for row in itertools.islice(sort_digits_prompts(seed=7), 40)]
    default = datamodule(tokenizer, prompts="builtin:digits", seed=7).train_dataloader()
    assert len(default) == 100
    for rank in (0, 1):
        loader = datamodule(
            tokenizer, rank, 2, prompts="builtin:digits", seed=7, rollouts_per_epoch=3
        ).train_dataloader()
        assert len(loader) == 3
        mine = stream[rank::2]  # row i of the stream goes to rank i % 2
        assert epoch(loader) == [mine[0:2], mine[2:4], mine[4:6]]
        assert epoch(loader) == [mine[6:8], mine[8:10], mine[10:12]]


def test_rollouts_per_epoch_on_a_list_runs_passes_end_to_end(tokenizer):
    # 5 rows, batches of 2: each pass is [0, 1], [2, 3] (row 4 dropped); epochs of 3 batches straddle passes
    loader = datamodule(tokenizer, prompts=prompts(5), shuffle=False, rollouts_per_epoch=3).train_dataloader()
    assert len(loader) == 3
    assert epoch(loader) == [["0>", "1>"], ["2>", "3>"], ["0>", "1>"]]
    assert epoch(loader) == [["2>", "3>"], ["0>", "1>"], ["2>", "3>"]]


# ----------------------------------------------------------------------------- held-out prompts


def test_val_fraction_is_disjoint_from_training_and_reproducible(tokenizer):
    rows = prompts(20)
    dm = datamodule(tokenizer, prompts=rows, val_prompts=0.25, seed=4)
    val = rows_of(dm.val_dataloader())
    assert len(val) == 5  # ceil(0.25 x 20)
    assert val == sorted(val, key=rows.index)  # file order
    train_rows = [r["prompt"] for r in dm.source]
    assert sorted(train_rows + val) == sorted(rows) and not set(train_rows) & set(val)
    loader = dm.train_dataloader()
    assert len(loader) == 15 // 2
    for _ in range(3):  # no training epoch ever contains a held-out row
        assert not set(rows_of(loader)) & set(val)
    assert rows_of(datamodule(tokenizer, prompts=rows, val_prompts=0.25, seed=4).val_dataloader()) == val
    assert rows_of(datamodule(tokenizer, prompts=rows, val_prompts=0.25, seed=5).val_dataloader()) != val
    # test and predict default to the validation prompts
    assert rows_of(dm.test_dataloader()) == rows_of(dm.predict_dataloader()) == val


def test_held_out_prompts_are_sharded_row_by_row_in_file_order(tokenizer, tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "i": i}) + "\n" for i, p in enumerate(prompts(7))))
    shards = {}
    for rank in range(3):
        dm = datamodule(tokenizer, rank, 3, prompts=prompts(12), val_prompts=str(path), val_batch_size=2)
        loader = dm.val_dataloader()
        shards[rank] = list(loader)
        assert len(loader) == len(shards[rank])
    # rank r gets rows r, r + 3, ...: 3, 2 and 2 rows; batches of at most 2, nothing dropped or repeated
    assert [b.texts for b in shards[0]] == [["0>", "3>"], ["6>"]]
    assert [b.texts for b in shards[1]] == [["1>", "4>"]]
    assert [b.texts for b in shards[2]] == [["2>", "5>"]]
    assert sorted(i for batches in shards.values() for b in batches for i in b.meta["i"]) == list(range(7))
    # batches of 2 prompts, left padded like the training batches
    assert shards[0][1].input_ids.shape == (1, 2) and shards[0][0].attention_mask.tolist() == [[1, 1], [1, 1]]


def test_test_and_predict_prompts_of_their_own(tokenizer, tmp_path):
    path = tmp_path / "test.txt"
    path.write_text("7>\n\n8>\n9>\n")
    dm = datamodule(
        tokenizer, prompts=prompts(4), val_prompts=["a>"], test_prompts=str(path), predict_prompts=["5>", "6>"]
    )
    assert epoch(dm.val_dataloader()) == [["a>"]]
    assert epoch(dm.test_dataloader()) == [["7>", "8>"], ["9>"]]
    assert epoch(dm.predict_dataloader()) == [["5>", "6>"]]


def test_builtin_held_out_prompts_are_val_size_rows_of_a_seed_of_their_own(tokenizer):
    dm = datamodule(tokenizer, prompts="builtin:digits", val_prompts="builtin:digits", val_size=5, seed=0)
    val = rows_of(dm.val_dataloader())
    assert len(val) == 5
    assert val != [row["prompt"] for row in itertools.islice(sort_digits_prompts(seed=0), 5)]  # not training's
    other = datamodule(tokenizer, prompts="builtin:digits", val_prompts="builtin:digits", val_size=5, seed=9)
    assert rows_of(other.val_dataloader()) == val  # the same whatever data.seed is


def test_no_held_out_prompts_gives_empty_loaders(tokenizer):
    dm = datamodule(tokenizer, prompts=prompts(4))
    assert dm.val_dataloader() == [] and dm.test_dataloader() == [] and dm.predict_dataloader() == []


def test_meta_is_the_union_of_the_rows_columns(tokenizer):
    rows = [{"prompt": "1>", "a": 1}, {"prompt": "2>", "b": "x"}, {"prompt": "3>", "a": 3, "c": None}]
    batch = PromptTokenizer(tokenizer, 16, "error", "prompt")(rows)
    assert batch.meta == {"a": [1, None, 3], "b": [None, "x", None], "c": [None, None, None]}
    dm = datamodule(tokenizer, prompts=prompts(4), val_prompts=rows, val_batch_size=3)
    assert next(iter(dm.val_dataloader())).meta == batch.meta


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(rollouts_per_epoch=0), "data.rollouts_per_epoch: must be >= 1, got 0"),
        (dict(val_batch_size=0), "data.val_batch_size: must be >= 1, got 0"),
        (dict(val_size=0), "data.val_size: must be >= 1, got 0"),
        (dict(max_prompt_length=None), r"data.max_prompt_length: must be an integer, got None; TRL's None \(no limit"),
        (dict(batch_size=2.0), "data.batch_size: must be an integer, got 2.0"),
        (dict(val_batch_size="4"), "data.val_batch_size: must be an integer or None, got '4'"),
        (dict(val_prompts=1.5), "data.val_prompts: .*between 0 and 1.*got 1.5"),
        (dict(val_prompts=0.0), "data.val_prompts: .*between 0 and 1.*got 0.0"),
        (dict(val_prompts=0.9), "data.val_prompts: holding out 0.9 of the 4 prompts leaves none"),
        (dict(prompts="builtin:digits", val_prompts=0.1), "data.val_prompts: a fraction .*'builtin:digits'.*endless"),
        (dict(test_prompts=0.2), "data.test_prompts: got a fraction.*only data.val_prompts"),
        (dict(predict_prompts={"prompt": "1>"}), "data.predict_prompts: got a dict"),
        (dict(val_prompts=[]), "data.val_prompts: the prompt list is empty"),
        (dict(val_prompts=[{"text": "1>"}]), "data.val_prompts: row 0 has no string field 'prompt'"),
        (dict(val_prompts="no_such_file.jsonl"), "data.val_prompts: the file 'no_such_file.jsonl' does not exist"),
        (dict(test_prompts="builtin:chess"), "data.test_prompts: unknown built-in task"),
    ],
)
def test_bad_settings_name_field_value_and_fix(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RolloutDataModule(**{"prompts": prompts(4), **kwargs})


def test_bad_held_out_file_is_named_in_init(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text('{"prompt": "1>"}\n{"question": "2>"}\n')
    with pytest.raises(ConfigError, match=f"data.val_prompts: .*{path.name}:2 has no field 'prompt'"):
        RolloutDataModule(prompts=prompts(4), val_prompts=str(path))


def test_a_prompt_set_smaller_than_one_batch_per_rank_fails_at_setup(tokenizer):
    # 5 prompts, 2 ranks: 2 each per pass, less than a batch of 3
    with pytest.raises(ConfigError, match="data.batch_size: 3 prompts per process.*only 2 per pass.*lower"):
        datamodule(tokenizer, 1, 2, prompts=prompts(5), batch_size=3)
    with pytest.raises(ConfigError, match=r"data.batch_size: .*\(2 went to data.val_prompts\).*only 3 per pass"):
        datamodule(tokenizer, prompts=prompts(5), batch_size=4, val_prompts=0.4)
    datamodule(tokenizer, prompts=prompts(5), batch_size=3, stage="validate")  # only fitting needs a batch
    with pytest.raises(ConfigError, match="data.prompts: 1 prompts for 2 processes"):
        datamodule(tokenizer, 1, 2, prompts=prompts(1), batch_size=1)


def test_a_held_out_prompt_over_the_length_limit_fails_at_setup(tokenizer):
    with pytest.raises(ConfigError, match="data.max_prompt_length: prompt #1 of data.val_prompts has 6 tokens"):
        datamodule(tokenizer, prompts=prompts(4), val_prompts=["1>", "12345>"], max_prompt_length=5)


# ----------------------------------------------------------------------------- under a Trainer


class Recorder(L.LightningModule):
    """Records the texts of every training and validation batch; one (no-op) optimizer step per batch, so
    `global_step` counts batches and checkpoints can be written every step."""

    def __init__(self, tokenizer):
        super().__init__()
        self.automatic_optimization = False
        self.tokenizer = tokenizer
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_texts: list[list[str]] = []
        self.val_texts: list[list[str]] = []

    def training_step(self, batch, batch_idx):
        self.train_texts.append(list(batch.texts))
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.weight.sum() * 0.0)
        optimizer.step()

    def validation_step(self, batch, batch_idx):
        self.val_texts.append(list(batch.texts))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def quiet_trainer(**kwargs) -> L.Trainer:
    settings = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **kwargs})


def test_max_epochs_limit_train_batches_and_the_stepping_estimate(tokenizer):
    module = Recorder(tokenizer)
    trainer = quiet_trainer(max_epochs=2)
    trainer.fit(module, RolloutDataModule(prompts=prompts(6), batch_size=2, shuffle=False, tokenizer=tokenizer))
    assert trainer.num_training_batches == 3 and trainer.estimated_stepping_batches == 6
    assert module.train_texts == [["0>", "1>"], ["2>", "3>"], ["4>", "5>"]] * 2
    assert trainer.current_epoch == 2 and module.val_texts == []  # no val prompts: no validation

    module = Recorder(tokenizer)
    data = RolloutDataModule(prompts=prompts(6), batch_size=2, seed=1, tokenizer=tokenizer)
    quiet_trainer(max_epochs=2, limit_train_batches=2).fit(module, data)
    passes = []
    for number in range(2):  # each epoch is the first 2 batches of its own pass
        order = list(range(6))
        random.Random(1 + number).shuffle(order)
        passes.append([[f"{order[0]}>", f"{order[1]}>"], [f"{order[2]}>", f"{order[3]}>"]])
    assert module.train_texts == passes[0] + passes[1]


def test_validation_runs_on_the_held_out_prompts_in_order_without_moving_the_training_position(tokenizer):
    module = Recorder(tokenizer)
    data = RolloutDataModule(
        prompts=prompts(4), val_prompts=["a>", "b>", "c>"], val_batch_size=2, batch_size=2, tokenizer=tokenizer
    )
    trainer = quiet_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert module.val_texts == [["a>", "b>"], ["c>"]]  # once, at the end of the epoch
    assert data.state_dict() == {"prompt_stream": {"rows_consumed": 4}}  # the end of the training pass


class Interrupt(Exception):
    pass


class StopAt(Callback):
    """Stands for a crash before the first batch at or past `step`; the checkpoints written so far stay."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise Interrupt(f"stopped at step {trainer.global_step}")


@pytest.mark.parametrize("stop_at", [2, 3, 4])  # mid-epoch 0, at the end of epoch 0 (on its last batch), mid-epoch 1
def test_a_run_resumed_mid_epoch_sees_exactly_the_batches_of_the_uninterrupted_run(tokenizer, tmp_path, stop_at):
    def data():
        return RolloutDataModule(prompts=prompts(7), batch_size=2, seed=2, tokenizer=tokenizer)  # 3 batches a pass

    whole = Recorder(tokenizer)
    quiet_trainer(max_epochs=3).fit(whole, data())
    assert len(whole.train_texts) == 9

    first = Recorder(tokenizer)
    save = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(Interrupt):
        quiet_trainer(max_epochs=3, callbacks=[save, StopAt(stop_at)], enable_checkpointing=True).fit(first, data())
    assert first.train_texts == whole.train_texts[:stop_at]

    rest = Recorder(tokenizer)
    trainer = quiet_trainer(max_epochs=3)
    trainer.fit(rest, data(), ckpt_path=str(tmp_path / f"step={stop_at}.ckpt"))
    assert rest.train_texts == whole.train_texts[stop_at:]
    assert trainer.current_epoch == 3


def test_grpo_on_a_prompt_list_ends_after_max_epochs():
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    data = RolloutDataModule(prompts=[f"{i}{(i * 7) % 10}{(i * 3) % 10}>" for i in range(12)], batch_size=4)
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, data)
    assert trainer.global_step == 6  # 12 prompts / 4 per rollout x 2 epochs, one optimizer step each
    assert trainer.current_epoch == 2
    assert data.state_dict() == {"prompt_stream": {"rows_consumed": 24}}
