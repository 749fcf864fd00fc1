"""Log-probs, entropy and the exact KL from logits or from the LM head's input in chunks
(`lit_rlhf.algorithms.chunked_logprobs`), and the response slice of a forward (`response_positions`).

Every expected value is computed independently: a number derived by hand next to it, a loop in float64 Python, or
the full (B, T, V) log-softmax in float64 (`conftest.full_logprobs` and friends).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.algorithms.chunked_logprobs import Head, head_stats
from lit_rlhf.models.forward import response_positions

HYP = settings(max_examples=50, deadline=None)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_log_softmax_row(row: list[float], temperature: float = 1.0) -> list[float]:
    """log softmax of one row of logits in float64 Python, the slow obvious way."""
    z = [v / temperature for v in row]
    m = max(z)
    log_norm = m + math.log(sum(math.exp(v - m) for v in z))
    return [v - log_norm for v in z]


def stats_of_logits(logits, tokens=None, temperature=1.0, ref_logits=None, chunk=1024, vocab_slice=32768):
    """`head_stats` over (B, T, V) logits (a head without weight), back on the (B, T) grid."""
    B, T, V = logits.shape
    tokens = torch.zeros(B, T, dtype=torch.long) if tokens is None else tokens
    reference = None if ref_logits is None else (ref_logits.reshape(-1, V), Head(None))
    stats = head_stats(
        logits.reshape(-1, V), tokens.reshape(-1), Head(None), temperature, reference, True, chunk, vocab_slice
    )
    return {name: None if v is None else v.view(B, T) for name, v in vars(stats).items()}


def logprobs_from_logits(logits, tokens, temperature=1.0):
    return stats_of_logits(logits, tokens, temperature)["logprobs"]


def entropy_from_logits(logits, temperature=1.0):
    return stats_of_logits(logits, None, temperature)["entropy"]


def full_kl_from_logits(logits, ref_logits, temperature=1.0):
    return stats_of_logits(logits, None, temperature, ref_logits)["kl"]


# ----------------------------------------------------------------------------- response slice


def test_response_positions_slice_position_encoding():
    B, P, T, V = 2, 3, 4, 5
    logits = torch.empty(B, P + T, V)
    for b in range(B):
        for pos in range(P + T):
            for v in range(V):
                logits[b, pos, v] = 1000 * b + pos  # the value says which position it came from
    out = response_positions(logits, P)
    assert out.shape == (B, T, V)
    for b in range(B):
        for t in range(T):
            # position P-1 predicts response token 0, so response slot t holds position P-1+t
            assert (out[b, t] == 1000 * b + (P - 1 + t)).all()
    # explicit response length shorter than what is there
    out2 = response_positions(logits, P, response_len=2)
    assert out2.shape == (B, 2, V)
    assert (out2[:, 0] == out[:, 0]).all() and (out2[:, 1] == out[:, 1]).all()
    assert out2[0, 0, 0].item() == P - 1 and out2[1, 1, 0].item() == 1000 + P


def test_response_positions_next_token_alignment_with_logprobs():
    # logits that put 10 on the *next* token of the sequence at every position: the response tokens then all
    # get log p = 10 - log(e^10 + (V-1) * e^0), which only happens when the slice is aligned correctly.
    B, P, T, V = 2, 4, 3, 6
    ids = torch.tensor([[1, 2, 3, 4, 5, 0, 2], [3, 3, 1, 0, 4, 4, 5]])
    logits = torch.zeros(B, P + T, V)
    for b in range(B):
        for pos in range(P + T - 1):
            logits[b, pos, ids[b, pos + 1]] = 10.0
    lp = logprobs_from_logits(response_positions(logits, P), ids[:, P:])
    expected = 10.0 - math.log(math.exp(10.0) + (V - 1))
    assert torch.allclose(lp, torch.full((B, T), expected), atol=1e-5)


# ----------------------------------------------------------------------------- log-probs and entropy


def test_logprobs_hand_example_with_temperature():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])  # (1, 2, 3)
    tokens = torch.tensor([[2, 1]])
    # T = 1: log p(2) = 3 - log(e + e^2 + e^3) = -0.40760596; uniform row: -log 3
    lp = logprobs_from_logits(logits, tokens)
    assert lp.dtype == torch.float32 and lp.shape == (1, 2)
    assert lp[0, 0].item() == pytest.approx(3 - math.log(math.e + math.e**2 + math.e**3), abs=1e-6)
    assert lp[0, 0].item() == pytest.approx(-0.40760596, abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(-math.log(3), abs=1e-6)
    # T = 2: logits become 0.5, 1, 1.5: log p(2) = 1.5 - log(e^0.5 + e^1 + e^1.5)
    lp2 = logprobs_from_logits(logits, tokens, temperature=2.0)
    assert lp2[0, 0].item() == pytest.approx(1.5 - math.log(math.exp(0.5) + math.e + math.exp(1.5)), abs=1e-6)
    assert lp2[0, 1].item() == pytest.approx(-math.log(3), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_log_softmax_and_loop(temperature):
    B, T, V = 3, 4, 11
    logits = 3.0 * torch.randn(B, T, V, generator=gen(3))
    tokens = torch.randint(0, V, (B, T), generator=gen(4))
    lp = logprobs_from_logits(logits, tokens, temperature=temperature)
    ref = torch.log_softmax(logits.double() / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    for b in range(B):
        for t in range(T):
            row = ref_log_softmax_row(logits[b, t].tolist(), temperature)
            assert lp[b, t].item() == pytest.approx(row[tokens[b, t].item()], abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_bf16_input_gives_float32(temperature):
    B, T, V = 2, 5, 50
    logits = (4.0 * torch.randn(B, T, V, generator=gen(5))).to(torch.bfloat16)
    tokens = torch.randint(0, V, (B, T), generator=gen(6))
    lp = logprobs_from_logits(logits, tokens, temperature=temperature)
    assert lp.dtype == torch.float32
    # reference from the very same bf16 values, upcast to float64
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)


def test_logprobs_and_entropy_over_1024_rows_chunked():
    B, T, V = 3, 500, 17  # 1500 rows: two chunks of 1024 rows, the second one partial
    logits = 2.0 * torch.randn(B, T, V, generator=gen(7))
    tokens = torch.randint(0, V, (B, T), generator=gen(8))
    lp = logprobs_from_logits(logits, tokens, temperature=0.9)
    logp_ref = torch.log_softmax(logits.double() / 0.9, -1)
    ref = logp_ref.gather(-1, tokens[..., None]).squeeze(-1)
    assert lp.shape == (B, T)
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    # rows on both sides of the chunk border (flat rows 1023 and 1024 are (2, 23) and (2, 24)), by loop
    for flat in (0, 1023, 1024, 1499):
        b, t = divmod(flat, T)
        row = ref_log_softmax_row(logits[b, t].tolist(), 0.9)
        assert lp[b, t].item() == pytest.approx(row[tokens[b, t].item()], abs=1e-5)
    ent = entropy_from_logits(logits, temperature=0.9)
    ent_ref = -(logp_ref.exp() * logp_ref).sum(-1)
    assert torch.allclose(ent.double(), ent_ref, atol=1e-5)


def test_logprobs_small_chunks_and_vocabulary_slices():
    # chunks of 4 rows and slices of 3 ids, neither dividing 15 rows x 7 ids: every boundary case on a tiny tensor
    B, T, V = 3, 5, 7
    logits = torch.randn(B, T, V, generator=gen(9))
    ref_logits = torch.randn(B, T, V, generator=gen(10))
    tokens = torch.randint(0, V, (B, T), generator=gen(11))
    stats = stats_of_logits(logits, tokens, 1.0, ref_logits, chunk=4, vocab_slice=3)
    lp, ent, kl = stats["logprobs"], stats["entropy"], stats["kl"]
    for b in range(B):
        for t in range(T):
            row = ref_log_softmax_row(logits[b, t].tolist())
            ref_row = ref_log_softmax_row(ref_logits[b, t].tolist())
            assert lp[b, t].item() == pytest.approx(row[tokens[b, t].item()], abs=1e-5)
            assert ent[b, t].item() == pytest.approx(-sum(math.exp(v) * v for v in row), abs=1e-5)
            expected_kl = sum(math.exp(v) * (v - r) for v, r in zip(row, ref_row))
            assert kl[b, t].item() == pytest.approx(expected_kl, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_entropy_matches_loop(temperature):
    B, T, V = 2, 3, 9
    logits = 2.0 * torch.randn(B, T, V, generator=gen(12))
    ent = entropy_from_logits(logits, temperature=temperature)
    assert ent.dtype == torch.float32 and ent.shape == (B, T)
    for b in range(B):
        for t in range(T):
            row = ref_log_softmax_row(logits[b, t].tolist(), temperature)
            expected = -sum(math.exp(v) * v for v in row)
            assert ent[b, t].item() == pytest.approx(expected, abs=1e-5)


def test_entropy_hand_values_and_bf16():
    V = 8
    uniform = torch.zeros(1, 1, V, dtype=torch.bfloat16)
    # uniform distribution: entropy log V; output float32 from bf16 input
    ent = entropy_from_logits(uniform)
    assert ent.dtype == torch.float32
    assert ent.item() == pytest.approx(math.log(V), abs=1e-6)
    # two-way with logits (0, log 3): p = (1/4, 3/4), H = -(1/4 log 1/4 + 3/4 log 3/4) = 0.5623351446
    two = torch.tensor([[[0.0, math.log(3.0)]]])
    assert entropy_from_logits(two).item() == pytest.approx(0.5623351446, abs=1e-6)
    # near one-hot: entropy ~ 0
    peaked = torch.tensor([[[50.0, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_kl_matches_vocab_loop(temperature):
    B, T, V = 2, 3, 7
    logits = 2.0 * torch.randn(B, T, V, generator=gen(15))
    ref_logits = 2.0 * torch.randn(B, T, V, generator=gen(16))
    kl = full_kl_from_logits(logits, ref_logits, temperature=temperature)
    assert kl.dtype == torch.float32 and kl.shape == (B, T)
    for b in range(B):
        for t in range(T):
            logp = ref_log_softmax_row(logits[b, t].tolist(), temperature)
            logq = ref_log_softmax_row(ref_logits[b, t].tolist(), temperature)
            expected = 0.0
            for v in range(V):
                expected += math.exp(logp[v]) * (logp[v] - logq[v])
            assert kl[b, t].item() == pytest.approx(expected, abs=1e-5)
            assert kl[b, t].item() >= -1e-6


def test_full_kl_hand_values():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 log 2 + 1/2 log(2/3) = 1/2 log(4/3) = 0.1438410362
    logits = torch.tensor([[[0.0, 0.0]]])
    ref_logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert full_kl_from_logits(logits, ref_logits).item() == pytest.approx(0.1438410362, abs=1e-6)
    # identical distributions (even shifted logits): exactly 0 up to rounding
    x = torch.randn(2, 3, 5, generator=gen(17))
    assert torch.allclose(full_kl_from_logits(x, x + 3.0), torch.zeros(2, 3), atol=1e-6)
    # bf16 input: float32 output, equal to the loop on the upcast values
    xb = x.to(torch.bfloat16)
    yb = torch.randn(2, 3, 5, generator=gen(18)).to(torch.bfloat16)
    kl = full_kl_from_logits(xb, yb)
    assert kl.dtype == torch.float32
    logp = ref_log_softmax_row(xb[1, 2].float().tolist())
    logq = ref_log_softmax_row(yb[1, 2].float().tolist())
    assert kl[1, 2].item() == pytest.approx(sum(math.exp(a) * (a - b) for a, b in zip(logp, logq)), abs=1e-5)


@HYP
@given(st.integers(min_value=0, max_value=2**31 - 1), st.floats(min_value=0.3, max_value=3.0))
def test_full_kl_nonnegative(seed, temperature):
    g = gen(seed)
    logits = 5.0 * torch.randn(3, 4, 6, generator=g)
    ref_logits = 5.0 * torch.randn(3, 4, 6, generator=g)
    assert (full_kl_from_logits(logits, ref_logits, temperature) >= -1e-6).all()


# ----------------------------------------------------------------------------- from the head's input, with gradients


def autograd_reference(hidden, head: Head, tokens, temperature, ref_hidden, ref_head: Head):
    """Log-prob, entropy, exact KL and reference log-prob from the full (N, V) logits by autograd, float64."""

    def logits(h, hd):
        z = h @ hd.weight.T + (hd.bias if hd.bias is not None else 0.0)
        z = z * hd.scale
        if hd.softcap is not None:
            z = torch.tanh(z / hd.softcap) * hd.softcap
        return z[:, : hd.vocab] / temperature

    logp, logq = torch.log_softmax(logits(hidden, head), -1), torch.log_softmax(logits(ref_hidden, ref_head), -1)
    picked = logp.gather(1, tokens[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return picked, entropy, kl, logq.gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("chunk, vocab_slice", [(1024, 32768), (5, 7), (37, 101), (8, 50)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scale, softcap", [(1.0, None), (1.3, None), (0.8, 3.0)])
def test_values_and_gradients_equal_autograd_over_the_full_logits(chunk, vocab_slice, bias, scale, softcap):
    """A linear head (bias, logit scale, soft-cap, a vocabulary cut at 90 of 101 rows, temperature 0.7), chunks and
    slices that do and do not divide N = 37 tokens and V = 101 ids: every output and the gradients of the hidden
    states, the weight and the bias equal autograd over the full logits in float64."""
    N, H, V, vocab = 37, 16, 101, 90
    g = gen(20)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = (0.7 * torch.randn(V, H, generator=g, dtype=torch.float64)).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_() if bias else None
    ref_hidden, ref_weight = (
        torch.randn(N, H, generator=g, dtype=torch.float64),
        torch.randn(V, H, generator=g).double(),
    )
    tokens = torch.randint(0, vocab, (N,), generator=g)
    head, ref_head = Head(weight, b, vocab, scale, softcap), Head(ref_weight, None, vocab, scale, softcap)
    weights = [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3)]  # a loss over all three outputs

    stats = head_stats(hidden, tokens, head, 0.7, (ref_hidden, ref_head), True, chunk, vocab_slice)
    expected = autograd_reference(hidden, head, tokens, 0.7, ref_hidden, ref_head)
    ours = (stats.logprobs, stats.entropy, stats.kl, stats.ref_logprobs)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    leaves = [hidden, weight] + ([b] if bias else [])
    grads = torch.autograd.grad(sum((w * x).sum() for w, x in zip(weights, ours[:3], strict=True)), leaves)
    want_grads = torch.autograd.grad(sum((w * x).sum() for w, x in zip(weights, expected[:3], strict=True)), leaves)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_frozen_head_gets_no_gradient_and_an_unused_output_costs_none():
    N, H, V = 9, 8, 30
    g = gen(21)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)  # frozen (the LoRA base head, the reference)
    tokens = torch.randint(0, V, (N,), generator=g)
    stats = head_stats(hidden, tokens, Head(weight), 1.0, entropy=False)
    assert stats.entropy is None and stats.kl is None
    (grad,) = torch.autograd.grad(stats.logprobs.sum(), hidden)
    logp = torch.log_softmax(hidden @ weight.T, -1)
    (expected,) = torch.autograd.grad(logp.gather(1, tokens[:, None]).sum(), hidden)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_mismatched_inputs_are_refused():
    h, w = torch.randn(4, 3), torch.randn(10, 3)
    with pytest.raises(ValueError, match="tokens"):
        head_stats(h, torch.zeros(5, dtype=torch.long), Head(w))
    with pytest.raises(ValueError, match="one vocabulary"):
        head_stats(h, torch.zeros(4, dtype=torch.long), Head(w), reference=(h, Head(torch.randn(12, 3))))
    with pytest.raises(ValueError, match="must not require grad"):
        head_stats(h, torch.zeros(4, dtype=torch.long), Head(w), reference=(h.requires_grad_(), Head(w)))
