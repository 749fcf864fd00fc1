"""Typed settings for the algorithm and for sampling, validated when they are made.

PPO and GRPO are one code path: `AlgorithmConfig.name` only fills in the settings left as None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar, get_args

Algorithm = Literal["ppo", "grpo"]
AdvantageEstimator = Literal["gae", "grpo", "batch_std", "dr_grpo", "rloo"]
KLEstimator = Literal["k1", "k2", "k3", "full"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
SamplingBackend = Literal["lean", "generate"]
LRSchedule = Literal["constant", "linear", "cosine"]

_T = TypeVar("_T")

# The settings each algorithm fills in when the user leaves them as None.
_ALGORITHM_DEFAULTS = {
    "ppo": dict(group_size=1, advantage_estimator="gae", kl_coef=0.05, kl_estimator="k1", kl_in_reward=True),
    "grpo": dict(group_size=8, advantage_estimator="grpo", kl_coef=0.04, kl_estimator="k3", kl_in_reward=False),
}


class ConfigError(ValueError):
    """A setting is invalid; the message names the field and the fix."""


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field}: {message}")


def resolved(value: _T | None, field: str) -> _T:
    """The value of a setting that `AlgorithmConfig` fills in when it is made (None: the algorithm's default).

    Raises a `ConfigError` naming `field` if it is still None, which happens only when it was set to None
    after the config was made.
    """
    if value is None:
        raise ConfigError(
            f"{field}: is None, but it is filled in from algorithm.name when the config is made; "
            "make a new AlgorithmConfig instead of setting it to None afterwards"
        )
    return value


def check_choice(value: Any, choices: Any, field: str) -> None:
    """Raise unless `value` is one of the `Literal` type `choices`' values."""
    allowed = get_args(choices)
    _require(value in allowed, field, f"unknown value {value!r}; use one of {', '.join(map(repr, allowed))}")


class FilledSettings(NamedTuple):
    """The settings that `AlgorithmConfig.name` fills in, with their concrete types."""

    group_size: int
    advantage_estimator: AdvantageEstimator
    kl_coef: float
    kl_estimator: KLEstimator
    kl_in_reward: bool
    clip_eps_high: float


@dataclass
class AlgorithmConfig:
    """How experience becomes a loss. Fields left as None take the defaults of `name`."""

    name: Algorithm = "grpo"
    """'ppo' (critic, GAE, KL in the reward) or 'grpo' (group-normalised scores, KL k3 in the loss)."""
    group_size: int | None = None
    """Responses sampled per prompt (G). PPO default 1, GRPO default 8 (GRPO needs at least 2)."""
    advantage_estimator: AdvantageEstimator | None = None
    """'gae' (needs the critic), or a group estimator: 'grpo', 'batch_std', 'dr_grpo', 'rloo'."""
    kl_coef: float | None = None
    """Weight beta of the KL to the reference policy (PPO 0.05, GRPO 0.04). 0 skips the reference model."""
    kl_estimator: KLEstimator | None = None
    """'k1', 'k2', 'k3' (from sampled tokens) or 'full' (exact, over the vocabulary)."""
    kl_in_reward: bool | None = None
    """True: -beta*KL goes into the per-token reward (PPO). False: beta*KL is added to the loss (GRPO)."""
    ppo_epochs: int = 1
    """Passes over each rollout."""
    num_minibatches: int = 1
    """Optimizer steps per pass; the rollout is split into this many minibatches."""
    micro_batch_size: int | None = None
    """Rows per forward/backward; gradients accumulate over a minibatch. None: the whole minibatch."""
    clip_eps_low: float = 0.2
    """Lower ratio clip: the ratio is clipped at 1 - clip_eps_low (1 or more: no lower clip)."""
    clip_eps_high: float | None = None
    """Upper ratio clip (1 + clip_eps_high). None: equal to clip_eps_low. Both huge (1e9): the plain -A*ratio."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c*A. None: off."""
    value_clip: float | None = 0.2
    """Clip of the value update around the old values. None: plain MSE."""
    vf_coef: float = 0.1
    """Weight of the value loss (PPO)."""
    gamma: float = 1.0
    """Discount of GAE."""
    lam: float = 0.95
    """Lambda of GAE."""
    whiten_advantages: bool = True
    """Normalise GAE advantages over the valid tokens of the rollout (PPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the loss."""
    loss_aggregation: LossAggregation = "token_mean"
    """'token_mean', 'seq_mean_token_mean' or 'seq_mean_token_sum_norm' (Dr.GRPO)."""
    truncated_score: float | None = None
    """Score given to responses that hit max_new_tokens without EOS. None: keep the reward's score."""
    mask_truncated: bool = False
    """Leave truncated responses out of the loss."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm of each optimizer step to this. None: no clipping."""
    group_eps: float = 1e-6
    """Added to the standard deviation in group normalisation."""

    def __post_init__(self) -> None:
        check_choice(self.name, Algorithm, "algorithm.name")
        for key, value in _ALGORITHM_DEFAULTS[self.name].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.clip_eps_high is None:
            self.clip_eps_high = self.clip_eps_low
        check_choice(self.advantage_estimator, AdvantageEstimator, "algorithm.advantage_estimator")
        check_choice(self.kl_estimator, KLEstimator, "algorithm.kl_estimator")
        group_size = resolved(self.group_size, "algorithm.group_size")
        _require(group_size >= 1, "algorithm.group_size", f"must be >= 1, got {self.group_size}")
        if self.advantage_estimator != "gae":
            _require(
                group_size >= 2,
                "algorithm.group_size",
                f"the group estimator {self.advantage_estimator!r} needs at least 2 responses per prompt, "
                f"got {self.group_size}; set algorithm.group_size to 2 or more (8 is usual)",
            )
        _require(self.ppo_epochs >= 1, "algorithm.ppo_epochs", f"must be >= 1, got {self.ppo_epochs}")
        _require(self.num_minibatches >= 1, "algorithm.num_minibatches", f"must be >= 1, got {self.num_minibatches}")
        _require(
            self.micro_batch_size is None or self.micro_batch_size >= 1,
            "algorithm.micro_batch_size",
            f"must be >= 1 or None, got {self.micro_batch_size}",
        )
        kl_coef = resolved(self.kl_coef, "algorithm.kl_coef")
        _require(kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {self.kl_coef}")
        clip_eps_high = resolved(self.clip_eps_high, "algorithm.clip_eps_high")
        _require(self.clip_eps_low > 0 and clip_eps_high > 0, "algorithm.clip_eps_low/high", "must be > 0")
        _require(
            self.dual_clip is None or self.dual_clip > 1,
            "algorithm.dual_clip",
            f"must be > 1 or None, got {self.dual_clip}",
        )
        _require(self.value_clip is None or self.value_clip > 0, "algorithm.value_clip", "must be > 0 or None")
        _require(self.max_grad_norm is None or self.max_grad_norm > 0, "algorithm.max_grad_norm", "must be > 0 or None")
        _require(0 <= self.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {self.gamma}")
        _require(0 <= self.lam <= 1, "algorithm.lam", f"must be in [0, 1], got {self.lam}")
        check_choice(self.loss_aggregation, LossAggregation, "algorithm.loss_aggregation")

    @property
    def filled(self) -> FilledSettings:
        """The settings filled in from `name`, typed (a `ConfigError` if one was set to None afterwards)."""
        return FilledSettings(*(resolved(getattr(self, f), f"algorithm.{f}") for f in FilledSettings._fields))

    @property
    def uses_critic(self) -> bool:
        """A value head is trained only for GAE."""
        return self.advantage_estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        """The reference model is needed only when the KL has weight."""
        return self.filled.kl_coef > 0

    @property
    def full_kl_in_loss(self) -> bool:
        """The exact KL is a loss term: each micro-batch's loss needs the reference's full logits."""
        return self.uses_reference and not self.kl_in_reward and self.kl_estimator == "full"

    @property
    def single_pass(self) -> bool:
        """One epoch over one minibatch: the update's forward sees the policy that sampled the rollout."""
        return self.ppo_epochs == 1 and self.num_minibatches == 1

    def policy_forward_in_rollout(self, rollout_batch_size: int) -> bool:
        """Whether the sampling policy needs its own no-grad forward before the update.

        Not for a single pass over a rollout updated in one piece: the update's first forward then is the
        sampling policy (ratio exactly 1), so it supplies the old log-probs and values, and the same forward
        gives the loss. Several passes, minibatches or micro-batches need the old log-probs of the whole
        rollout first, and so does the exact KL ('full'), which needs both full distributions.
        """
        one_piece = self.micro_batch_size is None or self.micro_batch_size >= rollout_batch_size
        full_kl = self.uses_reference and self.kl_estimator == "full"
        return not (self.single_pass and one_piece) or full_kl

    def check_batch(self, rollout_batch_size: int) -> None:
        """Raise if `rollout_batch_size` sequences do not split into minibatches and micro-batches."""
        _require(
            rollout_batch_size % self.num_minibatches == 0,
            "algorithm.num_minibatches",
            f"the rollout has {rollout_batch_size} sequences (prompts per step x group_size), which do not split "
            f"into {self.num_minibatches} equal minibatches; choose a divisor of {rollout_batch_size}",
        )
        minibatch = rollout_batch_size // self.num_minibatches
        if self.micro_batch_size is not None:
            _require(
                minibatch % self.micro_batch_size == 0,
                "algorithm.micro_batch_size",
                f"a minibatch has {minibatch} sequences, not divisible by micro_batch_size={self.micro_batch_size}; "
                f"choose a divisor of {minibatch}",
            )


@dataclass
class SamplingConfig:
    """How responses are sampled from the policy."""

    max_new_tokens: int = 32
    """Longest response in tokens; a response reaching it without EOS counts as truncated."""
    temperature: float = 1.0
    """Softmax temperature for sampling and for every log-prob of the policy and reference."""
    top_k: int = 0
    """Sample among the k most likely tokens only. 0: off."""
    top_p: float = 1.0
    """Nucleus sampling mass. 1.0: off."""
    do_sample: bool = True
    """False: greedy decoding (the most likely token each step; temperature, top-k and top-p do not apply).
    Training rollouts must sample; greedy is for evaluation (`RLHFModule(val_sampling=...)`)."""
    backend: SamplingBackend = "lean"
    """'lean' (`lit_rlhf.rollout.sampler`: a minimal KV-cache loop, faster than generate for the same draws) or
    'generate' (Hugging Face generate). Both sample the same distribution (same tokens for the same seed)."""

    def __post_init__(self) -> None:
        _require(
            self.max_new_tokens > 0,
            "sampling.max_new_tokens",
            f"must be > 0, got {self.max_new_tokens}; responses need at least one token",
        )
        _require(self.temperature > 0, "sampling.temperature", f"must be > 0, got {self.temperature}")
        _require(self.top_k >= 0, "sampling.top_k", f"must be >= 0 (0 turns it off), got {self.top_k}")
        _require(0 < self.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        check_choice(self.backend, SamplingBackend, "sampling.backend")


def check_module_settings(
    lr: float,
    lr_schedule: str,
    warmup_steps: int,
    max_consecutive_skips: int,
    reward_model: Any,
    reward_fns: Sequence[Any] | None,
    sampling: SamplingConfig,
) -> None:
    """`RLHFModule`'s own settings, before any model loads."""
    if lr <= 0:
        raise ConfigError(f"model.lr: must be > 0, got {lr}")
    check_choice(lr_schedule, LRSchedule, "model.lr_schedule")
    if warmup_steps < 0:
        raise ConfigError(f"model.warmup_steps: must be >= 0, got {warmup_steps}")
    if max_consecutive_skips < 1:
        raise ConfigError(f"model.max_consecutive_skips: must be >= 1, got {max_consecutive_skips}")
    if reward_model is None and not reward_fns:
        raise ConfigError("model.reward_fns / model.reward_model: give at least one reward function or a reward model")
    if not sampling.do_sample:
        raise ConfigError(
            "model.sampling.do_sample: training rollouts must sample (true); greedy decoding is for held-out "
            "evaluation, set it in model.val_sampling"
        )


def check_precision(precision: str) -> None:
    """The manual update loop clips and steps unscaled gradients: fp16 (with its gradient scaler) is refused."""
    if precision in ("16-mixed", "16"):
        raise ConfigError(
            "trainer.precision: fp16 mixed precision scales gradients and is not supported by the manual update "
            "loop; use precision: bf16-mixed (or 32)"
        )
