"""Log-probs, entropy and the exact KL from the LM head's input, in chunks: no (tokens, vocabulary) logits tensor.

A forward's final hidden states h (N, H) and the LM head's weight W (V, H) give the logits
z = f(h W^T + b) / tau (f: the model's logit scale and soft-cap, tau: the sampling temperature). Every phase needs
only a few numbers per token of them: the sampled token's log-prob z_y - lse(z), the entropy, and for the exact
KL sum_v p_v (log p_v - log q_v) against the reference's logits. `head_stats` computes them over row chunks and
vocabulary slices with an online log-sum-exp, keeping (N,) accumulators; its backward recomputes each chunk's
logits from h and W, so memory holds one chunk x slice of logits at a time, forward and backward. This is the
method of "Cut Your Losses in Large-Vocabulary Language Models" (Wijmans et al. 2024,
https://arxiv.org/abs/2411.09009), written with torch operations per chunk.

Shapes: N = tokens (the valid response tokens of a batch, gathered), H = hidden size, V = vocabulary rows of the
head, n x v = one chunk x slice. Only torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CPU_BLOCK = (512, 4096)
"""(tokens, vocabulary entries) of one block of logits on a CPU. Measured (benchmarks/logit_chunks.py, one thread,
docs/memory.md): blocks of about 2M float32 entries stay in the caches between the passes over them; 512 x 4096
took 0.55x the time of autograd over the full logits on a 151,936-id head (H 128) and 0.97x on SmolLM2's
(49,152 ids, H 576), against 1.0-1.3x for blocks of 1024 x 32768."""
ACCELERATOR_BLOCK = (2048, 32768)
"""The same on a GPU: larger blocks, fewer kernel launches (256 MiB per float32 block). Not measured: no GPU was
lent to the task that chose it; `algorithm.logit_chunk_tokens` sets the tokens."""


def block_shape(device: torch.device, chunk_tokens: int | None = None) -> tuple[int, int]:
    """(tokens, vocabulary entries) of a block on `device`; `chunk_tokens` replaces the tokens when given."""
    tokens, vocab_slice = CPU_BLOCK if device.type == "cpu" else ACCELERATOR_BLOCK
    return chunk_tokens or tokens, vocab_slice


_LOWEST = torch.finfo(torch.float32).min  # a masked (-inf) logit's log-prob is clamped here: p log p = 0, not NaN


@dataclass(frozen=True)
class Head:
    """How a model's logits come from its LM head's input.

    weight (V, H) and bias (V,) or None: a linear head; weight None: the inputs are the logits themselves (a model
    whose head is not a plain linear layer keeps its own logits). `vocab`: only the first `vocab` ids are scored
    (a padded vocabulary's extra rows never are); None: all. `scale` multiplies the logits (Cohere's
    `logit_scale`, 1 / Granite's `logits_scaling`), then `softcap` c bounds them to c tanh(z / c) (Gemma).
    """

    weight: Tensor | None
    bias: Tensor | None = None
    vocab: int | None = None
    scale: float = 1.0
    softcap: float | None = None

    def width(self, inputs: Tensor) -> int:
        """The ids scored: `vocab`, or every row of the head (every column of logits given as inputs)."""
        full = inputs.shape[-1] if self.weight is None else self.weight.shape[0]
        return full if self.vocab is None else min(self.vocab, full)

    def compute_dtype(self, inputs: Tensor) -> torch.dtype:
        """The dtype the head's matmul runs in: autocast's where it is on (as the model's own head would), else
        the weight's."""
        device = inputs.device.type
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return inputs.dtype if self.weight is None else self.weight.dtype

    def raw_logits(self, inputs: Tensor, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        """The head's output for ids start..stop-1 before scale and soft-cap, computed in `dtype`: (n, H) -> (n, v)
        in `stat_dtype(dtype)`."""
        if self.weight is None:
            return inputs[:, start:stop].to(stat_dtype(dtype), copy=True)
        bias = None if self.bias is None else self.bias[start:stop].to(dtype)
        logits = torch.nn.functional.linear(inputs.to(dtype), self.weight[start:stop].to(dtype), bias)
        return logits.to(stat_dtype(dtype))

    def logits(self, raw: Tensor, temperature: float) -> Tensor:
        """f(raw) / temperature: (n, v) -> (n, v). Overwrites `raw` unless there is a soft-cap (whose slope
        needs it)."""
        if self.softcap is None:
            return raw.mul_(self.scale / temperature)
        return torch.tanh(raw * (self.scale / self.softcap)).mul_(self.softcap / temperature)

    def logit_slope(self, raw: Tensor, temperature: float) -> Tensor | float:
        """d logits / d raw: (n, v), or a float where it is constant."""
        if self.softcap is None:
            return self.scale / temperature
        t = torch.tanh(raw * (self.scale / self.softcap))
        return t.mul_(t).neg_().add_(1.0).mul_(self.scale / temperature)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the softmax statistics are computed in: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class HeadStats:
    """Per-token results of `head_stats`, each (N,): the log-prob of the given token, the entropy (None when not
    asked), and against a reference, the exact KL(pi || pi_ref) and the reference's log-prob (else None). In
    float32 (float64 for a float64 model)."""

    logprobs: Tensor
    entropy: Tensor | None
    kl: Tensor | None = None
    ref_logprobs: Tensor | None = None


def head_stats(
    inputs: Tensor,
    tokens: Tensor,
    head: Head,
    temperature: float = 1.0,
    reference: tuple[Tensor, Head] | None = None,
    entropy: bool = True,
    chunk_tokens: int | None = None,
    vocab_slice: int | None = None,
) -> HeadStats:
    """Log-prob of `tokens`, entropy and (with `reference`) the exact KL, differentiable in `inputs` and the head's
    weight and bias: inputs (N, H), or logits (N, V) for a head without weight, tokens (N,) long -> (N,) each.

    `reference`: its (N, H) inputs (or logits) and head, constants (the frozen reference). The logits exist one
    `chunk_tokens` x `vocab_slice` block at a time, forward and backward (None: `block_shape` of the device).
    """
    if tokens.shape != inputs.shape[:1]:
        raise ValueError(f"head_stats: tokens {tuple(tokens.shape)} do not match inputs {tuple(inputs.shape)}")
    ref_inputs, ref_head = reference if reference is not None else (None, None)
    if ref_inputs is not None and ref_inputs.requires_grad:
        raise ValueError("head_stats: the reference's inputs must not require grad (a frozen reference)")
    if ref_inputs is not None and ref_head is not None and ref_head.width(ref_inputs) != head.width(inputs):
        raise ValueError(
            f"head_stats: the policy scores {head.width(inputs)} ids and the reference {ref_head.width(ref_inputs)}; "
            "the exact KL needs one vocabulary"
        )
    default_tokens, default_slice = block_shape(inputs.device, chunk_tokens)
    blocks = _Blocks(head, inputs, ref_head, ref_inputs, temperature, default_tokens, vocab_slice or default_slice)
    weight = head.weight if head.weight is not None else inputs.new_empty(0)
    bias = head.bias if head.bias is not None else inputs.new_empty(0)
    logprobs, ent, kl, ref_logprobs = _HeadStatsFunction.apply(inputs, weight, bias, tokens, blocks, entropy)
    if ref_head is None:
        return HeadStats(logprobs, ent if entropy else None)
    return HeadStats(logprobs, ent if entropy else None, kl, ref_logprobs)


def _spans(length: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, length)) for start in range(0, length, size)]


@dataclass(frozen=True)
class _Blocks:
    """The (chunk, slice) blocks of the logits and how to compute each: the policy's head over `inputs`, the
    reference's over `ref_inputs` (None: no reference), at `temperature`."""

    head: Head
    inputs: Tensor
    ref_head: Head | None
    ref_inputs: Tensor | None
    temperature: float
    chunk_tokens: int
    vocab_slice: int

    @property
    def dtype(self) -> torch.dtype:
        return self.head.compute_dtype(self.inputs)

    def chunks(self) -> list[tuple[int, int]]:
        return _spans(self.inputs.shape[0], self.chunk_tokens)

    @property
    def single(self) -> bool:
        """Whether the logits are one block."""
        return len(self.chunks()) == 1 and len(self.slices()) == 1

    def slices(self) -> list[tuple[int, int]]:
        return _spans(self.head.width(self.inputs), self.vocab_slice)

    def raw(self, rows: tuple[int, int], ids: tuple[int, int]) -> Tensor:
        """The policy's head output before scale, soft-cap and temperature: (n, v)."""
        return self.head.raw_logits(self.inputs[rows[0] : rows[1]], *ids, self.dtype)

    def reference(self, rows: tuple[int, int], ids: tuple[int, int]) -> Tensor:
        """The reference's logits at the temperature: (n, v)."""
        assert self.ref_head is not None and self.ref_inputs is not None
        ref_inputs = self.ref_inputs[rows[0] : rows[1]]
        raw = self.ref_head.raw_logits(ref_inputs, *ids, self.ref_head.compute_dtype(ref_inputs))
        return self.ref_head.logits(raw, self.temperature)


def _picked(z: Tensor, tokens: Tensor, start: int) -> Tensor:
    """z[i, tokens[i] - start] where the token lies in this slice, else 0: (n, v), (n,) -> (n,)."""
    index = tokens - start
    inside = (index >= 0) & (index < z.shape[1])
    values = z.gather(1, index.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    return torch.where(inside, values, 0.0)


class _OnlineLSE:
    """log sum_v exp(z_v) of one chunk's rows over vocabulary slices: a running max m and s = sum exp(z - m), plus
    the picked logit; with `entropy`, e = sum exp(z - m) (z - m) (H = log s - e / s); with a reference's logits y,
    c = sum exp(z - m) (z - y) (KL = c / s - lse(z) + lse(y)). Each slice rescales the sums to the new max."""

    def __init__(self, rows: int, like: Tensor, entropy: bool, against_reference: bool) -> None:
        self.m = torch.full((rows,), float("-inf"), dtype=like.dtype, device=like.device)
        self.s = torch.zeros_like(self.m)
        self.picked = torch.zeros_like(self.m)
        self.e = torch.zeros_like(self.m) if entropy else None
        self.c = torch.zeros_like(self.m) if against_reference else None

    def add(self, z: Tensor, picked: Tensor, y: Tensor | None = None) -> None:
        """One slice: logits z (n, v), overwritten, their picked values (n,) (0 where the token lies elsewhere),
        the reference's logits y (n, v) for the KL."""
        new_m = torch.maximum(self.m, z.amax(1))
        alpha = torch.exp(self.m - new_m).nan_to_num_(nan=0.0)  # 0 at the first slice (m = -inf)
        if self.e is not None:
            self.e = alpha * (self.e + torch.where(self.s > 0, (self.m - new_m) * self.s, 0.0))
        if self.c is not None:
            self.c = alpha * self.c
        self.s, self.m = alpha * self.s, new_m
        self.picked = self.picked + picked
        difference = z - y if self.c is not None and y is not None else None  # (n, v)
        shifted = z.sub_(new_m[:, None]).clamp_(min=_LOWEST)  # (n, v), <= 0, in place: one block fewer
        weights = shifted.exp()  # (n, v)
        self.s = self.s + weights.sum(1)
        if self.e is not None:
            self.e = self.e + torch.einsum("nv,nv->n", shifted, weights)  # no (n, v) product: shifted stays
        if self.c is not None and difference is not None:
            inf = float("inf")
            self.c = self.c + difference.mul_(weights).nan_to_num_(nan=0.0, posinf=inf, neginf=-inf).sum(1)

    def lse(self) -> Tensor:
        return self.m + self.s.log()


class _HeadStatsFunction(torch.autograd.Function):
    """`head_stats` as one autograd node: the forward keeps per token only the log-sum-exps, the entropy and the
    KL; the backward recomputes each block's logits to form the gradient of the head's output there."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, tokens, blocks: _Blocks, entropy: bool):
        N, with_ref = inputs.shape[0], blocks.ref_head is not None
        logprobs, ent, kl, ref_logprobs, lse, ref_lse = (
            inputs.new_zeros(N, dtype=stat_dtype(blocks.dtype)) for _ in range(6)
        )
        # a single block (a small vocabulary and batch) is kept for the backward instead of recomputed
        keep = any(ctx.needs_input_grad[:3]) and blocks.single and blocks.head.softcap is None
        kept: tuple[Tensor, Tensor | None] | None = None
        with torch.no_grad(), torch.autocast(inputs.device.type, enabled=False):
            for rows in blocks.chunks():
                r0, r1 = rows
                tok = tokens[r0:r1]
                policy = _OnlineLSE(r1 - r0, lse, entropy, with_ref)
                ref = _OnlineLSE(r1 - r0, lse, False, False)
                for ids in blocks.slices():
                    z = blocks.head.logits(blocks.raw(rows, ids), blocks.temperature)
                    y = blocks.reference(rows, ids) if with_ref else None
                    policy.add(z, _picked(z, tok, ids[0]), y)  # shifts z in place (`add` reads y first)
                    if y is not None:
                        ref.add(y, _picked(y, tok, ids[0]))  # shifts y in place
                    if keep:  # z - max - log s = log p, y - max - log s_ref = log q
                        kept = (
                            z.sub_(policy.s.log()[:, None]),
                            y.sub_(ref.s.log()[:, None]) if y is not None else None,
                        )
                    del z, y  # before the next slice's: one block alive at a time
                lse[r0:r1] = policy.lse()
                logprobs[r0:r1] = policy.picked - lse[r0:r1]
                if policy.e is not None:
                    ent[r0:r1] = policy.s.log() - policy.e / policy.s
                if policy.c is not None:
                    ref_lse[r0:r1] = ref.lse()
                    kl[r0:r1] = policy.c / policy.s - lse[r0:r1] + ref_lse[r0:r1]
                    ref_logprobs[r0:r1] = ref.picked - ref_lse[r0:r1]
        ctx.save_for_backward(inputs, weight, bias, tokens, lse, ent, kl, ref_lse)
        ctx.blocks, ctx.entropy, ctx.kept = blocks, entropy, kept
        ctx.mark_non_differentiable(ref_logprobs)
        ctx.set_materialize_grads(False)
        return logprobs, ent, kl, ref_logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, grad_kl, _grad_ref_logprobs):
        inputs, weight, bias, tokens, lse, ent, kl, ref_lse = ctx.saved_tensors
        blocks: _Blocks = ctx.blocks
        head, tau = blocks.head, blocks.temperature
        grad_entropy = grad_entropy if ctx.entropy else None
        grad_kl = grad_kl if blocks.ref_head is not None else None
        if grad_logprobs is None and grad_entropy is None and grad_kl is None:
            return None, None, None, None, None, None
        want_inputs, want_weight, want_bias = ctx.needs_input_grad[:3]
        grads = _HeadGrads(
            torch.zeros_like(inputs) if want_inputs else None,
            torch.zeros_like(weight) if want_weight and head.weight is not None else None,
            torch.zeros_like(bias, dtype=lse.dtype) if want_bias and head.bias is not None else None,
        )
        with torch.no_grad(), torch.autocast(inputs.device.type, enabled=False):
            for rows in blocks.chunks():
                r0, r1 = rows
                g_lp = grad_logprobs[r0:r1, None] if grad_logprobs is not None else None  # (n, 1)
                g_ent = grad_entropy[r0:r1, None] if grad_entropy is not None else None
                g_kl = grad_kl[r0:r1, None] if grad_kl is not None else None
                for ids in blocks.slices():
                    kept, ctx.kept = ctx.kept, None  # the one block the forward kept, used once
                    slope: Tensor | float
                    if kept is not None:
                        raw, slope, logp = None, head.scale / tau, kept[0]
                    else:
                        raw = blocks.raw(rows, ids)  # (n, v)
                        slope = head.logit_slope(raw, tau)
                        logp = head.logits(raw, tau).sub_(lse[r0:r1, None]).clamp_(min=_LOWEST)  # (n, v)
                    # dlogp_y/dz = onehot_y - p; d(-H)/dz = p (log p + H); dKL/dz = p (log p - log q - KL)
                    coefficient = torch.zeros_like(logp) if g_lp is None else g_lp.expand_as(logp).clone()
                    if g_ent is not None:
                        coefficient.add_(g_ent * (logp + ent[r0:r1, None]))
                    if g_kl is not None:
                        if kept is not None and kept[1] is not None:
                            logq = kept[1]
                        else:
                            logq = blocks.reference(rows, ids).sub_(ref_lse[r0:r1, None]).clamp_(min=_LOWEST)
                        coefficient.sub_(g_kl * logq.neg_().add_(logp).sub_(kl[r0:r1, None]))
                        del logq
                    grad_z = coefficient.mul_(logp.exp_()).neg_()  # (n, v)
                    if g_lp is not None:
                        index = tokens[r0:r1] - ids[0]
                        inside = ((index >= 0) & (index < ids[1] - ids[0])).nonzero().squeeze(1)
                        grad_z[inside, index[inside]] += g_lp[inside, 0]
                    grads.add(blocks, rows, ids, grad_z.mul_(slope))
                    del raw, slope, logp, coefficient, grad_z, kept  # before the next slice's
        grad_bias = grads.bias.to(bias.dtype) if grads.bias is not None else None
        return grads.inputs, grads.weight, grad_bias, None, None, None


@dataclass
class _HeadGrads:
    """The gradients `_HeadStatsFunction.backward` accumulates (None: not wanted)."""

    inputs: Tensor | None
    weight: Tensor | None
    bias: Tensor | None

    def add(self, blocks: _Blocks, rows: tuple[int, int], ids: tuple[int, int], grad_raw: Tensor) -> None:
        """One block's part, from the gradient of the head's raw output there, grad_raw (n, v)."""
        (r0, r1), (v0, v1) = rows, ids
        weight = blocks.head.weight
        if weight is None:  # the inputs were the logits
            if self.inputs is not None:
                self.inputs[r0:r1, v0:v1] += grad_raw.to(self.inputs.dtype)
            return
        g = grad_raw.to(blocks.dtype)
        if self.inputs is not None:
            self.inputs[r0:r1] += (g @ weight[v0:v1].to(blocks.dtype)).to(self.inputs.dtype)
        if self.weight is not None:
            self.weight[v0:v1] += (g.T @ blocks.inputs[r0:r1].to(blocks.dtype)).to(self.weight.dtype)
        if self.bias is not None:
            self.bias[v0:v1] += grad_raw.sum(0)
