"""The micro-batch round trip: both layouts give the same tokens, labels and loss; a split is undone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from drivetrain_engine_core._data.packing import pad_micro_batch
from drivetrain_engine_core.backend import (
    ForwardOptions,
    MicroBatch,
    PackedRow,
    PaddedRows,
    RoundTrip,
    RowPadding,
    SequenceSplit,
    pad_packed_row,
)
from drivetrain_engine_core.job import LossContext
from drivetrain_engine_core.testing import random_batch, token_mean_nll
from drivetrain_engine_core.testing.device import requires_cuda

PROMPTS, RESPONSES = [3, 1, 4], [2, 5, 1]


def _trip(loss_fn=token_mean_nll, divisor: int = 1) -> RoundTrip:
    return RoundTrip(
        loss_fn=loss_fn,
        options=ForwardOptions(),
        context=LossContext(global_token_count=8, global_sequence_count=3),
        gradient_divisor=divisor,
        keep_outputs=True,
    )


def _per_position(micro_batch: MicroBatch) -> torch.Tensor:
    """A stand-in model: a value per position that depends on the token and its position."""
    output = (micro_batch.inputs.input_ids * 10 + micro_batch.inputs.position_ids).float().unsqueeze(-1)
    return micro_batch.rows(output)[:, 0]


def test_packed_and_padded_layouts_give_the_same_tokens_labels_and_loss():
    batch = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=3)
    built = {
        layout: MicroBatch.build(batch, 0, device="cpu", layout=layout, round_trip=_trip(divisor=3))
        for layout in ("packed", "padded")
    }
    assert isinstance(built["packed"].inputs, PackedRow) and isinstance(built["padded"].inputs, PaddedRows)
    assert built["padded"].inputs.input_ids.shape == (
        3,
        max(p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)),
    )
    assert torch.equal(built["packed"].labels, built["padded"].labels)
    results = {}
    for layout, micro_batch in built.items():
        values = -_per_position(micro_batch) / 100
        loss, result = micro_batch.finish({"log_probs": values})
        assert result.outputs["log_probs"].offsets() is batch["input_ids"].offsets()
        assert float(loss) == pytest.approx(3 * float(result.loss))  # the gradient divisor, nothing else
        results[layout] = result
    torch.testing.assert_close(
        results["packed"].outputs["log_probs"].values(), results["padded"].outputs["log_probs"].values()
    )
    assert results["packed"].loss == results["padded"].loss
    first = results["packed"].outputs["log_probs"].values()[batch["input_ids"].offsets()[:-1]]
    assert torch.equal(first, torch.zeros(3)), "position 0 of each sequence holds 0 (docs §7.1)"


class _TwoSlices(SequenceSplit):
    """Keeps the second half of a row padded to even length, and 'gathers' by putting zeros before it."""

    def split(self, row: PackedRow, labels: torch.Tensor) -> tuple[PackedRow, torch.Tensor]:
        pad = row.input_ids.shape[1] % 2
        ids = torch.nn.functional.pad(row.input_ids, (0, pad))
        half = ids.shape[1] // 2
        self.half = half
        positions = torch.nn.functional.pad(row.position_ids, (0, pad))
        local = dataclasses.replace(row, input_ids=ids[:, half:], position_ids=positions[:, half:])
        return local, torch.nn.functional.pad(labels, (0, pad))[half:]

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        return torch.cat([per_position.new_zeros(self.half), per_position])


def test_a_sequence_split_is_gathered_and_trimmed_before_unpacking():
    batch = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=4)
    split = _TwoSlices()
    micro_batch = MicroBatch.build(
        batch, 0, device="cpu", layout="packed", round_trip=_trip(loss_fn=None), sequence_split=split
    )
    total = micro_batch.num_tokens
    assert micro_batch.inputs.input_ids.shape[1] == micro_batch.labels.shape[0] == (total + total % 2) // 2
    _, result = micro_batch.finish({"values": torch.ones(micro_batch.labels.shape[0])})
    assert result.loss is None and result.outputs["values"].values().shape == (total,)
    with pytest.raises(ValueError, match="packed layout"):
        MicroBatch.build(batch, 0, device="cpu", layout="padded", round_trip=_trip(), sequence_split=split)


@pytest.mark.parametrize("multiple", [1, 4, 7])
def test_row_padding_pads_to_a_multiple_with_one_sequence_and_trims_it_off(multiple):
    """``RowPadding`` (Megatron's sequence parallelism): the whole row on every rank, its length a multiple of
    ``multiple``; the padding is its own sequence (positions from 0, token and label 0), and the tokens equal
    those of the unpadded row."""
    batch = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=5)
    plain = MicroBatch.build(batch, 0, device="cpu", layout="packed", round_trip=_trip(loss_fn=None))
    padded = MicroBatch.build(
        batch,
        0,
        device="cpu",
        layout="packed",
        round_trip=_trip(loss_fn=None),
        sequence_split=RowPadding(multiple),
    )
    total = plain.num_tokens  # 16 tokens
    width = -(-total // multiple) * multiple
    pad = width - total
    row = padded.inputs
    assert (
        isinstance(row, PackedRow) and row.input_ids.shape == (1, width) and padded.labels.shape == (width,)
    )
    assert row.lengths == plain.inputs.lengths + ((pad,) if pad else ())
    assert row.cu_seqlens.tolist() == plain.inputs.cu_seqlens.tolist() + ([width] if pad else [])
    assert row.position_ids[0, total:].tolist() == list(range(pad))
    assert row.input_ids[0, total:].tolist() == padded.labels[total:].tolist() == [0] * pad
    assert row.max_seqlen == max(plain.inputs.max_seqlen, pad)
    for field in ("input_ids", "position_ids"):
        assert torch.equal(getattr(row, field)[:, :total], getattr(plain.inputs, field))
    assert torch.equal(
        padded.to_tokens(_per_position(padded)).values(), plain.to_tokens(_per_position(plain)).values()
    )


def test_row_padding_keeps_extra_position_axes():
    """Multi-axis rope positions ``(1, T, 3)``: the padding's positions count from 0 on every axis."""
    row = PackedRow(
        input_ids=torch.ones(1, 5, dtype=torch.long),
        position_ids=torch.arange(5).view(1, 5, 1).expand(1, 5, 3),
        cu_seqlens=torch.tensor([0, 5], dtype=torch.int32),
        max_seqlen=5,
        offsets=torch.tensor([0, 5]),
        lengths=(5,),
    )
    padded, labels = pad_packed_row(row, torch.arange(5), 4)
    assert padded.position_ids.shape == (1, 8, 3)
    assert padded.position_ids[0, 5:].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert labels.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


def test_padded_rows_index_their_tokens_from_host_lengths():
    """``output[valid]`` counts the mask's true entries, which waits for the device, after every micro-batch;
    the row-major token positions come from the host lengths and gather the same values."""
    batch = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=3)
    rows = MicroBatch.build(batch, 0, device="cpu", layout="padded", round_trip=_trip()).inputs
    assert isinstance(rows, PaddedRows)
    output = torch.randn(*rows.valid.shape, 4)
    assert torch.equal(output.flatten(0, 1)[rows.token_positions], output[rows.valid])
    assert torch.equal(rows.input_ids[rows.valid], batch["input_ids"].values())


@requires_cuda
def test_the_padded_layout_makes_no_host_sync():
    batch = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=3)
    micro_batch = MicroBatch.build(batch, 0, device="cuda", layout="padded", round_trip=_trip())
    on_device = micro_batch.batch
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = pad_micro_batch(on_device, max(lengths), lengths)
        gathered = micro_batch.rows(rows.input_ids.unsqueeze(-1).float())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gathered[:, 0].long().cpu(), batch["input_ids"].values())
