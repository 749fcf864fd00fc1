"""Lightning's trainer flags and callbacks and TRL's reward habits, each tried on a tiny GRPO run on the CPU; one
line each: OK (it ran) or ERR (the error it got). The table in docs/migrating-from-trl.md ("Lightning's tools and
TRL's habits, tried") records a run of it.

    python scripts/sweep_lightning_trl.py              # every move (about two minutes on one CPU core)
    python scripts/sweep_lightning_trl.py timer barebones
"""

import asyncio
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
import lightning as L
import torch
from lightning.pytorch import callbacks as cb

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer, sort_digits_score

PROMPTS = ["3142>", "907>", "55>", "1234>", "861>", "2>"]


def reward(prompts, responses, **meta):
    return [sort_digits_score(p, r) for p, r in zip(prompts, responses, strict=True)]


def module(**kw):
    torch.manual_seed(0)
    kw.setdefault("reward_fns", reward)
    return RLHFModule(
        policy=builtin_policy(n_layer=1, n_embd=32, n_head=2),
        tokenizer=builtin_tokenizer(),
        algorithm=kw.pop("algorithm", AlgorithmConfig(group_size=2)),
        sampling=SamplingConfig(max_new_tokens=4),
        log_samples_every_n_steps=0,
        **kw,
    )


def data(**kw):
    return RolloutDataModule(prompts=PROMPTS, batch_size=2, max_prompt_length=8, val_prompts=PROMPTS[:2], **kw)


def trainer(root, **kw):
    base = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        log_every_n_steps=1,
    )
    base.update(kw)
    return L.Trainer(**base)


CASES: dict[str, Callable[[str], None]] = {}


def case(f):
    CASES[f.__name__] = f
    return f


@case
def accumulate_grad_batches(r):
    trainer(r, accumulate_grad_batches=2).fit(module(), data())


@case
def gradient_clip_val(r):
    trainer(r, gradient_clip_val=1.0).fit(module(), data())


@case
def fast_dev_run(r):
    trainer(r, fast_dev_run=True, max_steps=-1).fit(module(), data())


@case
def limit_train_batches(r):
    trainer(r, limit_train_batches=1, max_steps=-1, max_epochs=2).fit(module(), data())


@case
def limit_val_batches_and_val_check_interval(r):
    trainer(r, limit_val_batches=1, val_check_interval=1, max_steps=2).fit(module(), data())


@case
def check_val_every_n_epoch(r):
    trainer(r, check_val_every_n_epoch=1, max_steps=-1, max_epochs=1, limit_train_batches=2).fit(module(), data())


@case
def num_sanity_val_steps(r):
    trainer(r, num_sanity_val_steps=1).fit(module(), data())


@case
def max_time(r):
    trainer(r, max_time={"seconds": 1}, max_steps=-1, max_epochs=100).fit(module(), data())


@case
def precision_bf16_mixed(r):
    trainer(r, precision="bf16-mixed").fit(module(), data())


@case
def precision_64(r):
    trainer(r, precision="64-true").fit(module(), data())


@case
def deterministic(r):
    trainer(r, deterministic=True).fit(module(), data())


@case
def detect_anomaly(r):
    trainer(r, detect_anomaly=True).fit(module(), data())


@case
def profiler_simple(r):
    trainer(r, profiler="simple").fit(module(), data())


@case
def barebones(r):
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, barebones=True, default_root_dir=r).fit(module(), data())


@case
def reload_dataloaders_every_n_epochs(r):
    trainer(r, reload_dataloaders_every_n_epochs=1, max_steps=-1, max_epochs=2, limit_train_batches=1).fit(
        module(), data()
    )


@case
def inference_mode_false(r):
    trainer(r, inference_mode=False).fit(module(), data())


@case
def csv_logger(r):
    trainer(r, logger=L.pytorch.loggers.CSVLogger(r)).fit(module(), data())


@case
def early_stopping(r):
    trainer(
        r,
        max_steps=6,
        callbacks=[cb.EarlyStopping(monitor="rollout/score_mean", patience=1, check_on_train_epoch_end=True)],
        max_epochs=3,
        limit_train_batches=1,
    ).fit(module(), data())


@case
def early_stopping_on_val(r):
    trainer(
        r,
        max_steps=4,
        callbacks=[cb.EarlyStopping(monitor="val/reward_mean", mode="max", patience=1)],
        max_epochs=3,
        limit_train_batches=1,
    ).fit(module(), data())


@case
def learning_rate_monitor(r):
    trainer(r, logger=L.pytorch.loggers.CSVLogger(r), callbacks=[cb.LearningRateMonitor()]).fit(module(), data())


@case
def model_checkpoint_monitor(r):
    trainer(
        r,
        enable_checkpointing=True,
        callbacks=[
            cb.ModelCheckpoint(dirpath=r, monitor="rollout/score_mean", mode="max", save_top_k=1, every_n_train_steps=1)
        ],
    ).fit(module(), data())


@case
def stochastic_weight_averaging(r):
    trainer(
        r,
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=1,
        callbacks=[cb.StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)],
    ).fit(module(), data())


@case
def gradient_accumulation_scheduler(r):
    trainer(r, callbacks=[cb.GradientAccumulationScheduler({0: 2})]).fit(module(), data())


@case
def model_summary(r):
    trainer(r, enable_model_summary=True, callbacks=[cb.ModelSummary(max_depth=2)]).fit(module(), data())


@case
def tqdm_progress_bar(r):
    trainer(r, enable_progress_bar=True, callbacks=[cb.TQDMProgressBar(refresh_rate=1)]).fit(module(), data())


@case
def rich_progress_bar(r):
    trainer(r, enable_progress_bar=True, callbacks=[cb.RichProgressBar()]).fit(module(), data())


@case
def timer(r):
    trainer(r, callbacks=[cb.Timer(duration="00:00:00:30")]).fit(module(), data())


@case
def device_stats_monitor(r):
    trainer(r, logger=L.pytorch.loggers.CSVLogger(r), callbacks=[cb.DeviceStatsMonitor(cpu_stats=False)]).fit(
        module(), data()
    )


@case
def lambda_callback(r):
    seen = []
    trainer(r, callbacks=[cb.LambdaCallback(on_train_batch_end=lambda *a: seen.append(1))]).fit(module(), data())
    assert len(seen) == 2, seen


@case
def throughput_monitor(r):
    trainer(
        r, logger=L.pytorch.loggers.CSVLogger(r), callbacks=[cb.ThroughputMonitor(batch_size_fn=lambda b: len(b.texts))]
    ).fit(module(), data())


@case
def model_pruning(r):
    trainer(r, callbacks=[cb.ModelPruning("l1_unstructured", amount=0.1)]).fit(module(), data())


@case
def weight_averaging_ema(r):
    from lightning.pytorch.callbacks import WeightAveraging

    trainer(r, callbacks=[WeightAveraging()]).fit(module(), data())


@case
def backbone_finetuning(r):
    trainer(r, callbacks=[cb.BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(module(), data())


@case
def validate_without_fit(r):
    trainer(r).validate(module(), data())


@case
def test_and_predict(r):
    t = trainer(r)
    m = module()
    d = data()
    t.test(m, d)
    out = t.predict(m, d)
    assert out


@case
def fit_twice(r):
    m, d = module(), data()
    trainer(r, max_steps=1).fit(m, d)
    trainer(r, max_steps=2).fit(m, d)


@case
def trl_reward_returning_none(r):
    def some_none(completions, **kw):
        return [None] + [1.0] * (len(completions) - 1)

    trainer(r).fit(module(reward_fns=[some_none, reward]), data())


@case
def trl_reward_log_extra(r):
    def with_log_extra(completions, log_extra=None, **kw):
        return [float(len(c)) for c in completions]

    trainer(r).fit(module(reward_fns=with_log_extra), data())


@case
def trl_reward_completion_ids(r):
    def with_ids(completions, completion_ids=None, **kw):
        return [0.0] * len(completions)

    trainer(r).fit(module(reward_fns=with_ids), data())


@case
def trl_async_reward(r):
    async def judge(completions, **kw):
        await asyncio.sleep(0.01)
        return [1.0] * len(completions)

    trainer(r).fit(module(reward_fns=[judge, reward]), data())


@case
def trl_reward_weights_len_mismatch(r):
    module(reward_fns=[reward], reward_weights=[1.0, 2.0])


@case
def trl_num_generations_kw(r):
    module(num_generations=4)


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                CASES[name](root)
                warned = [
                    str(x.message).split("\n")[0][:140]
                    for x in w
                    if "lit_rlhf" in str(x.filename) or "rlhf" in str(x.message).lower()
                ]
                print(f"OK   {name}" + (f"  [warn: {warned[0]}]" if warned else ""), flush=True)
            except BaseException as err:
                msg = " ".join(str(err).split())[:260]
                where = traceback.extract_tb(err.__traceback__)[-1]
                print(
                    f"ERR  {name}: {type(err).__name__}: {msg}  @ {os.path.basename(where.filename)}:{where.lineno}",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1:])
