"""TensorBoard opens on what matters: the custom-scalars layout charts logged tags, and no hp_metric placeholder."""

import re
from pathlib import Path

import lightning as L
import yaml
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def tensorboard_init_args(config: Path) -> list[dict]:
    """The init_args of every TensorBoardLogger a config builds."""
    loggers = yaml.safe_load(config.read_text())["trainer"].get("logger") or []
    loggers = loggers if isinstance(loggers, list) else [loggers]
    return [logger.get("init_args", {}) for logger in loggers if logger["class_path"].endswith("TensorBoardLogger")]


def test_every_config_turns_the_hp_metric_placeholder_off():
    configs = sorted(CONFIGS.glob("*.yaml"))
    with_tensorboard = {config.name: tensorboard_init_args(config) for config in configs}
    assert sum(len(args) for args in with_tensorboard.values()) >= 12
    for name, loggers in with_tensorboard.items():
        for init_args in loggers:
            assert init_args.get("default_hp_metric") is False, name


def test_the_first_screen_charts_reward_held_out_kl_entropy_and_step_time(tokenizer, tmp_path):
    L.seed_everything(0)
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        metric_fns=["lit_rlhf.tasks.digits.sorted_exactly"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.05, entropy_coef=0.01),
        sampling=SamplingConfig(max_new_tokens=4),
        log_samples_every_n_steps=0,
    )
    data = RolloutDataModule(
        prompts="builtin:digits",
        val_prompts="builtin:digits",
        val_size=4,
        batch_size=2,
        rollouts_per_epoch=2,
        max_prompt_length=16,
    )
    init_args = {**tensorboard_init_args(CONFIGS / "grpo.yaml")[0], "save_dir": str(tmp_path)}
    logger = TensorBoardLogger(**init_args)
    trainer = make_trainer(max_steps=2, logger=logger)
    trainer.fit(module, data)
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert "hp_metric" not in scalars
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    (category,) = layout.category
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert list(charts) == [
        "training reward",
        "held-out metrics (greedy)",
        "KL to the reference",
        "policy entropy",
        "step time (s)",
    ]
    for title, patterns in charts.items():  # every chart draws something this run logged
        drawn = {tag for tag in scalars for pattern in patterns if re.fullmatch(pattern, tag)}
        assert drawn, f"{title}: none of {patterns} among {sorted(scalars)}"
    held_out = {tag for tag in scalars if re.fullmatch(charts["held-out metrics (greedy)"][0], tag)}
    assert held_out == {"val/sorted_exactly", "val/reward_mean"}  # not val/response_len_mean, val/frac_truncated
