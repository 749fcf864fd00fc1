"""A memory plan before anything loads: per device, from the settings and the models' configs alone.

Each model is built on the `meta` device from its config (transformers `AutoConfig` for a name or folder, the
task's builder for `builtin:<task>`), so parameters are counted exactly and no weight is read. The terms:

- weights of the policy (+ value head; + a separate critic backbone), the reference (none with LoRA: the policy
  with adapters disabled; none when `kl_coef` is 0) and the reward model, in the models' dtype (`bf16-true` /
  `16-true` precision: 2 bytes);
- gradients (the trainable parameters' dtype) and AdamW's two fp32 states per trainable parameter;
- the activations one micro-batch keeps for backward (`activation_bytes`, formula below), with the shared-prompt
  forward's per-row copies of the prompts' keys and values (`prompt_kv_bytes`);
- the log-probs, entropy and exact KL come from the LM head's input in blocks (`chunked_logprobs.head_stats`): no
  (rows, tokens, vocabulary) logits tensor exists, only a workspace of a few float32 blocks of
  min(tokens, `logit_chunk_tokens`) x min(vocabulary, the device's slice) (`logit_workspace_bytes`), and when the
  head trains, the zero gradient of its weight the backward starts with (and with tied embeddings, the
  embedding's own gradient of the same size before the two are summed);
- sampling computes the last position's logits only: a few (rows, vocabulary) float32 tensors per step
  (`sampling_logit_bytes`);
- the rollout's KV cache: (batch_size x group_size) rows of (max_prompt_length + max_new_tokens) tokens, 2 x
  layers x kv_heads x head_dim values each;
- under FSDP (`ModelParallelStrategy`, `FSDPStrategy`) the sharded models' weights, gradients and optimizer
  states divided by the world size, plus what FSDP2 gathers into storage of its own beside the shards: the whole
  policy while it samples, and in the update the root unit (the parameters outside the repeated blocks), whole
  from its forward through its backward, with its whole gradient and the reduce-scatter's copy of it;
- with `sampling.backend: vllm` in colocate mode, the engine's share of the device instead of the rollout's KV
  cache: on a GPU `gpu_memory_utilization` x the device's total memory (vLLM's own budget for its weights, KV
  cache and activations); on a CPU its copy of the policy's weights plus `kv_cache_gib`; with LoRA, the merged
  copy of the policy each weight sync builds. A vLLM server elsewhere takes nothing here.

The peak is `weights + optimizer + max(rollout, update)`: the KV cache is freed before the update, and the
gradients are set to None after each optimizer step, so they never meet the KV cache. Within the update the
backward starts with every activation alive (and the logit workspace, and the head's gradient buffer) and ends
with every gradient written and the activations freed, so the update holds the larger of those two groups
(`Term.overlap`).

A model whose LM head cannot be read (`models.output_head`: another module type, a hook, a LoRA variant on the
head) keeps its own (rows, tokens, vocabulary) logits instead: the plan does not count those.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from lit_rlhf.algorithms.chunked_logprobs import block_shape
from lit_rlhf.config import ConfigError, MemoryCheck, VLLMConfig, check_memory_check
from lit_rlhf.registry import get_task, is_builtin
from lit_rlhf.training.sharding import longest_module_list

Moment = Literal["backward start", "backward end", "optimizer step"]
BACKWARD_START: frozenset[Moment] = frozenset({"backward start"})
BACKWARD_END: frozenset[Moment] = frozenset({"backward end"})
AFTER: frozenset[Moment] = frozenset({"backward end", "optimizer step"})  # the gradients
STEP: frozenset[Moment] = frozenset({"optimizer step"})
GiB = 1024**3

# Activations kept for backward, in elements per token and layer (no recompute): ELEMENTS_PER_HIDDEN x hidden +
# ELEMENTS_PER_MLP x intermediate. Measured, not derived: fitted to the peak RSS of SmolLM2-135M (SiLU-gated MLP)
# runs on CPU (docs/memory.md). Refitted on 2026-12-07 once the forwards stopped building logits (the first fit
# had four (tokens, vocabulary) logits copies beside them): the full fine-tuning run implies 15, the LoRA run 18
# (at their measured prompt width; the two share one shape, so ELEMENTS_PER_MLP stays at 6), and 16 was kept.
# What is alive after the forward is about half: counting a Llama block's named saved tensors (the block's input,
# the norms' outputs, q, k, v and their rotated copies, the attention output; the gate and up projections, the
# activation and the product) gives 7 x hidden + 4 x intermediate, and that is what SmolLM2's forward keeps once
# the allocator has returned its free memory (malloc_trim after the LoRA run's forward: 727 MiB alive, 643 MiB
# without the prompts' per-row keys and values, about 7.3 x hidden + 4 x intermediate; 1268 MiB at the forward's
# peak). The rest is memory glibc's allocator holds during the forward on a CPU; a GPU's caching allocator behaves
# otherwise (not measured here). Eager attention also keeps its (heads x T) probabilities per token (2 copies);
# `sdpa` keeps none.
ELEMENTS_PER_HIDDEN = 16
ELEMENTS_PER_MLP = 6
# GPT-2's `gelu_new` is written out in Python (x^3, tanh, products), each step keeping an intermediate-sized
# tensor: fitted to the built-in GPT-2 on CPU.
ELEMENTS_PER_MLP_UNFUSED = 7
UNFUSED_ACTIVATIONS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh_python")
# (n, v) float32 blocks `chunked_logprobs.head_stats` holds at once (n x v: `block_shape` of the device, n at
# most the tokens), counted in its code and measured (peak RSS growth of one forward, then of its backward, with
# blocks of 1024 x 32768, N 2048, H 128, V 151,936: 2.09 blocks forward, 4.09 with the reference's; 2.02 backward,
# 4.03 with the entropy bonus, the exact KL or both): its forward keeps the logits (shifted in place) and their exp
# (2), with the reference's for the exact KL those, the difference and the reference's exp (4); its backward keeps
# the recomputed logits and the gradient coefficient (2), and two temporaries more for the entropy's or the KL's
# gradient (4).
LOGIT_BLOCKS = 2
LOGIT_BLOCKS_WIDE = 4  # forward with the reference's (the exact KL); backward with the exact KL or the entropy bonus
# (rows, vocabulary) float32 tensors a sampling step holds at once (`rollout.sampler`; measured for `draw`): the
# last position's logits, the softmax and torch.multinomial's exponential draws (3); one more for the division by
# a temperature other than 1 or a model not in float32 (the float copy); top-p's sort (values and int64 indices),
# softmax and cumulative sum add 4 (3.5 measured).
SAMPLING_LOGIT_COPIES = 3
SAMPLING_TOP_P_COPIES = 4
# What a fit holds on a CPU beyond its planned terms whatever the model (the rollout's Python objects, the autograd
# graph's nodes, the allocator's arenas): measured, the peak RSS of benchmarks/memory_plan.py's `tiny-minimal`
# (1 prompt x 2 samples of 2 tokens) over the baseline minus its other terms, 12.5-12.9 MiB against 7.8 planned in
# 5 runs. Host memory, so not counted on an accelerator.
FIT_OVERHEAD_CPU = 5 * 2**20


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model, read from its config and a `meta`-device build."""

    params: int  # with LoRA: the base weights and the adapters
    trainable: int  # with LoRA: the adapters only
    element_bytes: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eager_attention: bool
    mlp_elements: int = ELEMENTS_PER_MLP
    root_params: int = 0  # outside the repeated blocks (embeddings, final norm, an untied head): FSDP2's root unit
    root_trainable: int = 0  # of those, the ones that train (with LoRA: only a `modules_to_save` copy)
    largest_trainable: int = 0  # elements of the largest trainable parameter
    head_grad: int = 0  # elements of the LM head's weight when it trains (its weight's gradient), else 0
    tied_head_grad: int = 0  # the same when that weight is also the input embedding's (tied), else 0

    @property
    def weight_bytes(self) -> int:
        return self.params * self.element_bytes


def config_value(config: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def shape_of(model: nn.Module, element_bytes: int | None = None) -> ModelShape:
    """A model's shape from its config and parameters (meta or real)."""
    config = model.config
    hidden = config_value(config, "hidden_size", "n_embd", "d_model")
    heads = config_value(config, "num_attention_heads", "n_head", default=1)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = longest_module_list(model) or nn.ModuleList()
    in_blocks = {id(p) for p in blocks.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    dtype = next(model.parameters()).dtype
    activation = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None)
    return ModelShape(
        params=params,
        trainable=trainable,
        element_bytes=element_bytes or dtype.itemsize,
        layers=config_value(config, "num_hidden_layers", "n_layer"),
        hidden=hidden,
        intermediate=config_value(config, "intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden,
        heads=heads,
        kv_heads=config_value(config, "num_key_value_heads", default=heads),
        head_dim=config_value(config, "head_dim", default=hidden // heads),
        vocab=config_value(config, "vocab_size"),
        eager_attention=getattr(config, "_attn_implementation", "eager") == "eager",
        mlp_elements=ELEMENTS_PER_MLP_UNFUSED if activation in UNFUSED_ACTIVATIONS else ELEMENTS_PER_MLP,
        root_params=sum(p.numel() for p in root),
        root_trainable=sum(p.numel() for p in root if p.requires_grad),
        largest_trainable=max((p.numel() for p in model.parameters() if p.requires_grad), default=0),
        **head_gradients(model),
    )


def head_gradients(model: nn.Module) -> dict[str, int]:
    """`head_grad` and `tied_head_grad` of `ModelShape`: the LM head's weight trains when any parameter of the head
    module does (full fine-tuning, a LoRA adapter on the head, a `modules_to_save` copy); `head_stats`' backward
    then fills a zero gradient of the whole weight. Tied: the head's weight is the input embedding's, so the
    embedding's backward adds a second gradient of that size before the two are summed."""
    from lit_rlhf.models.output_head import output_module

    head = output_module(model)
    if head is None or not any(p.requires_grad for p in head.parameters()):
        return {}
    weight = max((p for p in head.parameters() if p.dim() == 2), key=lambda p: p.numel(), default=None)
    if weight is None:
        return {}
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    get_embeddings = getattr(base, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    tied = (
        weight.requires_grad and isinstance(embeddings, nn.Module) and any(p is weight for p in embeddings.parameters())
    )
    return {"head_grad": weight.numel(), "tied_head_grad": weight.numel() if tied else 0}


def config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def meta_model(spec: Any, field: str, kind: Literal["causal", "classifier"], trust_remote_code: bool) -> nn.Module:
    """The model `spec` names, built on the `meta` device: no weight read or allocated."""
    if isinstance(spec, nn.Module):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"{field}: the memory plan needs a name, a folder or 'builtin:<task>', got {type(spec)!r}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if is_builtin(spec):
        task = get_task(spec, field)
        build = task.policy if kind == "causal" else task.reward_model
        if build is None:
            raise ConfigError(f"{field}: {spec!r} has no reward model")
        with torch.device("meta"):
            return build()
    config = AutoConfig.from_pretrained(os.path.expanduser(spec), trust_remote_code=trust_remote_code)
    auto = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    return model.to(config_dtype(config))


def lora_shape(model: nn.Module, lora: dict[str, Any], element_bytes: int | None) -> ModelShape:
    """The shape of `model` wrapped with LoRA: the base weights plus the adapters (and any `modules_to_save`
    copies), of which only the adapters and copies train. A meta-device copy is wrapped; nothing is allocated."""
    import copy

    from lit_rlhf.models.lora import apply_lora

    with torch.device("meta"):
        wrapped = apply_lora(copy.deepcopy(model), lora)
    return shape_of(wrapped, element_bytes)


@dataclass
class PlanSettings:
    """The settings a plan reads, gathered from the module, the DataModule and the Trainer."""

    policy: Any
    reference: Any = None
    reward_model: Any = None
    lora: dict[str, Any] | None = None
    uses_critic: bool = False
    uses_reference: bool = True
    separate_critic: bool = False
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    prompts_per_device: int = 1
    group_size: int = 1
    num_minibatches: int = 1
    micro_batch_size: int | None = None
    share_prompt_forward: bool = True  # each distinct prompt through the layers once per forward
    prompt_tokens: int = 1
    new_tokens: int = 1
    logit_chunk_tokens: int | None = None  # algorithm.logit_chunk_tokens (None: the device's `block_shape`)
    entropy_bonus: bool = False  # algorithm.entropy_coef > 0: the entropy's gradient goes through the head
    exact_kl: bool = False  # kl_estimator 'full' with a reference: the KL over the vocabulary, from both heads
    exact_kl_in_loss: bool = False  # ... as a loss term (algorithm.full_kl_in_loss), so also in the backward
    temperature: float = 1.0  # sampling.temperature
    top_p: float = 1.0  # sampling.top_p
    world_size: int = 1
    sharded: bool = False  # FSDP: weights, gradients and optimizer states split over world_size
    shard_frozen: bool = True  # FSDP: the reference and reward model sharded too (else replicated)
    half_precision: bool = False  # bf16-true / 16-true: 2-byte weights
    device: str = "cpu"
    processes_per_host: int = 1  # CPU processes share one RAM
    max_staleness: int = 0  # > 0: a producer samples beside the update with its own copies of the weights
    backend: str = "lean"  # sampling.backend
    vllm_mode: str = "colocate"  # sampling.vllm.mode
    vllm_gpu_memory_utilization: float = 0.3  # sampling.vllm.gpu_memory_utilization (colocate on a GPU)
    vllm_kv_cache_gib: int = 1  # sampling.vllm.kv_cache_gib (colocate on a CPU)
    device_total: int | None = None  # the device's total memory (a GPU's; None: unknown)

    @property
    def vllm_colocated(self) -> bool:
        return self.backend == "vllm" and self.vllm_mode == "colocate"


@dataclass
class Term:
    name: str
    phase: Literal["persistent", "rollout", "update"]
    bytes: int
    shrink: str  # the settings that make it smaller
    # in the update, the moments the term is alive at: the backward's start (the activations, the logit workspace,
    # the head's gradient buffer), its end (every gradient written, the activations freed) and the optimizer
    # step; the phase holds the largest moment's sum. Empty: alive throughout.
    moments: frozenset[Moment] = frozenset()


@dataclass
class MemoryPlan:
    terms: list[Term]
    available: int | None = None
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    overlapped: bool = False  # asynchronous rollouts: sampling runs during the update, so both phases add up

    @property
    def total(self) -> int:
        rollout, update = self.phase("rollout"), self.phase("update")
        return self.phase("persistent") + (rollout + update if self.overlapped else max(rollout, update))

    def phase(self, name: str) -> int:
        """A phase's peak: the sum of its terms, except that the update's are alive at some moments only
        (`Term.moments`), so it holds the largest moment's sum."""
        terms = [t for t in self.terms if t.phase == name]
        moments = [sum(t.bytes for t in terms if moment in t.moments) for moment in get_args(Moment)]
        return sum(t.bytes for t in terms if not t.moments) + max(moments)

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)

    def table(self) -> str:
        lines = [f"{'term':<40} {'phase':<10} {'MiB':>10}"]
        lines += [f"{t.name:<40} {t.phase:<10} {t.bytes / 2**20:>10.1f}" for t in self.terms]
        peak = "persistent + rollout + update" if self.overlapped else "persistent + max(rollout, update)"
        lines.append(f"{'peak (' + peak + ')':<51} {self.total / 2**20:>10.1f}")
        if self.available is not None:
            lines.append(f"{'available on ' + self.device:<51} {self.available / 2**20:>10.1f}")
        return "\n".join(lines + self.notes)

    def refusal(self) -> str | None:
        """The error message when the plan does not fit the available memory, else None."""
        if self.available is None or self.total <= self.available:
            return None
        big = self.largest
        return (
            f"memory plan: about {self.total / GiB:.2f} GiB per device needed, {self.available / GiB:.2f} GiB "
            f"available on {self.device}; the largest term is {big.name} ({big.bytes / GiB:.2f} GiB): {big.shrink}. "
            "Other settings that shrink the plan: model.lora, model.algorithm.micro_batch_size, "
            "model.gradient_checkpointing, sharding (trainer.strategy: ModelParallelStrategy over more devices), "
            "offload (FSDPStrategy cpu_offload). Set model.memory_check: warn (or off) to start anyway.\n"
            + self.table()
        )


def activation_bytes(
    shape: ModelShape, rows: int, prompt_rows: int, prompt: int, response: int, checkpointing: bool
) -> int:
    """Bytes one forward with grad keeps for backward in the layers: `prompt_rows` x `prompt` prompt tokens (each
    distinct prompt once with the shared-prompt forward) and `rows` x `response` response tokens. Per layer and
    token: ELEMENTS_PER_HIDDEN x hidden + mlp_elements x intermediate (+ 2 x heads x (prompt + response) with
    eager attention); with gradient checkpointing each layer keeps only its input (hidden) and one layer's full
    set is alive at a time during the recompute. No logits: the head's input goes to `head_stats`."""
    per_layer = ELEMENTS_PER_HIDDEN * shape.hidden + shape.mlp_elements * shape.intermediate
    if shape.eager_attention:
        per_layer += 2 * shape.heads * (prompt + response)
    if checkpointing:
        per_token = shape.layers * shape.hidden + per_layer
    else:
        per_token = shape.layers * per_layer
    tokens = prompt_rows * prompt + rows * response
    return tokens * per_token * shape.element_bytes


def prompt_kv_bytes(shape: ModelShape, rows: int, prompt: int) -> int:
    """The shared-prompt forward's per-row copies of the prompts' keys and values, kept for backward: each of the
    `rows` response rows attends over its own copy of its prompt's cache rows (gathered with `index_select`,
    grown with the responses' keys and values), which attention keeps with every query head's copy (`repeat_kv`
    for grouped-query attention): 2 x heads x head_dim values per prompt token, row and layer."""
    return rows * prompt * 2 * shape.heads * shape.head_dim * shape.layers * shape.element_bytes


def logit_blocks(s: PlanSettings) -> int:
    """The (n, v) float32 blocks `head_stats` holds at once in an update (forward or backward, the larger)."""
    wide = s.exact_kl or s.entropy_bonus  # the forward with the reference's, or a wider backward
    return LOGIT_BLOCKS_WIDE if wide else LOGIT_BLOCKS


def logit_workspace_bytes(
    shape: ModelShape, tokens: int, chunk_tokens: int | None, blocks: int, device: str = "cpu"
) -> int:
    """`blocks` float32 blocks of min(`tokens`, block tokens) x min(vocabulary, block ids) (`block_shape` of the
    device, `chunk_tokens` its tokens when set): the most of the logits that exist at once while `head_stats` runs
    over `tokens` valid response tokens."""
    block_tokens, block_ids = block_shape(torch.device(device), chunk_tokens)
    statistics = max(4, shape.element_bytes)  # float32, float64 for a float64 model
    return blocks * min(tokens, block_tokens) * min(shape.vocab, block_ids) * statistics


def optimizer_step_bytes(shape: ModelShape, trainable: int, device: str) -> int:
    """What AdamW's step allocates beside its states: on a CPU (one tensor at a time) the square root of a second
    moment and its quotient, 2 x the largest trainable parameter (measured: 148 MiB for a 74 MiB embedding); on a
    GPU (the `foreach` kernels) one square root of every second moment at once, 1 x the trainable parameters
    (counted in torch.optim.AdamW's code, not measured)."""
    elements = 2 * shape.largest_trainable if device == "cpu" else trainable
    return elements * shape.element_bytes


def sampling_logit_bytes(shape: ModelShape, rows: int, temperature: float, top_p: float) -> int:
    """A sampling step's last-position logits and what is drawn from them: (rows, vocabulary) float32 copies."""
    copies = SAMPLING_LOGIT_COPIES
    if temperature != 1.0 or shape.element_bytes != 4:
        copies += 1
    if top_p < 1.0:
        copies += SAMPLING_TOP_P_COPIES
    return copies * rows * shape.vocab * 4


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int) -> int:
    return rows * tokens * 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.element_bytes


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' notices about building a model from a config are noise here."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def model_shapes(s: PlanSettings) -> dict[str, ModelShape]:
    """The shapes of the models the settings build: policy, reference, reward model (the last two if any)."""
    size = 2 if s.half_precision else None
    with _quiet():
        policy = meta_model(s.policy, "model.policy", "causal", s.trust_remote_code)
        shapes = {"policy": shape_of(policy, size) if s.lora is None else lora_shape(policy, s.lora, size)}
        if s.uses_reference and s.lora is None:
            reference = policy if s.reference is None else meta_model(s.reference, "model.reference", "causal", False)
            shapes["reference"] = shape_of(reference, size)
        elif s.uses_reference and s.reference is not None:
            shapes["reference"] = shape_of(meta_model(s.reference, "model.reference", "causal", False), size)
        if s.reward_model is not None:
            reward = meta_model(s.reward_model, "model.reward_model", "classifier", s.trust_remote_code)
            shapes["reward model"] = shape_of(reward, size)
    return shapes


FSDP2_CPU_NOTE = (
    "note: under FSDP2 on CPU glibc's allocator keeps much of the freed memory: the measured peak RSS was 1.8-1.9x "
    "this plan (SmolLM2, 2 processes, benchmarks/fsdp2_memory.py), 1.2x with MALLOC_MMAP_THRESHOLD_=131072 in the "
    "environment (slower steps); read the plan as a lower bound there"
)


def plan_memory(s: PlanSettings, available: int | None = None) -> MemoryPlan:
    """The per-device plan for settings `s` (`available`: the device memory to compare with; None: not compared)."""
    shapes = model_shapes(s)
    policy = shapes["policy"]
    shard = s.world_size if s.sharded else 1
    value_head = (policy.hidden + 1) if s.uses_critic else 0
    separate = s.uses_critic and s.separate_critic  # the critic: a copy of the policy (with its adapters)
    critic = policy.params if separate else 0
    trainable = policy.trainable + value_head + (policy.trainable if separate else 0)
    lora_note = "model.lora (adapters only train)" if s.lora is None else "a smaller model.lora.r"
    terms = [
        Term(
            "policy weights",
            "persistent",
            (policy.params + value_head + critic) * policy.element_bytes // shard,
            "model.lora does not shrink it; sharding does (ModelParallelStrategy)",
        ),
        Term("optimizer state (AdamW, fp32)", "persistent", 2 * 4 * trainable // shard, f"{lora_note}, or sharding"),
    ]
    for name in ("reference", "reward model"):
        if name in shapes:
            frozen_shard = shard if s.shard_frozen else 1
            fix = "model.lora (the reference is then the policy with adapters off), or kl_coef 0"
            terms.append(
                Term(
                    f"{name} weights (frozen)",
                    "persistent",
                    shapes[name].weight_bytes // frozen_shard,
                    fix if name == "reference" else "a smaller reward model, or sharding",
                )
            )
    if s.device == "cpu":
        terms.append(Term("the fit's own objects (CPU)", "persistent", FIT_OVERHEAD_CPU, "nothing: it is fixed"))
    if s.world_size > 1 and not s.sharded:  # DDP's reducer keeps a flat copy of the gradients in its buckets
        buckets = trainable * policy.element_bytes
        terms.append(Term("DDP gradient buckets", "persistent", buckets, "model.lora, or sharding"))
    terms += _phase_terms(s, shapes, trainable, shard)
    if s.max_staleness:
        terms += _producer_terms(s, policy)
    notes = [FSDP2_CPU_NOTE] if s.sharded and shard > 1 and s.device == "cpu" else []
    if s.vllm_colocated:
        terms += _vllm_terms(s, policy)
        if s.device != "cpu" and s.device_total is None:
            notes.append(VLLM_UNKNOWN_DEVICE_NOTE)
    return MemoryPlan(terms, available, s.device, notes, overlapped=s.max_staleness > 0)


def _producer_terms(s: PlanSettings, policy: ModelShape) -> list[Term]:
    """Asynchronous rollouts (docs/async.md): the producer samples with its own full copy of the policy, and each
    step's jobs carry a copy of the trainable weights (LoRA: the adapters), up to max_staleness + 1 at once."""
    fix = "model.algorithm.max_staleness (0: none), or model.lora (the job copies are then adapters only)"
    return [
        Term("the producer's copy of the policy", "persistent", policy.weight_bytes, fix),
        Term(
            f"weights of queued rollouts ({s.max_staleness + 1} copies)",
            "persistent",
            (s.max_staleness + 1) * policy.trainable * policy.element_bytes,
            fix,
        ),
    ]


VLLM_UNKNOWN_DEVICE_NOTE = (
    "note: vLLM's share (sampling.vllm.gpu_memory_utilization x the device's total memory) is not counted: the "
    "device's total memory is unknown (PlanSettings.device_total)"
)


def _vllm_terms(s: PlanSettings, policy: ModelShape) -> list[Term]:
    """A vLLM engine in this process (`sampling.vllm.mode: colocate`, lit_rlhf/rollout/backends/vllm_engine.py).
    On a GPU it takes `gpu_memory_utilization` of the device's total memory for everything of its own; on a CPU
    its weights (the policy's dtype, adapters merged) and a KV cache of `kv_cache_gib`. With LoRA each weight
    sync merges the adapters into a full copy of the policy, alive while the engine reloads it."""
    base_weights = (policy.params - policy.trainable if s.lora is not None else policy.params) * policy.element_bytes
    if s.device == "cpu":
        terms = [
            Term("vLLM engine's copy of the policy", "persistent", base_weights, "model.sampling.backend: lean"),
            Term(
                "vLLM KV cache (kv_cache_gib)",
                "persistent",
                s.vllm_kv_cache_gib * GiB,
                "model.sampling.vllm.kv_cache_gib (1 fits small models)",
            ),
        ]
    else:
        share = int(s.vllm_gpu_memory_utilization * (s.device_total or 0))
        fix = "model.sampling.vllm.gpu_memory_utilization, or mode: server (vLLM on other devices)"
        terms = [Term("vLLM engine (gpu_memory_utilization)", "persistent", share, fix)]
    if s.lora is not None:
        terms.append(Term("merged policy for the vLLM weight sync", "rollout", base_weights, "no LoRA"))
    return terms


def _phase_terms(s: PlanSettings, shapes: dict[str, ModelShape], trainable: int, shard: int) -> list[Term]:
    policy = shapes["policy"]
    rows = s.prompts_per_device * s.group_size
    tokens = s.prompt_tokens + s.new_tokens
    micro = s.micro_batch_size or max(1, rows // s.num_minibatches)
    # the shared-prompt forward needs whole groups, and is off under grad with gradient checkpointing
    shared = s.share_prompt_forward and s.group_size > 1 and micro % s.group_size == 0 and not s.gradient_checkpointing
    prompt_rows = micro // s.group_size if shared else micro
    activations = activation_bytes(policy, micro, prompt_rows, s.prompt_tokens, s.new_tokens, s.gradient_checkpointing)
    prompt_kv = prompt_kv_bytes(policy, micro, s.prompt_tokens) if shared else 0
    if s.uses_critic and s.separate_critic:
        activations, prompt_kv = 2 * activations, 2 * prompt_kv
    smaller_micro = "model.algorithm.micro_batch_size"
    step = optimizer_step_bytes(policy, trainable, s.device) // shard
    terms = [
        Term("gradients", "update", trainable * policy.element_bytes // shard, "model.lora, or sharding", AFTER),
        Term("optimizer step's temporaries", "update", step, "model.lora, or sharding", STEP),
        Term(
            f"activations (micro-batch of {micro} rows)",
            "update",
            activations,
            f"{smaller_micro}, model.gradient_checkpointing",
            BACKWARD_START,
        ),
    ]
    if prompt_kv:
        fix = f"{smaller_micro}, data.max_prompt_length, or share_prompt_forward: false (then the prompts run per row)"
        terms.append(Term("shared prompts' keys/values per row", "update", prompt_kv, fix, BACKWARD_START))
    workspace = logit_workspace_bytes(policy, micro * s.new_tokens, s.logit_chunk_tokens, logit_blocks(s), s.device)
    fix = "model.algorithm.logit_chunk_tokens (fewer tokens per block)"
    terms.append(Term("logit chunk workspace", "update", workspace, fix, BACKWARD_START))
    if policy.head_grad and not (s.sharded and shard > 1):  # sharded: the root unit's term counts the head
        grad, fix = policy.head_grad * policy.element_bytes, "model.lora (the head is frozen)"
        terms.append(Term("LM head's gradient buffer", "update", grad, fix, BACKWARD_START))
        if policy.tied_head_grad:
            tied = policy.tied_head_grad * policy.element_bytes
            fix = "model.lora (the embedding is frozen)"
            terms.append(Term("tied embedding's second gradient", "update", tied, fix, BACKWARD_END))
    if s.exact_kl:  # the reference's (B, T, H) head inputs, kept until the policy's forward has the KL
        hidden = rows * s.new_tokens * policy.hidden * policy.element_bytes
        terms.append(Term("reference hidden states (exact KL)", "update", hidden, "kl_estimator k1/k2/k3"))
    if s.backend != "vllm":  # vLLM keeps its KV cache in its own share (colocate) or elsewhere (server)
        cache = kv_cache_bytes(policy, rows, tokens)
        fix = "data.batch_size, model.algorithm.group_size or model.sampling.max_new_tokens"
        terms.insert(0, Term("KV cache of a rollout", "rollout", cache, fix))
        logits = sampling_logit_bytes(policy, rows, s.temperature, s.top_p)
        fix = "data.batch_size or model.algorithm.group_size (top_p 1.0 skips the sort)"
        terms.insert(1, Term("last-position logits while sampling", "rollout", logits, fix))
    if s.sharded and shard > 1:
        # FSDP2 gathers into storage of its own beside the shards: the whole policy while it samples, and in the
        # update the root unit (kept whole from its forward through its backward) with its whole gradient and
        # the reduce-scatter's flat copy of its trainable part (with LoRA, only a `modules_to_save` copy trains)
        fix = "more devices do not shrink it"
        terms.append(Term("policy unsharded while sampling", "rollout", policy.weight_bytes, fix))
        root = (policy.root_params + 2 * policy.root_trainable) * policy.element_bytes
        terms.append(Term("root unit gathered in the update", "update", root, fix))
    return terms


SHARDING_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy")


def plan_settings(module: Any, prompts: Any, trainer: Any) -> PlanSettings:
    """The plan's settings from an `RLHFModule`, what gives its prompts (a `RolloutDataModule` or the
    `PromptSupply` it handed over: `batch_size`, `max_prompt_length`; None: 1 prompt of 1 token) and a `Trainer`
    (none of them needs a loaded model)."""
    algo, hp = module.algorithm, module.hparams
    strategy = trainer.strategy
    sharded = any(c.__name__ in SHARDING_STRATEGIES for c in type(strategy).__mro__)
    device = trainer.strategy.root_device.type
    vllm = module.sampling.vllm or VLLMConfig()
    return PlanSettings(
        policy=module.specs.policy,
        reference=module.specs.reference,
        reward_model=module.specs.reward_model,
        lora=hp.get("lora"),
        uses_critic=algo.uses_critic,
        uses_reference=algo.uses_reference,
        separate_critic=bool(hp.get("separate_critic")),
        gradient_checkpointing=bool(hp.get("gradient_checkpointing")),
        trust_remote_code=bool(hp.get("trust_remote_code")),
        prompts_per_device=getattr(prompts, "batch_size", 1),
        group_size=algo.filled.group_size,
        num_minibatches=algo.num_minibatches,
        micro_batch_size=algo.micro_batch_size,
        share_prompt_forward=algo.share_prompt_forward,
        prompt_tokens=getattr(prompts, "max_prompt_length", 1),
        new_tokens=module.sampling.max_new_tokens,
        logit_chunk_tokens=algo.logit_chunk_tokens,
        entropy_bonus=algo.entropy_coef > 0,
        exact_kl=algo.uses_reference and algo.kl_estimator == "full",
        exact_kl_in_loss=algo.full_kl_in_loss,
        temperature=module.sampling.temperature,
        top_p=module.sampling.top_p,
        world_size=trainer.world_size,
        sharded=sharded,
        shard_frozen=getattr(module, "shard_frozen", True),
        half_precision=str(trainer.precision) in ("bf16-true", "16-true"),
        device=device,
        processes_per_host=trainer.num_devices if device == "cpu" else 1,
        max_staleness=algo.max_staleness,
        backend=module.sampling.backend,
        vllm_mode=vllm.mode,
        vllm_gpu_memory_utilization=vllm.gpu_memory_utilization,
        vllm_kv_cache_gib=vllm.kv_cache_gib,
        device_total=torch.cuda.mem_get_info()[1] if device == "cuda" and torch.cuda.is_available() else None,
    )


def available_bytes(device: str, processes_per_host: int = 1) -> int | None:
    """Free memory per process: CUDA's free memory on the current device; on CPU the host's available RAM
    (psutil, else /proc/meminfo's MemAvailable) shared by the processes of this host. None: unknown."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    if device != "cpu":
        return None
    try:
        import psutil

        total: int | None = int(psutil.virtual_memory().available)
    except ImportError:
        total = _meminfo_available()
    return None if total is None else total // max(1, processes_per_host)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fit_memory_check(module: Any, mode: MemoryCheck) -> MemoryPlan | None:
    """At fit start, before any model loads: plan, print the table on rank 0, and raise a `ConfigError` (mode
    'error') or warn (mode 'warn') when the plan exceeds the device's free memory. Outside a fit (no Trainer,
    or validate/test/predict) nothing is planned."""
    check_memory_check(mode)
    trainer = getattr(module, "_trainer", None)
    if mode == "off" or trainer is None or trainer.state.fn != "fit":
        return None
    settings = plan_settings(module, module.prompt_supply, trainer)  # handed over in `setup`
    plan = plan_memory(settings, available_bytes(settings.device, settings.processes_per_host))
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    rank_zero_info("memory plan per device (model.memory_check: off skips it):\n" + plan.table())
    message = plan.refusal()
    if message is not None and mode == "error":
        raise ConfigError(message)
    if message is not None:
        rank_zero_warn(message)
    return plan
