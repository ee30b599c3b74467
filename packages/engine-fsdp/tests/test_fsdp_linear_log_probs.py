"""The chunked hidden-state path gives the numbers of the full-logits path (values and gradients, fp32)."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ForwardOptions
from drivetrain_engine_fsdp.linear_log_probs import linear_log_probs
from drivetrain_engine_fsdp.outputs import next_token_log_probs

TOKENS, HIDDEN, VOCAB = 37, 16, 101


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float64).float()
    # NOTE: logits of order 1 (log-probs near -log(VOCAB)), so that 1e-6 is a few float32 ulps.
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) / HIDDEN**0.5).float()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def loss_of(log_probs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    # Different weights per position so that every gradient entry matters, at a token-mean loss's scale.
    weights = torch.linspace(-1.0, 2.0, TOKENS) / TOKENS
    total = (log_probs * weights).sum()
    return total if entropy is None else total + (entropy * weights.flip(0)).sum() * 0.3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("compute_entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_matches_the_full_logits_path(temperature, compute_entropy, chunk_size):
    hidden, weight, labels = inputs(seed=chunk_size)
    options = ForwardOptions(temperature=temperature, compute_entropy=compute_entropy)
    expected = next_token_log_probs(hidden @ weight.T, labels, options, chunk_size=TOKENS)
    expected_grads = torch.autograd.grad(loss_of(*expected), (hidden, weight))

    got = linear_log_probs(
        hidden,
        weight,
        labels,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_size=chunk_size,
    )
    got_grads = torch.autograd.grad(loss_of(*got), (hidden, weight))

    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=0)
    assert (got[1] is None) == (not compute_entropy)
    if compute_entropy:
        torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=0)
    for grad, reference in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, atol=1e-6, rtol=0)


def test_without_grad_it_keeps_no_graph():
    hidden, weight, labels = inputs(seed=0)
    with torch.no_grad():
        log_probs, _ = linear_log_probs(
            hidden, weight, labels, temperature=1.0, compute_entropy=False, chunk_size=8
        )
    assert log_probs.grad_fn is None and log_probs.dtype == torch.float32


def test_bf16_weights_give_bf16_gradients_close_to_the_full_path():
    hidden, weight, labels = inputs(seed=3)
    hidden16 = hidden.detach().bfloat16().requires_grad_()
    weight16 = weight.detach().bfloat16().requires_grad_()
    options = ForwardOptions(temperature=1.0, compute_entropy=True)
    expected = next_token_log_probs(hidden16 @ weight16.T, labels, options, chunk_size=TOKENS)
    expected_grads = torch.autograd.grad(loss_of(*expected), (hidden16, weight16))
    got = linear_log_probs(hidden16, weight16, labels, temperature=1.0, compute_entropy=True, chunk_size=8)
    got_grads = torch.autograd.grad(loss_of(*got), (hidden16, weight16))
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    for grad, reference in zip(got_grads, expected_grads, strict=True):
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad.float(), reference.float(), atol=0.1, rtol=0.02)
