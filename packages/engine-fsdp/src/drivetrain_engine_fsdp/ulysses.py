"""DeepSpeed-Ulysses sequence parallelism through transformers' ``AttentionInterface``.

Each rank of a sequence-parallel (SP) group holds a contiguous slice of the packed row. Everything outside
attention is per token, so it runs on the slice unchanged. Attention is wrapped: an all-to-all trades the
token split for a head split (every rank then sees all tokens of ``heads / sp`` heads), per-sequence attention
runs on the full row, and a second all-to-all trades back. No model code is patched: the wrapper is an
attention function registered under :data:`ULYSSES_ATTENTION`.

Core splits a micro-batch's packed row through :class:`UlyssesSplit` (core's ``SequenceSplit`` hook) and
gathers the per-position outputs back with it before it shifts and unpacks them.

Gradients: every SP rank evaluates the same loss on the gathered per-token outputs, and
:func:`gather_tokens` sends back only the slice a rank produced, so the sum of the ranks' parameter
gradients is the gradient of the loss once. FSDP averages over all ``dp * sp`` ranks of its mesh, which is
the engine's ``gradient_divisor`` (core's one loss-scaling rule).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from drivetrain_engine_core.backend import PackedRow, SequenceSplit, pad_packed_row
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from .attention import varlen_attention_forward

ULYSSES_ATTENTION = "drivetrain_ulysses"
_REGISTRATIONS = itertools.count()


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack([chunk.contiguous() for chunk in x.chunk(size, dim=scatter_dim)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """All-to-all whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 whose backward keeps this rank's slice (every rank holds the same loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.length = dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length], None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every SP rank's per-token slice ``(t, ...)`` into the full row ``(sp * t, ...)``."""
    return _GatherTokens.apply(x, group)


def ulysses_attention_forward(
    group: dist.ProcessGroup,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Sequence-parallel attention: heads are split across the SP group, tokens gathered, then split back.

    ``query``/``key``/``value`` are ``(1, heads, local_tokens, head_dim)``; ``cu_seq_lens_q`` in ``kwargs``
    describes the full (padded) row; ``group`` is bound by :func:`register_ulysses_attention`.
    """
    size = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise ValueError(
            f"{heads} attention heads cannot be split over ulysses_sequence_parallel_size={size}."
        )
    if kv_heads % size:
        # Fewer KV heads than ranks: give every query head its own copy so that heads split evenly.
        key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
    query, key, value = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))
    output, _ = varlen_attention_forward(
        module, query, key, value, attention_mask, dropout, scaling, **kwargs
    )
    return _AllToAll.apply(output, group, 1, 2), None


def register_ulysses_attention(group: dist.ProcessGroup) -> str:
    """Register the Ulysses attention bound to ``group`` under a name of its own and return that name (the
    model's ``attn_implementation``).

    NOTE: the group is bound to the registered function, not held in a context, because activation
    checkpointing re-runs attention during backward, outside any forward-time context. It was one
    process-global group, so a second engine in the process (a critic beside the actor) with another
    sequence-parallel size switched the first one's attention to its group.
    """
    name = f"{ULYSSES_ATTENTION}_{next(_REGISTRATIONS)}"
    AttentionInterface.register(name, functools.partial(ulysses_attention_forward, group))
    return name


def local_slice(row: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This SP rank's contiguous slice of a ``(1, T)`` row whose length is a multiple of ``size``."""
    length = row.shape[1] // size
    return row[:, rank * length : (rank + 1) * length]


@dataclass(frozen=True)
class UlyssesSplit(SequenceSplit):
    """Each rank of a sequence-parallel group takes one contiguous slice of the (padded) packed row.

    Attributes:
        group: the sequence-parallel process group.
        rank: this rank's index in it.
        size: its size.
    """

    group: dist.ProcessGroup
    rank: int
    size: int

    def split(self, row: PackedRow, labels: torch.Tensor) -> tuple[PackedRow, torch.Tensor]:
        """Pad the row to a multiple of the group size, then keep this rank's slice of ids, positions, labels."""
        padded, labels = pad_packed_row(row, labels, self.size)
        local = dataclasses.replace(
            padded,
            input_ids=local_slice(padded.input_ids, self.rank, self.size),
            position_ids=local_slice(padded.position_ids, self.rank, self.size),
        )
        return local, local_slice(labels.unsqueeze(0), self.rank, self.size)[0]

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        return gather_tokens(per_position, self.group)
