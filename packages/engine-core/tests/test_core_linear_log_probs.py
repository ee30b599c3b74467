"""The chunked hidden-state path gives the numbers of the full-logits path (values and gradients, fp32), on
one rank holding the whole vocabulary and on two gloo ranks holding half of a padded vocabulary each."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from drivetrain_engine_core.kit import linear_log_probs
from drivetrain_engine_core.testing.launcher import run_distributed

TOKENS, HIDDEN, VOCAB = 37, 16, 101


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float64).float()
    # NOTE: logits of order 1 (log-probs near -log(VOCAB)), so that 1e-6 is a few float32 ulps.
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) / HIDDEN**0.5).float()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def full_logits_path(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: one float32 log-softmax over the whole ``(tokens, vocab)`` logits, under autograd."""
    log_softmax = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_probs, -(log_softmax.exp() * log_softmax).sum(-1) if compute_entropy else None


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
    expected = full_logits_path(hidden @ weight.T, labels, temperature, compute_entropy)
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
    expected = full_logits_path(hidden16 @ weight16.T, labels, 1.0, True)
    expected_grads = torch.autograd.grad(loss_of(*expected), (hidden16, weight16))
    got = linear_log_probs(hidden16, weight16, labels, temperature=1.0, compute_entropy=True, chunk_size=8)
    got_grads = torch.autograd.grad(loss_of(*got), (hidden16, weight16))
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    for grad, reference in zip(got_grads, expected_grads, strict=True):
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad.float(), reference.float(), atol=0.1, rtol=0.02)


def test_padded_rows_beyond_vocab_size_are_left_out():
    hidden, weight, labels = inputs(seed=5)
    padded = torch.cat([weight.detach(), torch.full((3, HIDDEN), 9.0)]).requires_grad_()
    expected = full_logits_path(hidden @ weight.T, labels, 0.7, True)
    expected_grads = torch.autograd.grad(loss_of(*expected), (hidden, weight))
    got = linear_log_probs(
        hidden, padded, labels, temperature=0.7, compute_entropy=True, chunk_size=8, vocab_size=VOCAB
    )
    grad_hidden, grad_padded = torch.autograd.grad(loss_of(*got), (hidden, padded))
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_hidden, expected_grads[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_padded[:VOCAB], expected_grads[1], atol=1e-6, rtol=0)
    assert torch.equal(grad_padded[VOCAB:], torch.zeros(3, HIDDEN))


def test_a_vocab_start_without_a_group_is_refused():
    hidden, weight, labels = inputs(seed=0)
    with pytest.raises(ValueError, match="vocab_start=51 without a group"):
        linear_log_probs(
            hidden, weight, labels, temperature=1.0, compute_entropy=False, chunk_size=8, vocab_start=51
        )


# Two ranks, each holding SHARD rows of the projection: VOCAB = 101 is padded to 102, so rank 1's last row is
# padding; with a real vocabulary of SMALL_VOCAB, rank 1 holds nothing but padding.
SHARD, SMALL_VOCAB = (VOCAB + 1) // 2, 40
SHARDED_CASES = [
    (temperature, compute_entropy, vocab)
    for vocab in (VOCAB, SMALL_VOCAB)
    for temperature in (1.0, 0.7)
    for compute_entropy in (True, False)
]


def _sharded_case(rank: int, temperature: float, compute_entropy: bool, vocab: int) -> dict:
    hidden, weight, labels = inputs(seed=11)
    labels = labels % vocab
    padded = torch.cat([weight.detach()[:vocab], torch.full((2 * SHARD - vocab, HIDDEN), 9.0)])
    hidden = hidden.detach().requires_grad_()
    shard = padded[rank * SHARD : (rank + 1) * SHARD].clone().requires_grad_()
    log_probs, entropy = linear_log_probs(
        hidden,
        shard,
        labels,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_size=8,
        group=dist.group.WORLD,
        vocab_start=rank * SHARD,
        vocab_size=vocab,
    )
    grad_hidden, grad_shard = torch.autograd.grad(loss_of(log_probs, entropy), (hidden, shard))
    return {
        "log_probs": log_probs.detach(),
        "entropy": entropy.detach() if entropy is not None else None,
        "grad_hidden": grad_hidden,
        "grad_shard": grad_shard,
    }


def _sharded_worker(rank: int, world_size: int) -> list[dict]:
    del world_size
    return [_sharded_case(rank, *case) for case in SHARDED_CASES]


@pytest.mark.slow
def test_a_vocabulary_split_over_two_ranks_matches_the_full_vocabulary():
    per_rank = run_distributed(_sharded_worker, world_size=2, timeout_s=180)
    for index, (temperature, compute_entropy, vocab) in enumerate(SHARDED_CASES):
        hidden, weight, labels = inputs(seed=11)
        labels = labels % vocab
        real = weight.detach()[:vocab].requires_grad_()
        expected = full_logits_path(hidden @ real.T, labels, temperature, compute_entropy)
        grad_hidden, grad_weight = torch.autograd.grad(loss_of(*expected), (hidden, real))
        expected_weight = torch.cat([grad_weight, torch.zeros(2 * SHARD - vocab, HIDDEN)])
        for rank, results in enumerate(per_rank):
            got = results[index]
            torch.testing.assert_close(got["log_probs"], expected[0], atol=1e-6, rtol=0)
            if compute_entropy:
                torch.testing.assert_close(got["entropy"], expected[1], atol=1e-6, rtol=0)
            torch.testing.assert_close(got["grad_hidden"], grad_hidden, atol=1e-6, rtol=0)
            torch.testing.assert_close(
                got["grad_shard"], expected_weight[rank * SHARD : (rank + 1) * SHARD], atol=1e-6, rtol=0
            )
