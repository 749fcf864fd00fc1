"""The Lightning contract of `RLHFModule` (issue 10): the `compute_scores` / `compute_advantages` hooks always
reach the update, every documented form of a `configure_optimizers` override steps as Lightning would step it,
the Trainer's clipping and accumulation knobs are refused naming the module's own settings, a decaying schedule
needs a run length, the user's tokenizer is never changed, greedy decoding is the argmax of full forwards, and
`generate` / `trainer.predict` answer with it. Every expectation is computed here by hand or by a slow loop,
independently of the library."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau
from torch.utils.data import DataLoader

from conftest import checksum, generate, make_policy, make_trainer, prompt_batch
from lit_rlhf import AlgorithmConfig, ConfigError, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.tasks.digits import builtin_tokenizer, sort_digits_reward

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
BASE_LR = 1e-3

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:.*max_epochs.*"),
    pytest.mark.filterwarnings("ignore:.*Total length of `list` across ranks is zero.*"),
]


def char_code_reward(prompts, responses, **meta):
    """Differs between almost any two responses, so group advantages are almost never all zero."""
    return [float(sum(ord(c) * (i + 1) for i, c in enumerate(r)) % 97) / 97 for r in responses]


class CountingReward:
    """A constant reward that counts its calls (each call is one scored rollout); it stops a run that should
    have been refused, instead of letting an endless one go on."""

    def __init__(self, value: float = 0.5, limit: int = 10):
        self.value = value
        self.limit = limit
        self.calls = 0

    def __call__(self, prompts, responses, **meta):
        self.calls += 1
        if self.calls > self.limit:
            raise RuntimeError(f"CountingReward: more than {self.limit} rollouts")
        return [self.value] * len(responses)


class Recorded(RLHFModule):
    """Keeps a copy of every experience the update receives (`on_experience`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []

    def on_experience(self, experience):
        self.seen.append(
            {
                "prompts": list(experience.prompts),
                "responses": list(experience.responses),
                "scores": experience.scores.detach().clone(),
                "advantages": experience.advantages.detach().clone(),
                "mask": experience.response_mask.detach().clone(),
            }
        )


class LRRecorder(Callback):
    """Per training batch: the lr its (first) update used (`step_metrics["optim/lr"]`) and the lr after it."""

    def __init__(self):
        self.used: list[float] = []
        self.after: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.used.append(pl_module.step_metrics["optim/lr"])
        self.after.append(trainer.optimizers[0].param_groups[0]["lr"])


def build(tokenizer, cls=RLHFModule, **kwargs) -> RLHFModule:
    settings = {
        "policy": make_policy(),
        "tokenizer": tokenizer,
        "reward_fns": [REWARD],
        "algorithm": AlgorithmConfig(name="grpo", group_size=2),
        "sampling": SamplingConfig(max_new_tokens=4),
        "lr": BASE_LR,
        "log_samples_every_n_steps": 0,
    }
    return cls(**{**settings, **kwargs})


def digits_data(**kwargs) -> RolloutDataModule:
    return RolloutDataModule(**{"prompts": "builtin:digits", "batch_size": 4, "max_prompt_length": 16, **kwargs})


def fit(module, max_steps: int, data=None, **trainer_kwargs):
    torch.manual_seed(0)  # the same sampling draws for every run
    trainer = make_trainer(max_steps, **trainer_kwargs)
    trainer.fit(module, data if data is not None else digits_data())
    return trainer


def hand_grpo_advantages(scores: list[float], group_size: int, eps: float) -> list[float]:
    """(s - group mean) / (unbiased group std + eps); an all-equal group gets exactly 0."""
    out = []
    for start in range(0, len(scores), group_size):
        group = scores[start : start + group_size]
        if all(s == group[0] for s in group):
            out += [0.0] * group_size
            continue
        mean = sum(group) / group_size
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (group_size - 1))
        out += [(s - mean) / (std + eps) for s in group]
    return out


def hand_greedy(model, input_ids, attention_mask, steps: int, eos_id: int, pad_id: int) -> torch.Tensor:
    """Greedy decoding by full forwards without a cache: every step recomputes the logits of the whole sequence
    (positions that skip the left padding) and appends the argmax; a sequence gets pad after its EOS. (B, steps)."""
    ids, mask = input_ids.clone(), attention_mask.clone()
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            nxt = torch.where(done, torch.full_like(done, pad_id, dtype=torch.long), logits.argmax(-1))
            out.append(nxt)
            done = done | (nxt == eos_id)
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(out, 1)


def hand_text(tokenizer, ids: torch.Tensor) -> str:
    """The tokens before the first EOS, joined (the built-in tokenizer is one character per token)."""
    tokens = []
    for i in ids.tolist():
        if i == tokenizer.eos_token_id:
            break
        tokens.append(tokenizer.convert_ids_to_tokens(i))
    return "".join(tokens)


# ----------------------------------------------------------------------------- 1. hooks for subclasses


class NegatedScores(Recorded):
    def compute_scores(self, prompts, responses, meta, generation):
        return -super().compute_scores(prompts, responses, meta, generation)


class ZeroAdvantages(Recorded):
    def compute_advantages(self, rollout, kl, values):
        return torch.zeros(rollout.response_mask.shape), None


def test_compute_scores_override_drives_the_advantages_and_the_update(tokenizer):
    default = build(tokenizer, Recorded)
    fit(default, max_steps=2)
    negated = build(tokenizer, NegatedScores)
    start = checksum(negated.actor_critic)
    fit(negated, max_steps=2)
    assert len(negated.seen) == 2
    eps = negated.algorithm.group_eps
    for exp in negated.seen:
        # the scores are the override's: minus the reward function's, computed here from the texts
        expected_scores = [-s for s in sort_digits_reward(exp["prompts"], exp["responses"])]
        assert torch.allclose(exp["scores"], torch.tensor(expected_scores), atol=1e-7, rtol=0)
        # and the advantages are the GRPO normalisation of exactly those scores, over each response's tokens
        per_seq = torch.tensor(hand_grpo_advantages(expected_scores, 2, eps))
        assert torch.allclose(exp["advantages"], per_seq[:, None] * exp["mask"].float(), atol=1e-5, rtol=0)
    assert any(exp["advantages"].abs().max() > 0.5 for exp in negated.seen), "no group had different scores"
    # the same seeds draw the same first rollout, so the default run saw the opposite advantages
    first_default, first_negated = default.seen[0], negated.seen[0]
    assert first_default["responses"] == first_negated["responses"]
    assert torch.allclose(first_default["advantages"], -first_negated["advantages"], atol=1e-5, rtol=0)
    # and the override changed what was learned
    assert checksum(negated.actor_critic) != start
    assert checksum(negated.actor_critic) != checksum(default.actor_critic)


def test_compute_advantages_override_of_zero_leaves_the_weights_alone(tokenizer):
    no_kl = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.0, entropy_coef=0.0)
    default = build(tokenizer, Recorded, algorithm=no_kl, reward_fns=[char_code_reward])
    start = checksum(default.actor_critic)
    fit(default, max_steps=2)
    assert any(exp["advantages"].abs().max() > 0 for exp in default.seen)
    assert checksum(default.actor_critic) != start  # the default advantages train

    zero = build(tokenizer, ZeroAdvantages, algorithm=no_kl, reward_fns=[char_code_reward])
    assert checksum(zero.actor_critic) == start  # same initial weights
    trainer = fit(zero, max_steps=2)
    assert trainer.global_step == 2 and len(zero.seen) == 2
    for exp in zero.seen:
        assert torch.equal(exp["advantages"], torch.zeros_like(exp["advantages"]))
    # -A * ratio with A = 0, no KL and no entropy term: zero gradient, so AdamW (no weight decay) moves nothing
    assert all(stats["optim/grad_norm"] == 0.0 for stats in zero.last_update_stats)
    assert checksum(zero.actor_critic) == start


# ----------------------------------------------------------------------------- 2. configure_optimizers overrides


class OptimizerOnly(RLHFModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.trainable_parameters(), lr=0.5)


class EveryOtherStep(RLHFModule):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=BASE_LR)
        scheduler = LambdaLR(optimizer, lambda s: 0.5**s)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


class PerEpoch(RLHFModule):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=BASE_LR)
        scheduler = LambdaLR(optimizer, lambda epoch: 0.5**epoch)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class OnPlateau(RLHFModule):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=BASE_LR)
        scheduler = ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
        config = {"scheduler": scheduler, "monitor": "rollout/reward_mean", "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": config}


class TwoOptimizers(RLHFModule):
    def configure_optimizers(self):
        params = list(self.trainable_parameters())
        return [torch.optim.SGD(params[:1], lr=0.1), torch.optim.SGD(params[1:], lr=0.1)]


def test_optimizer_only_override_trains(tokenizer):
    module = build(tokenizer, OptimizerOnly, reward_fns=[char_code_reward])
    start = checksum(module.actor_critic)
    lrs = LRRecorder()
    trainer = fit(module, max_steps=2, callbacks=[lrs])
    assert trainer.global_step == 2
    assert lrs.used == [0.5, 0.5] and lrs.after == [0.5, 0.5]
    assert checksum(module.actor_critic) != start


def test_step_scheduler_with_frequency_2_steps_every_other_optimizer_step(tokenizer):
    module = build(tokenizer, EveryOtherStep)
    lrs = LRRecorder()
    trainer = fit(module, max_steps=4, callbacks=[lrs])
    assert trainer.global_step == 4
    # stepped after optimizer steps 2 and 4 only: the multiplier is 0.5 ** (steps // 2)
    assert lrs.used == pytest.approx([BASE_LR, BASE_LR, BASE_LR * 0.5, BASE_LR * 0.5], rel=1e-12)
    assert lrs.after == pytest.approx([BASE_LR, BASE_LR * 0.5, BASE_LR * 0.5, BASE_LR * 0.5**2], rel=1e-12)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(BASE_LR * 0.5**2, rel=1e-12)


def test_epoch_scheduler_steps_once_per_pass_over_the_prompts(tokenizer):
    data = RolloutDataModule(prompts=[f"{n}>" for n in range(312, 324)], batch_size=4, max_prompt_length=16)
    module = build(tokenizer, PerEpoch)
    lrs = LRRecorder()
    trainer = fit(module, max_steps=-1, data=data, max_epochs=2, callbacks=[lrs])
    # 12 prompts / 4 per batch = 3 rollouts (one optimizer step each) per epoch
    assert trainer.current_epoch == 2 and trainer.global_step == 6
    assert lrs.used == pytest.approx([BASE_LR] * 3 + [BASE_LR * 0.5] * 3, rel=1e-12)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(BASE_LR * 0.25, rel=1e-12)


def test_reduce_on_plateau_monitoring_the_reward_halves_the_lr_while_it_does_not_improve(tokenizer):
    reward = CountingReward(0.5)
    module = build(tokenizer, OnPlateau, reward_fns=[reward])
    lrs = LRRecorder()
    trainer = fit(module, max_steps=4, callbacks=[lrs], log_every_n_steps=1)
    assert trainer.global_step == 4 and reward.calls == 4
    assert trainer.callback_metrics["rollout/reward_mean"] == pytest.approx(0.5)
    # ReduceLROnPlateau(mode="max", patience=0, factor=0.5) by hand: the first value it sees is its best, every
    # later equal value is a bad epoch beyond the patience and halves the lr
    best, lr, expected_after = -math.inf, BASE_LR, []
    for _ in range(4):
        value = 0.5
        if value > best * (1 + 1e-4):  # the default threshold, relative
            best = value
        else:
            lr *= 0.5
        expected_after.append(lr)
    assert expected_after == [BASE_LR, BASE_LR / 2, BASE_LR / 4, BASE_LR / 8]
    assert lrs.after == pytest.approx(expected_after, rel=1e-12)
    assert lrs.used == pytest.approx([BASE_LR, *expected_after[:-1]], rel=1e-12)


def test_two_optimizers_are_refused_before_any_rollout(tokenizer):
    reward = CountingReward()
    module = build(tokenizer, TwoOptimizers, reward_fns=[reward])
    with pytest.raises(ConfigError, match="exactly one"):
        fit(module, max_steps=2)
    assert reward.calls == 0


# ----------------------------------------------------------------------------- 3. the Trainer's knobs


@pytest.mark.parametrize(
    ("knob", "setting"),
    [
        ({"gradient_clip_val": 0.5}, "model.algorithm.max_grad_norm"),
        ({"accumulate_grad_batches": 2}, "micro_batch_size"),
    ],
)
def test_trainer_clipping_and_accumulation_are_refused_naming_our_settings(tokenizer, knob, setting):
    reward = CountingReward()
    module = build(tokenizer, reward_fns=[reward])
    with pytest.raises(ConfigError, match=setting):
        fit(module, max_steps=1, **knob)
    assert reward.calls == 0


# ----------------------------------------------------------------------------- 4. schedules that need a length


def test_cosine_without_a_run_length_fails_at_fit_start(tokenizer):
    reward = CountingReward()
    module = build(tokenizer, reward_fns=[reward], lr_schedule="cosine")
    with pytest.raises(ConfigError, match="model.lr_schedule"):
        fit(module, max_steps=-1, max_epochs=-1)
    assert reward.calls == 0  # refused before the first rollout


def test_cosine_decays_to_max_steps(tokenizer):
    module = build(tokenizer, lr_schedule="cosine", warmup_steps=0)
    lrs = LRRecorder()
    trainer = fit(module, max_steps=10, callbacks=[lrs])
    assert trainer.global_step == 10
    expected = [BASE_LR * 0.5 * (1 + math.cos(math.pi * k / 10)) for k in range(10)]
    assert lrs.used == pytest.approx(expected, rel=1e-9, abs=1e-15)


# ----------------------------------------------------------------------------- 5. the user's objects


def test_the_tokenizer_passed_in_is_not_changed():
    tok = builtin_tokenizer()
    tok.padding_side = "right"
    module = build(tok)
    assert module.tokenizer is not tok and module.tokenizer.padding_side == "left"
    fit(module, max_steps=1, data=digits_data(tokenizer=tok))  # the DataModule is given it too
    assert tok.padding_side == "right"
    # a tokenizer without a pad token gets one in the module's copy only
    bare = builtin_tokenizer()
    bare.padding_side = "right"
    bare.pad_token = None
    with pytest.warns(UserWarning, match="no pad token"):
        module = build(bare)
    assert bare.pad_token is None and bare.padding_side == "right"
    assert module.tokenizer.pad_token_id == bare.eos_token_id


# ----------------------------------------------------------------------------- 6. greedy decoding


def test_greedy_is_the_argmax_of_full_forwards_in_both_backends(tokenizer):
    policy = make_policy(seed=3).eval()
    batch = prompt_batch(tokenizer, ["312>", "90517>", "5>"])
    assert batch.attention_mask[:, 0].tolist() == [0, 1, 0]  # left padded, lengths differ
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    expected = hand_greedy(policy, batch.input_ids, batch.attention_mask, 6, eos, pad)
    for seed, backend in ((1, "lean"), (2, "generate")):  # different seeds: nothing is drawn
        torch.manual_seed(seed)
        greedy = SamplingConfig(do_sample=False, max_new_tokens=6, backend=backend)
        out = generate(policy, batch, 1, greedy, eos, pad)
        T = out.response_ids.shape[1]
        assert (expected[:, T:] == pad).all(), backend  # any step left out ran after every sequence had ended
        assert torch.equal(out.response_ids, expected[:, :T]), (backend, out.response_ids, expected)
    # sampling draws something else (the untrained policy is far from deterministic)
    torch.manual_seed(1)
    sampled = generate(policy, batch, 1, SamplingConfig(max_new_tokens=6), eos, pad)
    assert not torch.equal(sampled.response_ids, expected[:, : sampled.response_ids.shape[1]])


def test_training_rollouts_refuse_greedy(tokenizer):
    with pytest.raises(ConfigError, match="model.sampling.do_sample"):
        build(tokenizer, sampling=SamplingConfig(do_sample=False))


# ----------------------------------------------------------------------------- 7. generate and predict


def test_generate_and_predict_answer_greedily(tokenizer):
    module = build(tokenizer, sampling=SamplingConfig(max_new_tokens=6))
    texts = ["312>", "9051>"]
    policy = module.actor_critic.policy.eval()
    batch = prompt_batch(tokenizer, texts)
    ids = hand_greedy(policy, batch.input_ids, batch.attention_mask, 6, tokenizer.eos_token_id, tokenizer.pad_token_id)
    expected = [hand_text(tokenizer, row) for row in ids]
    assert all(expected), expected

    torch.manual_seed(5)
    assert module.generate(texts) == expected
    assert module.generate("9051>") == expected[1:]

    data = RolloutDataModule(prompts=["1>", "2>"], predict_prompts=texts, batch_size=2, max_prompt_length=16)
    torch.manual_seed(6)
    rows = make_trainer(max_steps=1).predict(module, datamodule=data)
    flat = [row for batch_rows in rows for row in batch_rows]
    assert [r["prompt"] for r in flat] == texts
    assert [r["response"] for r in flat] == expected
    assert [r["score"] for r in flat] == pytest.approx(sort_digits_reward(texts, expected), abs=1e-7)
    # a plain DataLoader of PromptBatches works as the predict dataloader too
    loader = DataLoader([prompt_batch(tokenizer, texts)], batch_size=None)
    rows = make_trainer(max_steps=1).predict(module, dataloaders=loader)
    assert [row["response"] for batch_rows in rows for row in batch_rows] == expected


def test_a_checkpoint_monitoring_the_reward_saves_in_a_run_shorter_than_log_every_n_steps(tmp_path):
    """The progress-bar reward reaches Lightning every step, so a monitored checkpoint sees it at the end of the
    epoch even when no metrics were written yet (log_every_n_steps=50 > the 3 rollouts of this run)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-3,
    )
    best = ModelCheckpoint(dirpath=tmp_path, monitor="reward", mode="max", save_top_k=1)
    trainer = make_trainer(
        max_steps=-1, max_epochs=1, log_every_n_steps=50, callbacks=[best], enable_checkpointing=True
    )
    trainer.fit(module, RolloutDataModule(batch_size=4, max_prompt_length=16, rollouts_per_epoch=3))
    assert trainer.global_step == 3
    assert best.best_model_path and (tmp_path / best.best_model_path.split("/")[-1]).is_file()
    assert float(best.best_model_score) == pytest.approx(module.step_metrics["rollout/reward_mean"])
