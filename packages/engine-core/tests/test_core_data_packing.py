"""Packing round-trips; packed next-token log-probs equal a per-sequence hand computation (docs §7.1)."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import (
    next_token_labels,
    pack_micro_batch,
    shift_right_per_sequence,
    unpack_to_jagged,
)
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB = 50


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_pack_unpack_round_trip(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    rope = [torch.randint(0, 99, (n, 3), generator=gen) for n in lengths]
    batch = make_batch(ids, position_ids=rope, values=[torch.randn(n, 2, generator=gen) for n in lengths])
    packed = pack_micro_batch(batch)
    total = sum(lengths)
    assert packed.input_ids.shape == (1, total) and packed.position_ids.shape == (1, total, 3)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed.max_seqlen == max(lengths)
    assert torch.equal(packed.input_ids[0], torch.cat(ids))
    back = unpack_to_jagged(batch["values"].values(), packed.offsets)
    assert back._ragged_idx == 1 and back.shape[2] == 2
    # Built on the batch's own offsets, the unpacked tensor combines with the batch's fields.
    assert back.offsets() is batch["input_ids"].offsets()
    assert (back[..., 0] * batch["loss_mask"]).shape[0] == len(lengths)
    from_int32 = unpack_to_jagged(torch.cat(ids), packed.cu_seqlens)
    assert [t.tolist() for t in from_int32.unbind()] == [t.tolist() for t in ids]


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_packed_log_probs_match_per_sequence_reference(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    logits = [torch.randn(n, VOCAB, generator=gen, dtype=torch.float64) for n in lengths]
    packed = pack_micro_batch(make_batch(ids))
    flat_logp = torch.cat(logits).log_softmax(-1)
    labels = next_token_labels(packed.input_ids[0], packed.cu_seqlens)
    gathered = flat_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    aligned = shift_right_per_sequence(gathered, packed.cu_seqlens)
    # Reference: position i scores token i from the logits at i - 1; position 0 holds 0.
    expected = []
    for seq, lg in zip(ids, logits, strict=True):
        ref = torch.zeros(len(seq), dtype=torch.float64)
        ref[1:] = lg[:-1].log_softmax(-1).gather(-1, seq[1:].unsqueeze(-1)).squeeze(-1)
        expected.append(ref)
    torch.testing.assert_close(aligned, torch.cat(expected), rtol=0, atol=0)


def test_shift_keeps_extra_dims_and_fills_starts():
    flat = torch.arange(10.0).reshape(5, 2)
    out = shift_right_per_sequence(flat, torch.tensor([0, 2, 5], dtype=torch.int32), fill=-1.0)
    assert out.tolist() == [[-1, -1], [0, 1], [-1, -1], [4, 5], [6, 7]]


def test_unpack_rejects_wrong_length():
    with pytest.raises(BatchError, match=r"expected first dim 5 \(cu_seqlens\[-1\]\)"):
        unpack_to_jagged(torch.zeros(1, 5), torch.tensor([0, 2, 5], dtype=torch.int32))


def test_per_micro_batch_helpers_read_nothing_from_the_device():
    """Shift, labels and unpack run on ``meta`` tensors, where any read of a value (``.item()``, ``int()``, a
    boolean-mask index) fails: on a GPU each such read stalls the host once per micro-batch."""
    offsets = torch.tensor([0, 3, 3, 7, 12], device="meta")  # an empty sequence too
    flat = torch.empty(12, 2, device="meta")
    shifted = shift_right_per_sequence(flat, offsets, fill=0.0)
    labels = next_token_labels(torch.empty(12, dtype=torch.int64, device="meta"), offsets)
    assert shifted.shape == (12, 2) and labels.shape == (12,)
    assert unpack_to_jagged(flat, offsets, num_tokens=12).shape[0] == 4


def test_empty_sequences_shift_and_label_like_their_neighbours():
    offsets = torch.tensor([0, 0, 3, 3, 5, 5])  # empty first, middle and last sequences
    flat = torch.arange(1.0, 6.0)
    assert shift_right_per_sequence(flat, offsets, fill=-1.0).tolist() == [-1.0, 1.0, 2.0, -1.0, 4.0]
    assert next_token_labels(torch.arange(10, 15), offsets).tolist() == [11, 12, 0, 14, 0]
