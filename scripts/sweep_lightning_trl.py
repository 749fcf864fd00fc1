"""Lightning's trainer flags and callbacks and TRL's reward habits, each tried on a tiny GRPO run on the CPU; one
line each: OK (it ran) or ERR (the error it got). The tables in docs/lightning-tools.md ("Every flag and callback
tried") and docs/migrating-from-trl.md ("TRL's habits, tried") record a run of it.

    python scripts/sweep_lightning_trl.py              # every move (about four minutes on one CPU core)
    python scripts/sweep_lightning_trl.py timer barebones
"""

import asyncio
import functools
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
import lightning as L
import numpy as np
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
        tokenizer=kw.pop("tokenizer", builtin_tokenizer()),
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


# A second round, moves written after issue 50: each checks the effect a silent failure would hide.


def chat_tokenizer():
    """The digits tokenizer with a chat template that writes each message's text."""
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def score_of(trainer_):
    return float(trainer_.callback_metrics["rollout/score_mean"])


@case
def trl_reward_numpy_array(r):
    def as_array(completions, **kw):
        return np.array([float(len(c)) for c in completions])

    t = trainer(r, max_steps=1)
    t.fit(module(reward_fns=as_array), data())
    assert score_of(t) > 0  # the lengths, not zeros


@case
def trl_reward_tensor_with_grad(r):
    weight = torch.ones((), requires_grad=True)  # a judge model's output, still attached to its graph

    def judged(completions, **kw):
        return weight * torch.tensor([float(len(c)) for c in completions])

    trainer(r, max_steps=1).fit(module(reward_fns=judged), data())


@case
def trl_reward_bools(r):
    def is_sorted(completions, **kw):
        return [list(c) == sorted(c) for c in completions]

    trainer(r, max_steps=1).fit(module(reward_fns=is_sorted), data())


@case
def trl_reward_kwargs_only(r):
    seen = {}

    def by_keyword(**kwargs):
        seen.update(kwargs)
        return [1.0] * len(kwargs["completions"])

    trainer(r, max_steps=1).fit(module(reward_fns=by_keyword), data())
    assert {"prompts", "completions"} <= set(seen), sorted(seen)


@case
def trl_reward_partial(r):
    def near(completions, target, **kw):
        return [-abs(target - len(c)) for c in completions]

    t = trainer(r, max_steps=1)
    t.fit(module(reward_fns=[functools.partial(near, target=2), functools.partial(near, target=4)]), data())
    assert {"reward/near_1/mean", "reward/near_2/mean"} <= set(t.callback_metrics), sorted(t.callback_metrics)


@case
def reward_callable_object(r):
    class Judge:
        def __call__(self, prompts, responses, **meta):
            return [1.0] * len(responses)

    t = trainer(r, max_steps=1)
    t.fit(module(reward_fns=[Judge(), reward]), data())
    assert "reward/Judge/mean" in t.callback_metrics


@case
def trl_reward_nan(r):
    def undecided(completions, **kw):
        return [float("nan")] * len(completions)

    trainer(r, max_steps=1).fit(module(reward_fns=undecided), data())


@case
def trl_conversational_prompt_column(r):
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS]

    def reply_length(completions, **kw):  # TRL's conversational form: each completion a list of messages
        return [float(len(c[0]["content"])) for c in completions]

    t = trainer(r, max_steps=1)
    dm = RolloutDataModule(prompts=rows, batch_size=2, max_prompt_length=16)
    t.fit(module(tokenizer=chat_tokenizer(), reward_fns=reply_length), dm)


@case
def hf_dataset_with_messages_column(r):
    import datasets

    rows = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": p}] for p in PROMPTS]})
    t = trainer(r, max_steps=1)
    t.fit(module(tokenizer=chat_tokenizer()), RolloutDataModule(prompts=rows, batch_size=2, max_prompt_length=16))


@case
def hf_dataset_with_prompt_column(r):
    import datasets

    rows = datasets.Dataset.from_dict({"prompt": PROMPTS, "target": list(range(len(PROMPTS)))})
    seen = []

    def with_target(prompts, responses, target, **meta):
        seen.extend(target)
        return [0.0] * len(responses)

    trainer(r, max_steps=1).fit(module(reward_fns=with_target), RolloutDataModule(prompts=rows, batch_size=2))
    assert seen and all(isinstance(x, int) for x in seen), seen


@case
def fit_with_the_datamodules_dataloader(r):
    dm = data(tokenizer=builtin_tokenizer())
    dm.setup("fit")
    trainer(r).fit(module(), dm.train_dataloader())


@case
def log_every_n_steps_above_max_steps(r):
    with tempfile.TemporaryDirectory() as logs:
        trainer(r, log_every_n_steps=50, logger=L.pytorch.loggers.CSVLogger(logs)).fit(module(), data())


@case
def precision_16_mixed_on_cpu(r):
    trainer(r, precision="16-mixed").fit(module(), data())


@case
def accelerator_and_devices_auto(r):
    trainer(r, accelerator="auto", devices="auto").fit(module(), data())


@case
def fractional_limits(r):
    t = trainer(r, max_steps=-1, max_epochs=1, limit_train_batches=0.5, val_check_interval=0.5)
    t.fit(module(), data())
    assert t.global_step > 0


@case
def max_epochs_only(r):
    t = trainer(r, max_steps=-1, max_epochs=1)
    t.fit(module(), data())
    assert t.fit_loop.epoch_loop.batch_idx + 1 == len(PROMPTS) // 2  # one pass over the prompts


@case
def trl_reward_solution_column(r):
    rows = [{"prompt": p, "solution": "".join(sorted(p[:-1]))} for p in PROMPTS]

    def accuracy(completions, solution, **kw):
        return [float(c.startswith(s)) for c, s in zip(completions, solution, strict=True)]

    trainer(r, max_steps=1).fit(module(reward_fns=accuracy), RolloutDataModule(prompts=rows, batch_size=2))


@case
def reward_model_logits_column(r):
    def logits(completions, **kw):
        return torch.zeros(len(completions), 1)  # a sequence classifier's (B, 1) logits

    trainer(r, max_steps=1).fit(module(reward_fns=logits), data())


@case
def reward_fns_tuple_weights_array(r):
    t = trainer(r, max_steps=1)
    t.fit(module(reward_fns=(reward, reward), reward_weights=np.array([1.0, 0.0])), data())


@case
def default_trainer_checkpoint_and_resume(r):
    L.Trainer(max_steps=2, default_root_dir=r, enable_progress_bar=False).fit(module(), data())
    saved = [f for _, _, files in os.walk(r) for f in files if f.endswith(".ckpt")]
    assert saved, "no checkpoint under default_root_dir"
    t = L.Trainer(max_steps=3, default_root_dir=r, enable_progress_bar=False)
    t.fit(module(), data(), ckpt_path="last")
    assert t.global_step == 3, t.global_step


@case
def own_configure_optimizers_sgd(r):
    class WithSGD(RLHFModule):
        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    torch.manual_seed(0)
    m = WithSGD(policy=builtin_policy(n_layer=1, n_embd=32, n_head=2), tokenizer=builtin_tokenizer(), reward_fns=reward)
    before = [p.detach().clone() for p in m.parameters() if p.requires_grad]
    trainer(r).fit(m, data())
    after = [p for p in m.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)), "SGD changed nothing"


@case
def precision_bf16_true(r):
    trainer(r, precision="bf16-true").fit(module(), data())


@case
def seed_everything_twice_same_run(r):
    runs = []
    for _ in range(2):
        L.seed_everything(7, workers=True)
        m = RLHFModule(
            policy=builtin_policy(n_layer=1, n_embd=32, n_head=2), tokenizer=builtin_tokenizer(), reward_fns=reward
        )
        trainer(r).fit(m, data())
        runs.append(torch.cat([p.detach().flatten() for p in m.parameters() if p.requires_grad]))
    assert torch.equal(runs[0], runs[1]), "two seeded runs differ"


@case
def trl_max_prompt_length_none(r):
    RolloutDataModule(prompts=PROMPTS, batch_size=2, max_prompt_length=None)  # type: ignore[arg-type]  # as a TRL user writes it


@case
def trl_temperature_zero(r):
    SamplingConfig(max_new_tokens=4, temperature=0.0)


@case
def trl_top_k_zero(r):
    algorithm = AlgorithmConfig(group_size=2)
    m = RLHFModule(
        policy=builtin_policy(n_layer=1, n_embd=32, n_head=2),
        tokenizer=builtin_tokenizer(),
        reward_fns=reward,
        algorithm=algorithm,
        sampling=SamplingConfig(max_new_tokens=4, top_k=0),
    )
    trainer(r, max_steps=1).fit(m, data())


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
