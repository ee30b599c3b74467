"""Causal attention over a packed row, where every sequence attends only to itself. Shared by the backends.

A packed row holds several sequences back to back (``cu_seqlens``). A ``T x T`` block mask would cost what
the *row* costs; :func:`packed_causal_attention` costs what the sequences cost. On CUDA with half-precision
compute it calls torch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``) once for
all sequences, which also keeps a layer one graph under ``torch.compile``; elsewhere (CPU, float32, dropout)
it runs SDPA over the sequences padded into a few batches of similar length (:func:`padded_batches`), or
per sequence where a window or dropout applies.

Nothing here reads the device: the caller passes the lengths as host integers (``PackedRow.lengths``), so a
layer never stalls the host with a ``.tolist()`` of ``cu_seqlens`` (once per layer, per micro-batch).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import varlen

_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the kernel has no float32 variant
_VARLEN_KEYWORDS = frozenset(inspect.signature(varlen.varlen_attn).parameters)
"""The keywords this torch's ``varlen_attn`` takes, read once: a cached lookup inside a compiled layer was traced
again at every compile."""
PADDING_LIMIT = 2.0
"""A padded SDPA batch holds at most this many times its sequences' tokens (:func:`padded_batches`)."""
BATCHED_MAX_LENGTH = 64
"""Rows whose sequences are all at most this long attend in padded batches; others one SDPA call per sequence."""


class SequenceLengths:
    """The host lengths of a packed row's sequences (``values``), as one opaque value a model's forward
    keywords carry.

    NOTE: a tuple of one integer per sequence is walked element by element by every hook that visits a
    layer's arguments (FSDP2 casts them and looks for tensors needing gradients in each wrapped layer's
    forward and backward), and so would a dataclass's fields: with 64 sequences that walk cost more CPU than
    the tiny model's attention. A plain class is a leaf to those walks.
    """

    __slots__ = ("values",)

    def __init__(self, values: Sequence[int]) -> None:
        self.values: tuple[int, ...] = tuple(values)

    def __repr__(self) -> str:
        return f"SequenceLengths({self.values})"


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    lengths: Sequence[int] | SequenceLengths | None,
    scale: float | None = None,
    dropout: float = 0.0,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence of a packed row on its own.

    Args:
        query: ``(T, heads, head_dim)``.
        key, value: ``(T, kv_heads, head_dim)``; ``heads`` is a multiple of ``kv_heads`` (grouped queries).
        cu_seqlens: ``(n + 1,)`` cumulative sequence lengths on the tensors' device.
        max_seqlen: the longest sequence.
        lengths: the ``n`` lengths ``cu_seqlens`` describes, as host integers (a :class:`SequenceLengths` where
            module hooks walk the caller's arguments); only the SDPA path reads them
            (the flash kernel takes ``cu_seqlens``), so a compiled layer on that path is not specialised on how
            many sequences a row holds.
        scale: softmax scale; ``None`` is ``1 / sqrt(head_dim)``.
        dropout: attention dropout probability (only the SDPA path applies one).
        window: a sliding window, as transformers' ``sliding_window``: each token attends to itself and the
            ``window - 1`` tokens before it; ``None`` attends to every earlier token.

    Returns:
        ``(T, heads, head_dim)``.

    Raises:
        ValueError: the SDPA path is taken and ``lengths`` is ``None``.
    """
    query, key, value = _in_autocast_dtype(query, key, value)
    groups = query.shape[1] // key.shape[1]
    if _flash_applies(query, scale, dropout, window):
        return _torch_varlen(query, key, value, cu_seqlens, max_seqlen, scale, groups, window)
    if lengths is None:
        raise ValueError(
            "packed_causal_attention needs the host lengths of the row's sequences off the flash path "
            f"(device {query.device.type}, dtype {query.dtype}, dropout {dropout}); pass lengths=."
        )
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    host = lengths.values if isinstance(lengths, SequenceLengths) else tuple(lengths)
    if dropout == 0.0 and window is None and len(host) > 1 and max(host) <= BATCHED_MAX_LENGTH:
        return _padded_sdpa(query, key, value, padded_batches(host, query.device), scale=scale)
    return _per_sequence_sdpa(query, key, value, host, scale=scale, dropout=dropout, window=window)


def _in_autocast_dtype(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``query``, ``key`` and ``value`` in autocast's dtype where autocast is on, as SDPA would compute them.

    NOTE: under autocast with float32 weights, rotary embeddings (float32 ``cos``/``sin``, not an autocast op)
    give float32 query and key beside a half-precision value, so the flash kernel never applied and every layer
    took the per-sequence SDPA path.
    """
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _per_sequence_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: tuple[int, ...],
    *,
    scale: float | None,
    dropout: float,
    window: int | None,
) -> torch.Tensor:
    """SDPA over each sequence of the row, concatenated.

    NOTE: a compiled layer on this path is specialised on how many sequences a row holds (a new count
    recompiles it, up to dynamo's recompile limit); engines warn when ``torch.compile`` meets this path.
    """
    outputs = [
        _sdpa_causal(q, k, v, scale=scale, dropout=dropout, window=window)
        for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True)
    ]
    return torch.cat(outputs, dim=0)


@dataclass(frozen=True)
class PaddedBatches:
    """A packed row's sequences laid out as a few padded ``(count, width)`` SDPA batches.

    Attributes:
        gathers: per batch, the ``count * width`` row positions its slots read (the row's length ``T`` is
            a zero padding row appended to the row), longest sequences first.
        shapes: per batch, ``(count, width)``.
        scatter: ``(T,)`` where each token of the row sits in the concatenated flat outputs of the batches.
    """

    gathers: tuple[torch.Tensor, ...]
    shapes: tuple[tuple[int, int], ...]
    scatter: torch.Tensor


@functools.lru_cache(maxsize=8)
def padded_batches(lengths: tuple[int, ...], device: torch.device) -> PaddedBatches:
    """Group sequences by length, longest first, into batches padded to their longest member, a batch closing
    before its padded size would exceed :data:`PADDING_LIMIT` times its tokens. Cached per row (every layer of
    a micro-batch asks for the same one), built on the host from host integers.

    Why: one SDPA call per sequence costs a fixed ~50 us of dispatch each on CPU, more than a short sequence's
    attention; a padded batch computes each sequence exactly as alone (causal masking never lets a real query
    see a padded key, which all follow it) at the price of the padding and of gathering and scattering the
    row. Measured forward + backward on one CPU thread: 64 sequences of 7-12 tokens 8.2 -> 1.9 ms; but 47 of
    60-400 tokens 121 -> 263 ms and 60 of 8-200 tokens 43 -> 74 ms, hence :data:`BATCHED_MAX_LENGTH`.
    """
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    total = starts[-1]
    batches: list[list[int]] = []
    tokens = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= PADDING_LIMIT * (
            tokens + lengths[index]
        ):
            batches[-1].append(index)
            tokens += lengths[index]
        else:
            batches.append([index])
            tokens = lengths[index]
    gathers, shapes, scatter, offset = [], [], [0] * total, 0
    for batch in batches:
        width = lengths[batch[0]]
        gather: list[int] = []
        for index in batch:
            start, length = starts[index], lengths[index]
            gather.extend(range(start, start + length))
            gather.extend([total] * (width - length))
            scatter[start : start + length] = range(offset, offset + length)
            offset += width
        gathers.append(_to_device(gather, device))
        shapes.append((len(batch), width))
    return PaddedBatches(tuple(gathers), tuple(shapes), _to_device(scatter, device))


def _to_device(indices: list[int], device: torch.device) -> torch.Tensor:
    """``indices`` as an int64 tensor on ``device``, copied without waiting for the device: made on the host
    first (``torch.tensor(..., device=cuda)`` copies synchronously, a host sync in every layer's first call)."""
    return torch.tensor(indices, dtype=torch.int64).to(device, non_blocking=True)


def _padded_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batches: PaddedBatches,
    *,
    scale: float | None,
) -> torch.Tensor:
    """Causal SDPA of a packed row's sequences, one call per padded batch of :func:`padded_batches`."""
    padded = [torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in (query, key, value)]
    outputs = []
    for gather, (count, width) in zip(batches.gathers, batches.shapes, strict=True):
        q, k, v = (t.index_select(0, gather).view(count, width, *t.shape[1:]).transpose(1, 2) for t in padded)
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)
        outputs.append(out.transpose(1, 2).reshape(count * width, *query.shape[1:]))
    return torch.cat(outputs).index_select(0, batches.scatter)


def _sdpa_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None,
    dropout: float,
    window: int | None,
) -> torch.Tensor:
    """SDPA of one sequence, ``(L, heads, head_dim)`` in and out: causal, banded where it outgrows ``window``.

    NOTE: SDPA gets 4-D ``(1, heads, L, head_dim)`` tensors: CUDA's flash and memory-efficient kernels refuse
    3-D ones, which fell back to the math kernel and its ``heads x L x L`` score matrix.
    """
    length = query.shape[0]
    mask = None
    if window is not None and length > window:
        position = torch.arange(length, device=query.device)
        distance = position[:, None] - position[None, :]
        mask = (distance >= 0) & (distance < window)
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, is_causal=mask is None
    )
    return out.squeeze(0).transpose(0, 1)


def flash_kernel_applies(device: str, param_dtype: str) -> bool:
    """Whether packed attention of an engine on ``device`` computing in ``param_dtype`` takes torch's flash kernel
    (CUDA, half precision) rather than SDPA per sequence (absent dropout)."""
    return torch.device(device).type == "cuda" and getattr(torch, param_dtype, None) in _FLASH_DTYPES


def flash_kernel_missing(device: str, param_dtype: str) -> bool:
    """Whether packed attention in ``param_dtype`` on ``device`` would take torch's flash kernel on a GPU that
    cannot run it (compute capability below 8.0, Ampere). Engines refuse that when they build: V100 and T4 in
    half precision would fail inside attention."""
    applies = device == "cuda" and flash_kernel_applies(device, param_dtype)
    return applies and not torch.cuda.get_device_capability() >= (8, 0)


def _flash_applies(query: torch.Tensor, scale: float | None, dropout: float, window: int | None) -> bool:
    """Whether torch's flash kernel computes this call: CUDA, half precision, no dropout, a scale it takes, and
    a window only where it takes ``window_size``."""
    return (
        query.is_cuda
        and query.dtype in _FLASH_DTYPES
        and dropout == 0.0
        and _varlen_takes(scale, query)
        and (window is None or "window_size" in _VARLEN_KEYWORDS)
    )


def _torch_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float | None,
    groups: int,
    window: int | None = None,
) -> torch.Tensor:
    """torch's variable-length flash kernel on ``(T, heads, head_dim)`` tensors, causal, in one launch.

    NOTE: torch releases spell the same call differently: causal is ``is_causal=True`` in older ones and
    ``window_size=(-1, 0)`` in newer ones; ``scale`` and ``enable_gqa`` came later (2.11 has ``scale`` but not
    ``enable_gqa``: key/value are then repeated to the query's heads). :data:`_VARLEN_KEYWORDS` holds the
    signature's keywords.
    """
    keywords = _VARLEN_KEYWORDS
    if groups > 1 and "enable_gqa" not in keywords:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    options: dict[str, Any] = {}
    if "enable_gqa" in keywords:
        options["enable_gqa"] = groups > 1
    # A window of ``w`` tokens is ``w - 1`` to the left, as transformers' flash path spells it.
    left = -1 if window is None else window - 1
    options.update({"window_size": (left, 0)} if "window_size" in keywords else {"is_causal": True})
    if "scale" in keywords:
        options["scale"] = scale
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    out = varlen.varlen_attn(query, key, value, cu, cu, max_len, max_len, **options)
    assert isinstance(out, torch.Tensor)  # a tuple only when ``return_aux`` asks for the log-sum-exp
    return out


def _varlen_takes(scale: float | None, query: torch.Tensor) -> bool:
    """Whether the kernel can apply ``scale``: always where it takes ``scale``, else only the default."""
    return "scale" in _VARLEN_KEYWORDS or scale is None or math.isclose(scale, query.shape[-1] ** -0.5)
