"""A `torch.compile`d policy is refused, naming the compiled sampling backend: it recompiled for every new shape
(8 graphs; two GRPO steps of the tiny model took 294 s instead of 0.5 s on a CPU, docs/performance.md)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_policy
from lit_rlhf import AlgorithmConfig, RLHFModule
from lit_rlhf.config import ConfigError


@pytest.mark.parametrize("field", ["policy", "reference"])
def test_a_compiled_model_is_refused_pointing_to_the_compiled_backend(field):
    models = {"policy": make_policy(), field: torch.compile(make_policy())}
    with pytest.raises(ConfigError, match=rf"model\.{field}: a torch.compile'd model .* sampling\.backend: compiled"):
        RLHFModule(
            **models,
            tokenizer="builtin:digits",
            reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
            algorithm=AlgorithmConfig(name="grpo", group_size=2),
        )
