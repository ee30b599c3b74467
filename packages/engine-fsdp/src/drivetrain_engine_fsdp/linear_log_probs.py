"""Per-token log-probs and entropy straight from the last hidden state and the output projection.

The logits of a micro-batch are ``(tokens, vocab)``: at 16k tokens and a 152k vocabulary that is 9.3 GiB in
float32, and a log-softmax holds several of them. :class:`LinearLogProbs` never holds more than one chunk of
them: forward computes each chunk's logits, keeps two numbers per token (the log-normaliser and the entropy)
and drops the chunk; backward computes each chunk's logits again and turns them into the gradients of the
hidden states and of the projection at once. Peak memory scales with ``chunk_size x vocab``, not with
``tokens x vocab``, for one extra matmul per chunk in backward.

The numbers are those of :func:`~drivetrain_engine_fsdp.outputs.next_token_log_probs` on
``hidden @ weight.T``: the logits are computed in the weight's dtype and taken to float32 before the softmax,
so the fp32 results agree to rounding (the CPU tests hold values and gradients to 1e-6).

Gradients, with ``z = logits / T``, ``p = softmax(z)`` and ``H = logsumexp(z) - sum(p * z)``::

    d log p[y] / dz = onehot(y) - p
    d H / dz        = -p * (z - (logsumexp(z) - H))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class LinearLogProbs(torch.autograd.Function):
    """``(log_probs, entropy)`` of ``labels`` under ``softmax(hidden @ weight.T / temperature)``, chunked."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        temperature: float,
        compute_entropy: bool,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        log_probs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        normaliser = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if compute_entropy else log_probs.new_zeros(0)
        for start, stop in _chunks(hidden.shape[0], chunk_size):
            index = labels[start:stop].unsqueeze(-1)
            scaled = _scaled_logits(hidden[start:stop], weight, temperature)
            picked = scaled.gather(-1, index).squeeze(-1)
            # NOTE: one fused log-softmax pass instead of logsumexp's max/subtract/exp/sum passes over the chunk;
            # the log-normaliser backward needs is then z[y] - log p[y].
            log_softmax = torch.log_softmax(scaled, dim=-1)
            del scaled
            log_probs[start:stop] = log_softmax.gather(-1, index).squeeze(-1)
            normaliser[start:stop] = picked - log_probs[start:stop]
            if compute_entropy:
                # H = -sum(p * log p)
                entropy[start:stop] = -(log_softmax.exp() * log_softmax).sum(-1)
        ctx.save_for_backward(hidden, weight, labels, normaliser, entropy)
        ctx.temperature, ctx.compute_entropy, ctx.chunk_size = temperature, compute_entropy, chunk_size
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: Tensor | None, grad_entropy: Tensor | None) -> tuple[Any, ...]:
        hidden, weight, labels, normaliser, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # NOTE: accumulated in float32 over chunks and cast once, which rounds less than one matmul per chunk
        # in the weight's dtype would.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start, stop in _chunks(hidden.shape[0], ctx.chunk_size):
            chunk = hidden[start:stop]
            scaled = _scaled_logits(chunk, weight, temperature)
            grad_scaled = _grad_of_scaled_logits(
                scaled,
                normaliser[start:stop],
                labels[start:stop],
                grad_log_probs[start:stop] if grad_log_probs is not None else None,
                entropy[start:stop] if ctx.compute_entropy and grad_entropy is not None else None,
                grad_entropy[start:stop] if ctx.compute_entropy and grad_entropy is not None else None,
            )
            if temperature != 1.0:
                grad_scaled.div_(temperature)  # d(logits / T) / d logits
            # Back into the matmul's dtype, as autograd of ``.float()`` does.
            grad_logits = grad_scaled.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ chunk).float()
        cast_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, cast_weight, None, None, None, None


def linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor | None]:
    """Per-position log-probs of ``labels`` (and the entropy) from hidden states, without full logits.

    Args:
        hidden: ``(P, hidden_size)`` last hidden states, one row per position.
        weight: ``(vocab, hidden_size)`` output projection (the embedding matrix when tied).
        labels: ``(P,)`` next-token ids.
        temperature: the logits are divided by it before the softmax.
        compute_entropy: also return the entropy of each position's distribution.
        chunk_size: positions whose logits exist at once.

    Returns:
        ``(log_probs (P,), entropy (P,) or None)`` in float32.
    """
    log_probs, entropy = LinearLogProbs.apply(
        hidden, weight, labels, temperature, compute_entropy, chunk_size
    )
    return log_probs, entropy if compute_entropy else None


def _scaled_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    logits = torch.nn.functional.linear(hidden, weight).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


def _grad_of_scaled_logits(
    scaled: Tensor,
    normaliser: Tensor,
    labels: Tensor,
    grad_log_probs: Tensor | None,
    entropy: Tensor | None,
    grad_entropy: Tensor | None,
) -> Tensor:
    """The gradient with respect to one chunk's ``z = logits / T``, reusing the chunk's buffers in place.

    NOTE: every step is in place on ``probs`` (or on ``scaled`` once it is no longer needed): a chunk is
    ``chunk_size x vocab`` floats, and each extra pass over it costs what a matmul of the head costs.
    """
    probs = scaled.sub(normaliser.unsqueeze(-1)).exp_()
    if entropy is not None and grad_entropy is not None:
        # dH/dz = -p * (z - (logsumexp(z) - H))
        grad = scaled.sub_((normaliser - entropy).unsqueeze(-1)).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))
        if grad_log_probs is not None:
            grad.addcmul_(probs, grad_log_probs.unsqueeze(-1), value=-1.0)
    elif grad_log_probs is not None:
        grad = probs.mul_(-grad_log_probs.unsqueeze(-1))
    else:
        return probs.zero_()
    if grad_log_probs is not None:
        # d log p[y] / dz = onehot(y) - p
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
    return grad


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, total)) for start in range(0, total, size)]
