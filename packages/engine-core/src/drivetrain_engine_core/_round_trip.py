"""The micro-batch round trip: core lays a micro-batch out for the model and turns its outputs into a loss.

Every backend used to string the same core steps together (move, pack or pad, next-token labels, Ulysses
pad and slice, ..., shift, unpack, loss scaling); here they are one object. Per micro-batch, a backend:

1. receives a :class:`MicroBatch`, built by the base ``Engine``: already on the engine device, laid out as the
   backend asked (:attr:`MicroBatch.inputs` is a packed row or right-padded rows), with the next-token
   :attr:`MicroBatch.labels` of the positions this rank computes;
2. runs its model on ``inputs`` and computes its per-position fields (``log_probs``/``entropy`` from the
   logits at :meth:`MicroBatch.rows` and ``labels``, or ``values``);
3. calls :meth:`MicroBatch.finish` with them, which returns the loss to backpropagate and the
   :class:`~drivetrain_engine_core._outputs.MicroBatchResult`.

Loss scaling (the one rule, for every backend)
    ``loss_fn`` returns the micro-batch's share of the global mini-batch loss: it divides by
    ``LossContext.global_token_count`` (token-mean) or ``global_sequence_count`` (sequence-mean), counts of the
    whole mini-batch over every data-parallel rank, never by micro-batch sizes. Summed over micro-batches and
    data-parallel ranks, the shares are the mini-batch loss, so the *sum* of the ranks' gradients is its
    gradient. A backend's gradient reduction sums the ranks' gradients and divides by some number of ranks,
    its :attr:`~drivetrain_engine_core._engine.Engine.gradient_divisor`: FSDP averages over its whole mesh
    (data-parallel x Ulysses ranks), so ``dp * sp``; megatron's DDP (``calculate_per_token_loss``) and a
    single process sum, so 1. :meth:`MicroBatch.finish` multiplies the loss to backpropagate by exactly that
    number and nothing else, which undoes the division. Ulysses ranks of one group all hold the same loss,
    and each backpropagates only the positions it computed (the split's ``gather`` keeps its slice in
    backward), so their gradients add up to the group's once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import torch
from tensordict import TensorDict
from torch import Tensor

from ._data.batch import INPUT_IDS, move_batch
from ._data.jagged import offsets_of
from ._data.micro_batch import MicroBatches
from ._data.options import ForwardOptions
from ._data.packing import (
    PackedRow,
    PaddedRows,
    next_token_labels,
    pack_micro_batch,
    pad_micro_batch,
    pad_packed_row,
    shift_right_per_sequence,
    unpack_to_jagged,
)
from ._outputs import LossContext, LossFn, MicroBatchResult

InputLayout = Literal["packed", "padded"]
"""How a backend wants its model inputs: one packed row (``cu_seqlens``, restarting positions) or right-padded
rows with a ``valid`` mask (``ModelConfig.use_remove_padding`` picks it by default)."""


class SequenceSplit(ABC):
    """How the packed row of a micro-batch is split over sequence-parallel ranks (FSDP's Ulysses), or only
    padded for a model that splits it itself (:class:`RowPadding`).

    Core calls :meth:`split` when it builds a :class:`MicroBatch` and :meth:`gather` when it brings
    per-position outputs back; a backend implements both for its process group.
    """

    @abstractmethod
    def split(self, row: PackedRow, labels: Tensor) -> tuple[PackedRow, Tensor]:
        """This rank's part of ``row`` and of its per-position ``labels`` ``(T,)``.

        The part's ``cu_seqlens`` and ``max_seqlen`` may describe a longer row than ``T`` (padding to a
        multiple of the group size); :meth:`gather` output is trimmed back to ``T`` positions.
        """

    @abstractmethod
    def gather(self, per_position: Tensor) -> Tensor:
        """Every rank's per-position outputs ``(t, ...)``, concatenated in row order (autograd-aware)."""


@dataclass(frozen=True)
class RowPadding(SequenceSplit):
    """The whole packed row on every rank, padded to a multiple of ``multiple`` tokens: for a model that splits
    the row over its ranks and gathers it back itself (Megatron's sequence parallelism reduce-scatters it in
    the embedding, which needs a multiple of the tensor-parallel size, and gathers it before the head)."""

    multiple: int

    def split(self, row: PackedRow, labels: Tensor) -> tuple[PackedRow, Tensor]:
        return pad_packed_row(row, labels, self.multiple)

    def gather(self, per_position: Tensor) -> Tensor:
        return per_position


@dataclass(frozen=True, kw_only=True)
class RoundTrip:
    """What the micro-batches of one ``forward_backward_batch`` call share.

    Attributes:
        loss_fn: the caller's loss function, or ``None`` (outputs only).
        options: temperature and entropy of the forward.
        context: global counts; each micro-batch gets its own ``micro_batch_index``.
        gradient_divisor: the backend's ``Engine.gradient_divisor`` (see the module docstring).
        keep_outputs: whether this rank returns per-token outputs (``Engine.is_output_rank``).
    """

    loss_fn: LossFn | None
    options: ForwardOptions
    context: LossContext
    gradient_divisor: int
    keep_outputs: bool

    def micro_batches(
        self, split: MicroBatches, *, device: str, layout: InputLayout, sequence_split: SequenceSplit | None
    ) -> list[MicroBatch]:
        """Every pass of ``split`` built (:meth:`MicroBatch.build`), its filler passes last."""
        fillers = [split.filler()] * split.fillers if split.fillers else []  # most calls need none: no slice
        return [
            MicroBatch.build(
                micro_batch,
                index,
                device=device,
                layout=layout,
                round_trip=self,
                sequence_split=sequence_split,
                filler=index >= len(split.batches),
            )
            for index, micro_batch in enumerate([*split.batches, *fillers])
        ]


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """One micro-batch on the engine device, laid out for the model, and the way back to a loss.

    Attributes:
        batch: the micro-batch in the no-padding format, on the device; what ``loss_fn`` receives.
        inputs: the model layout of this rank's positions.
        labels: ``(P,)`` next-token id of every position this rank computes, in :meth:`rows` order
            (0 where a sequence ends).
        num_tokens: real tokens of the micro-batch.
        context: the loss context of this micro-batch.
        round_trip: what every micro-batch of the call shares.
        sequence_split: the sequence-parallel split, or ``None``.
        filler: a pass that only keeps this rank's collectives paired with the other ranks' (it holds fewer
            sequences than the agreed micro-batch count): :meth:`finish` calls no loss and returns no result.
    """

    batch: TensorDict
    inputs: PackedRow | PaddedRows
    labels: Tensor
    num_tokens: int
    context: LossContext
    round_trip: RoundTrip
    sequence_split: SequenceSplit | None = None
    filler: bool = False

    @classmethod
    def build(
        cls,
        batch: TensorDict,
        index: int,
        *,
        device: str,
        layout: InputLayout,
        round_trip: RoundTrip,
        sequence_split: SequenceSplit | None = None,
        filler: bool = False,
    ) -> MicroBatch:
        """Move ``batch`` to ``device`` and lay it out as ``layout`` (split over ``sequence_split``'s ranks).

        Lengths are read once, before the move (from a batch on the host, as engines receive it):
        ``max_seqlen`` and the packed row's host ``lengths`` need no device sync, in this call or in the
        model's layers.
        """
        lengths = offsets_of(batch[INPUT_IDS]).diff().tolist()
        max_seqlen, num_tokens = max(lengths), sum(lengths)
        # NOTE: non-blocking to an accelerator: a blocking copy from pageable host memory waits for everything
        # queued on the device first, so the host could not queue this micro-batch's kernels while the last
        # one computes. Never towards the CPU, whose code would read the copy before it lands.
        on_device = move_batch(batch, device, non_blocking=torch.device(device).type != "cpu")
        inputs: PackedRow | PaddedRows
        if layout == "padded":
            if sequence_split is not None:
                raise ValueError("a sequence-parallel split needs the packed layout, got 'padded'.")
            inputs = pad_micro_batch(on_device, max_seqlen, lengths)
        else:
            inputs = pack_micro_batch(on_device, lengths)
        labels = next_token_labels(on_device[INPUT_IDS].values(), inputs.offsets)
        if sequence_split is not None:
            assert isinstance(inputs, PackedRow)  # the padded layout was refused above
            inputs, labels = sequence_split.split(inputs, labels)
        return cls(
            batch=on_device,
            inputs=inputs,
            labels=labels,
            num_tokens=num_tokens,
            context=replace(round_trip.context, micro_batch_index=index),
            round_trip=round_trip,
            sequence_split=sequence_split,
            filler=filler,
        )

    @property
    def options(self) -> ForwardOptions:
        """Temperature and entropy of the forward."""
        return self.round_trip.options

    @property
    def num_sequences(self) -> int:
        return len(self.inputs.offsets) - 1

    def rows(self, model_output: Tensor) -> Tensor:
        """Model output ``(rows, width, ...)`` as one row per computed position ``(P, ...)``, like ``labels``.

        Packed: the single row; padded: the real positions, in packed token order.
        """
        if isinstance(self.inputs, PaddedRows):
            return model_output.flatten(0, 1)[self.inputs.token_positions]
        return model_output[0]

    def to_tokens(self, per_position: Tensor) -> Tensor:
        """Per-position values ``(P, ...)`` (position ``p`` concerns token ``p + 1``) as a jagged per-token field.

        Gathers sequence-parallel slices, drops split padding, shifts right inside each sequence (position
        ``i`` concerns token ``i``, each first position 0; docs §7.1) and unpacks onto the micro-batch's own
        offsets, so the result combines with its fields (``log_probs * loss_mask``).
        """
        if self.sequence_split is not None:
            per_position = self.sequence_split.gather(per_position)[: self.num_tokens]
        offsets = self.inputs.offsets
        shifted = shift_right_per_sequence(per_position, offsets, fill=0.0)
        return unpack_to_jagged(shifted, offsets, num_tokens=self.num_tokens)

    def finish(self, per_position: Mapping[str, Tensor]) -> tuple[Tensor, MicroBatchResult]:
        """Per-token outputs, the caller's loss and metrics of this micro-batch.

        Args:
            per_position: the backend's fields (``log_probs``, ``entropy``, ``values``), each ``(P, ...)`` in
                :meth:`rows` order.

        Returns:
            ``(loss_to_backward, result)``: the loss times the backend's gradient divisor (the one scaling
            rule, see the module docstring), a zero without ``loss_fn``; and the detached outputs (on output
            ranks), the detached unscaled loss and the metrics. A filler's loss is zero but reaches every
            field, so its backward runs through the model (and its collectives) and adds nothing; its result
            is empty.

        Raises:
            TypeError: ``loss_fn`` did not return a scalar tensor.
        """
        if self.filler:
            touched = torch.stack([values.sum() for values in per_position.values()]).sum()
            return touched * 0.0, MicroBatchResult(outputs=None)
        outputs = TensorDict(
            {name: self.to_tokens(values) for name, values in per_position.items()},
            batch_size=[self.num_sequences],
        )
        trip = self.round_trip
        kept = outputs.detach() if trip.keep_outputs else None
        if trip.loss_fn is None:
            return torch.zeros((), device=self.labels.device), MicroBatchResult(outputs=kept)
        loss, metrics = trip.loss_fn(outputs, self.batch, self.context)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn must return (scalar tensor, dict of floats), got loss of type {type(loss).__name__}"
                f"{' with shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else ''}."
            )
        # NOTE: tensors stay on the device; the engine reads every micro-batch's numbers back in one go after
        # the last one (a float() here would stall the host between micro-batches).
        result = MicroBatchResult(
            outputs=kept,
            loss=loss.detach().reshape(()),
            metrics={
                k: v.detach().reshape(()) if isinstance(v, torch.Tensor) else float(v)
                for k, v in metrics.items()
            },
        )
        return loss.reshape(()) * trip.gradient_divisor, result
