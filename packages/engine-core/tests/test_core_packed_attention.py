"""Core's packed causal attention against the attention formula written out per sequence.

On CPU: values and gradients of the SDPA path (grouped queries, a custom scale), no read of ``cu_seqlens``
(it sits on the ``meta`` device), and torch's varlen call as each release spells it, against a stand-in
kernel of that signature. In the GPU lane: the flash kernel in bf16 against the float32 formula.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from drivetrain_engine_core import _packed_attention as packed_attention
from drivetrain_engine_core._packed_attention import padded_batches
from drivetrain_engine_core.kit import SequenceLengths, packed_causal_attention
from drivetrain_engine_core.testing.device import requires_cuda

LENGTHS = (5, 130, 1, 64)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def formula(query, key, value, scale, window=None):
    """softmax(q k^T * scale + causal mask) v, each sequence alone, key/value heads repeated, float32; with a
    ``window``, query ``i`` sees keys ``i - window < j <= i`` (transformers' ``sliding_window``)."""
    repeat = query.shape[1] // key.shape[1]
    outputs, start = [], 0
    for length in LENGTHS:
        q, k, v = (t[start : start + length].float() for t in (query, key, value))
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            causal = causal.triu(-(window - 1))
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", weights, v))
        start += length
    return torch.cat(outputs)


def inputs(device="cpu", dtype=torch.float32):
    generator = torch.Generator(device=device).manual_seed(0)
    total = sum(LENGTHS)
    shapes = ((total, HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM))
    tensors = (torch.randn(s, generator=generator, device=device).to(dtype).requires_grad_() for s in shapes)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32, device=device)
    return (*tensors, cu_seqlens)


def attend(query, key, value, cu_seqlens, scale, window=None):
    return packed_causal_attention(
        query,
        key,
        value,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(LENGTHS),
        lengths=LENGTHS,
        scale=scale,
        window=window,
    )


@pytest.mark.parametrize("batched_max_length", [64, 256])  # LENGTHS per sequence, or in padded batches
@pytest.mark.parametrize("window", [None, 4, 200])  # 200: longer than every sequence, so no band at all
def test_values_and_gradients_equal_the_formula_without_reading_the_device(
    monkeypatch, window, batched_max_length
):
    monkeypatch.setattr(packed_attention, "BATCHED_MAX_LENGTH", batched_max_length)
    query, key, value, cu_seqlens = inputs()
    scale = 0.3  # not the default 1/sqrt(head_dim): the scale is applied, not assumed
    output = attend(query, key, value, cu_seqlens.to("meta"), scale, window)
    reference = formula(query, key, value, scale, window)
    torch.testing.assert_close(output, reference, atol=1e-5, rtol=1e-5)
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((output * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for grad, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5)


PER_SEQUENCE = [(1, HEADS, length, HEAD_DIM) for length in LENGTHS]


@pytest.mark.parametrize(
    ("window", "batched_max_length", "calls"),
    [
        # Padded batches, longest first: 130, 64 and 5 fill 3 x 130 slots (<= 2 x their 199 tokens); 1 alone.
        (None, 256, [(3, HEADS, 130, HEAD_DIM), (1, HEADS, 1, HEAD_DIM)]),
        (None, 64, PER_SEQUENCE),  # a sequence longer than BATCHED_MAX_LENGTH: per sequence
        (4, 256, PER_SEQUENCE),  # a window: per sequence
    ],
)
def test_sdpa_gets_4d_tensors_in_padded_batches_or_per_sequence(
    monkeypatch, window, batched_max_length, calls
):
    """CUDA's flash and memory-efficient SDPA kernels refuse 3-D inputs; ``(heads, L, head_dim)`` took the math
    kernel, which keeps a ``heads x L x L`` score matrix per sequence for backward. Rows of short sequences go
    in padded batches (one SDPA call per sequence cost more than the tiny model's attention); the lengths
    passed as :class:`SequenceLengths` (what the FSDP engine hands its layers) or as a tuple alike."""
    monkeypatch.setattr(packed_attention, "BATCHED_MAX_LENGTH", batched_max_length)
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **options):
        shapes.append(tuple(query.shape))
        assert key.shape == value.shape == query.shape
        return sdpa(query, key, value, **options)

    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention", recording)
    query, key, value, cu_seqlens = inputs()
    for lengths in (LENGTHS, SequenceLengths(LENGTHS)):
        output = packed_causal_attention(
            query,
            key,
            value,
            cu_seqlens=cu_seqlens,
            max_seqlen=130,
            lengths=lengths,
            scale=0.3,
            window=window,
        )
        torch.testing.assert_close(output, formula(query, key, value, 0.3, window), atol=1e-5, rtol=1e-5)
    assert shapes == calls * 2


def test_padded_batches_bound_their_padding_and_cover_every_token_once():
    """Each batch holds at most PADDING_LIMIT times its tokens; every token of the row is read and written back
    exactly once (the plan is written out here for a long-tailed row of 40 sequences)."""
    generator = torch.Generator().manual_seed(0)
    lengths = tuple(int(x) for x in (torch.rand(40, generator=generator) ** 4 * 300 + 1).long())
    plan = padded_batches(lengths, torch.device("cpu"))
    total = sum(lengths)
    read = torch.cat(plan.gathers)
    assert sorted(read[read < total].tolist()) == list(range(total))
    for gather, (count, width) in zip(plan.gathers, plan.shapes, strict=True):
        real = int((gather < total).sum())
        assert gather.numel() == count * width <= packed_attention.PADDING_LIMIT * real
    assert sorted(plan.scatter.tolist()) == sorted((read < total).nonzero()[:, 0].tolist())
    assert read[plan.scatter].tolist() == list(range(total))


def test_under_autocast_attention_takes_its_inputs_in_the_autocast_dtype(monkeypatch):
    """Under autocast with float32 weights rotary gives float32 query/key beside a bfloat16 value, so the flash
    kernel (one dtype, half precision) never applied and the benchmark's bare loop attended per sequence."""
    seen = []
    monkeypatch.setattr(
        packed_attention, "_flash_applies", lambda query, *args: seen.append(query.dtype) or False
    )
    per_sequence = packed_attention._per_sequence_sdpa

    def recording(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return per_sequence(query, key, value, *args, **kwargs)

    monkeypatch.setattr(packed_attention, "_per_sequence_sdpa", recording)
    query, key, value, cu_seqlens = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = attend(query, key, value.bfloat16(), cu_seqlens, None)
    bf16 = torch.bfloat16
    assert seen == [bf16, (bf16, bf16, bf16)] and output.dtype == bf16
    attend(query, key, value, cu_seqlens, None)  # without autocast the inputs keep their dtype
    assert seen[2:] == [torch.float32, (torch.float32,) * 3]


def _attend_per_sequence(query, key, value, cu_seqlens, *, causal, scale=None, enable_gqa=False):
    """A stand-in for torch's varlen kernel: SDPA per sequence, on ``(T, heads, head_dim)`` tensors."""
    pieces = [
        torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (query, key, value)),
            is_causal=causal,
            scale=scale,
            enable_gqa=enable_gqa,
        ).transpose(0, 1)
        for a, b in itertools.pairwise(cu_seqlens.tolist())
    ]
    return torch.cat(pieces)


def varlen_before_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _attend_per_sequence(query, key, value, cu_seq_q, causal=is_causal)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):  # fmt: skip
    return _attend_per_sequence(query, key, value, cu_seq_q, causal=window_size == (-1, 0), scale=scale)


def varlen_after_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    return _attend_per_sequence(
        query, key, value, cu_seq_q, causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa
    )


def use_kernel(monkeypatch, kernel) -> None:
    """Stand ``kernel`` in for torch's ``varlen_attn``, with the keywords its signature has."""
    monkeypatch.setattr(packed_attention.varlen, "varlen_attn", kernel)
    monkeypatch.setattr(packed_attention, "_VARLEN_KEYWORDS", frozenset(inspect.signature(kernel).parameters))


@pytest.mark.parametrize("kernel", [varlen_before_2_11, varlen_2_11, varlen_after_2_11])
def test_varlen_call_is_spelled_for_each_torch_release(monkeypatch, kernel):
    use_kernel(monkeypatch, kernel)
    query, key, value, cu_seqlens = inputs()
    scale = HEAD_DIM**-0.5  # the only scale a kernel without ``scale`` applies
    got = packed_attention._torch_varlen(
        query, key, value, cu_seqlens, max(LENGTHS), scale, HEADS // KV_HEADS
    )
    torch.testing.assert_close(got, formula(query, key, value, scale), atol=1e-5, rtol=1e-5)


def varlen_windowed(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    """A stand-in with the flash kernel's window semantics: query ``i`` sees keys ``i - left <= j <= i + right``
    (``-1``: unbounded on that side)."""
    left, right = window_size
    pieces = []
    for a, b in itertools.pairwise(cu_seq_q.tolist()):
        distance = torch.arange(b - a)[:, None] - torch.arange(b - a)[None, :]
        allowed = ((distance <= left) | (left < 0)) & ((-distance <= right) | (right < 0))
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        pieces.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa
            ).transpose(0, 1)
        )
    return torch.cat(pieces)


def test_flash_window_is_spelled_as_transformers_means_it(monkeypatch):
    use_kernel(monkeypatch, varlen_windowed)
    query, key, value, cu_seqlens = inputs()
    got = packed_attention._torch_varlen(
        query, key, value, cu_seqlens, max(LENGTHS), 0.3, HEADS // KV_HEADS, window=4
    )
    torch.testing.assert_close(got, formula(query, key, value, 0.3, window=4), atol=1e-5, rtol=1e-5)


@requires_cuda
def test_flash_kernel_matches_the_formula_in_bf16():
    query, key, value, cu_seqlens = inputs("cuda", torch.bfloat16)
    scale = HEAD_DIM**-0.5
    output = attend(query, key, value, cu_seqlens, scale)
    reference = formula(query, key, value, scale)
    # bf16 inputs and output: within a few bf16 ulps of the float32 reference.
    torch.testing.assert_close(output.float(), reference, atol=2e-2, rtol=2e-2)
    weights = torch.randn(
        reference.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda"
    )
    got = torch.autograd.grad((output.float() * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for grad, ref in zip(got, expected, strict=True):
        assert float((grad.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
