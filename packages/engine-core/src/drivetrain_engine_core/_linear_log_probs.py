"""Per-token log-probs and entropy straight from the last hidden state and the output projection.

The logits of a micro-batch are ``(tokens, vocab)``: at 16k tokens and a 152k vocabulary that is 9.3 GiB in
float32, and a log-softmax holds several of them. :class:`LinearLogProbs` never holds more than one chunk of
them: forward computes each chunk's logits, keeps two numbers per token (the log-normaliser and the entropy)
and drops the chunk; backward computes each chunk's logits again and turns them into the gradients of the
hidden states and of the projection at once. Peak memory scales with ``chunk_size x vocab``, not with
``tokens x vocab``, for one extra matmul per chunk in backward. Every backend whose head is a plain bias-free
projection shares it (FSDP's ``lm_head``, megatron's vocabulary-parallel ``output_layer``).

The vocabulary may be split over a process group (tensor parallelism): each rank holds the rows
``vocab_start .. vocab_start + weight.shape[0]`` of the projection and computes only its slice of the logits.
The softmax statistics are combined per chunk the way megatron's vocab-parallel cross-entropy does (the row
max all-reduced with MAX, then sums of ``exp``, the label's logit from the rank that owns it, and the entropy
sums all-reduced with SUM), and in backward each rank's contribution to the hidden states' gradient is
summed over the group. Rows of a padded last shard beyond ``vocab_size`` never enter the matmul, which is the
same as giving them ``-inf`` logits. Without a group no collective runs.

The numbers are those of a full-vocabulary ``log_softmax`` of ``hidden @ weight.T``: the logits are computed
in the weight's dtype and taken to float32 before the softmax, so the fp32 results agree to rounding (the CPU
tests hold values and gradients to 1e-6, with and without a group).

Gradients, with ``z = logits / T``, ``p = softmax(z)`` and ``H = logsumexp(z) - sum(p * z)``::

    d log p[y] / dz = onehot(y) - p
    d H / dz        = -p * (z - (logsumexp(z) - H))

Both only need the global ``logsumexp(z)`` and ``H`` saved from forward, so a vocabulary shard computes its
own slice of ``dL/dz`` without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class _Shard:
    """This rank's part of the vocabulary: the first ``width`` rows of its weight are ids ``start..``.

    ``group`` is ``None`` when the rank holds the whole vocabulary (no collective runs then).
    """

    group: dist.ProcessGroup | None
    start: int
    width: int


class LinearLogProbs(torch.autograd.Function):
    """``(log_probs, entropy)`` of ``labels`` under ``softmax(hidden @ weight.T / temperature)``, chunked.

    ``weight`` may be one shard of a vocabulary split over a process group (see the module docstring);
    call it through :func:`linear_log_probs`.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        temperature: float,
        compute_entropy: bool,
        chunk_size: int,
        shard: _Shard,
    ) -> tuple[Tensor, Tensor]:
        log_probs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        normaliser = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if compute_entropy else log_probs.new_zeros(0)
        real = weight[: shard.width]
        index, owned = _local_labels(labels, shard)
        for start, stop in _chunks(hidden.shape[0], chunk_size):
            rows = slice(start, stop)
            # NOTE: the chunk's logits are handed over, not kept here, so the helpers can free them early.
            if shard.group is None or owned is None:  # ``owned`` is None exactly when there is no group
                stats = _whole_vocab_stats(
                    _scaled_logits(hidden[rows], real, temperature), index[rows], compute_entropy
                )
            else:
                stats = _shard_stats(
                    _scaled_logits(hidden[rows], real, temperature),
                    index[rows],
                    owned[rows],
                    shard.group,
                    compute_entropy,
                )
            log_probs[rows], normaliser[rows] = stats[0], stats[1]
            if stats[2] is not None:
                entropy[rows] = stats[2]
        ctx.save_for_backward(hidden, weight, labels, normaliser, entropy)
        ctx.temperature, ctx.compute_entropy, ctx.chunk_size, ctx.shard = (
            temperature,
            compute_entropy,
            chunk_size,
            shard,
        )
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: Tensor | None, grad_entropy: Tensor | None) -> tuple[Any, ...]:
        hidden, weight, labels, normaliser, entropy = ctx.saved_tensors
        temperature, shard = ctx.temperature, ctx.shard
        real = weight[: shard.width]
        index, owned = _local_labels(labels, shard)
        # The entropy's gradient term, when the entropy was computed and is used downstream.
        entropy_grad = grad_entropy if ctx.compute_entropy else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # NOTE: accumulated in float32 over chunks and cast once, which rounds less than one matmul per chunk
        # in the weight's dtype would. Padded rows (beyond ``shard.width``) get zeros.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start, stop in _chunks(hidden.shape[0], ctx.chunk_size):
            chunk = hidden[start:stop]
            grad_scaled = _grad_of_scaled_logits(
                _scaled_logits(chunk, real, temperature),
                normaliser[start:stop],
                index[start:stop],
                owned[start:stop] if owned is not None else None,
                grad_log_probs[start:stop] if grad_log_probs is not None else None,
                entropy[start:stop] if entropy_grad is not None else None,
                entropy_grad[start:stop] if entropy_grad is not None else None,
            )
            if temperature != 1.0:
                grad_scaled.div_(temperature)  # d(logits / T) / d logits
            # Back into the matmul's dtype, as autograd of ``.float()`` does.
            grad_logits = grad_scaled.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ real
            if grad_weight is not None:
                grad_weight[: shard.width] += (grad_logits.T @ chunk).float()
        if grad_hidden is not None and shard.group is not None:
            # Each shard's logits depend on every hidden state: their gradients are the sum over the shards.
            dist.all_reduce(grad_hidden, group=shard.group)
        cast_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, cast_weight, None, None, None, None, None


def linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-position log-probs of ``labels`` (and the entropy) from hidden states, without full logits.

    Args:
        hidden: ``(P, hidden_size)`` last hidden states, one row per position (the same on every rank of
            ``group``).
        weight: ``(V_local, hidden_size)`` output projection, or this rank's rows of it (the embedding matrix
            when tied).
        labels: ``(P,)`` next-token ids in the full vocabulary.
        temperature: the logits are divided by it before the softmax.
        compute_entropy: also return the entropy of each position's distribution.
        chunk_size: positions whose logits exist at once.
        group: the ranks the vocabulary is split over, or ``None`` when ``weight`` holds all of it.
        vocab_start: the id of ``weight``'s first row (``tensor-parallel rank x V_local``); 0 without a group.
        vocab_size: the real vocabulary size: rows of ``weight`` for ids at or beyond it are padding and left
            out. ``None``: every row is real.

    Returns:
        ``(log_probs (P,), entropy (P,) or None)`` in float32, the same on every rank of ``group``. Their
        gradients reach ``hidden`` summed over the group and ``weight`` for this rank's rows.

    Raises:
        ValueError: ``chunk_size`` below 1, or a ``vocab_start`` other than 0 without a group.
    """
    if chunk_size < 1:
        raise ValueError(f"linear_log_probs: chunk_size must be >= 1, got {chunk_size}.")
    if group is None and vocab_start != 0:
        raise ValueError(
            f"linear_log_probs: vocab_start={vocab_start} without a group; a rank without a group holds the "
            "whole vocabulary (vocab_start=0). Pass the process group the vocabulary is split over."
        )
    rows = weight.shape[0]
    width = rows if vocab_size is None else min(rows, max(0, vocab_size - vocab_start))
    shard = _Shard(group=group, start=vocab_start, width=width)
    log_probs, entropy = LinearLogProbs.apply(
        hidden, weight, labels, temperature, compute_entropy, chunk_size, shard
    )
    return log_probs, entropy if compute_entropy else None


def _scaled_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    logits = torch.nn.functional.linear(hidden, weight).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


def _local_labels(labels: Tensor, shard: _Shard) -> tuple[Tensor, Tensor | None]:
    """Column of each label in this shard's logits, and which labels this shard owns (``None``: all)."""
    if shard.group is None:
        return labels, None
    local = labels - shard.start
    owned = (local >= 0) & (local < shard.width)
    return local.clamp(0, max(shard.width - 1, 0)), owned


def _whole_vocab_stats(
    scaled: Tensor, index: Tensor, compute_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(log p[y], logsumexp(z), H or None)`` of a chunk whose logits span the whole vocabulary."""
    picked = scaled.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    # NOTE: one fused log-softmax pass instead of logsumexp's max/subtract/exp/sum passes over the chunk;
    # the log-normaliser backward needs is then z[y] - log p[y].
    log_softmax = torch.log_softmax(scaled, dim=-1)
    del scaled
    log_probs = log_softmax.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    # H = -sum(p * log p)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if compute_entropy else None
    return log_probs, picked - log_probs, entropy


def _shard_stats(
    scaled: Tensor, index: Tensor, owned: Tensor, group: dist.ProcessGroup, compute_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(log p[y], logsumexp(z), H or None)`` of a chunk whose logits are one shard of the vocabulary.

    ``scaled`` is overwritten. With ``s = z - max(z)`` and ``S = sum(exp(s))`` over the whole vocabulary:
    ``log p[y] = s[y] - log S``, ``logsumexp(z) = max(z) + log S`` and ``H = log S - sum(exp(s) * s) / S``.
    """
    row_max = _row_max(scaled)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled.sub_(row_max.unsqueeze(-1))
    exp = shifted.exp()
    sums = [exp.sum(-1), _label_value(shifted, index, owned)]
    if compute_entropy:
        sums.append(shifted.mul_(exp).sum(-1))
    del exp
    # NOTE: one all-reduce for the two or three per-token sums of the chunk.
    totals = torch.stack(sums, dim=-1)
    dist.all_reduce(totals, group=group)
    log_sum_exp = totals[:, 0].log()
    entropy = log_sum_exp - totals[:, 2] / totals[:, 0] if compute_entropy else None
    return totals[:, 1] - log_sum_exp, row_max + log_sum_exp, entropy


def _row_max(scaled: Tensor) -> Tensor:
    """Per-row max of the local logits; ``-inf`` for a shard that holds only padding (no columns)."""
    if scaled.shape[-1] == 0:
        return scaled.new_full(scaled.shape[:-1], float("-inf"))
    return scaled.amax(dim=-1)


def _label_value(values: Tensor, index: Tensor, owned: Tensor) -> Tensor:
    """``values[row, label]`` where this shard owns the label, else 0 (summed over shards: the label's)."""
    if values.shape[-1] == 0:
        return values.new_zeros(values.shape[:-1])
    picked = values.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill_(~owned, 0.0)


def _grad_of_scaled_logits(
    scaled: Tensor,
    normaliser: Tensor,
    index: Tensor,
    owned: Tensor | None,
    grad_log_probs: Tensor | None,
    entropy: Tensor | None,
    grad_entropy: Tensor | None,
) -> Tensor:
    """The gradient with respect to one chunk's (local) ``z = logits / T``, reusing its buffers in place.

    ``normaliser`` and ``entropy`` are the whole vocabulary's, so the local slice needs no communication;
    the one-hot term lands only on the shard that owns the label (``owned``; ``None``: this rank owns all).

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
    if grad_log_probs is not None and grad.shape[-1] > 0:
        # d log p[y] / dz = onehot(y) - p
        onehot = grad_log_probs if owned is None else grad_log_probs.masked_fill(~owned, 0.0)
        grad.scatter_add_(-1, index.unsqueeze(-1), onehot.unsqueeze(-1))
    return grad


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, total)) for start in range(0, total, size)]
