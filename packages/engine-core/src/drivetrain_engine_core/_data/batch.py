"""The no-padding batch: building one, checking one, and reading its sequence lengths (ARCHITECTURE §4).

A batch is a ``TensorDict`` with ``batch_size=[num_sequences]``. Per-token fields are jagged nested tensors
(``layout=torch.jagged``) whose ragged dimension is dim 1 and which all share the offsets tensor of
``input_ids``; sharing the same offsets *object* matters because torch only combines jagged tensors
(``log_probs * loss_mask``) whose ragged sizes come from one offsets tensor. Per-sequence fields are dense
with first dim ``num_sequences``.

``loss_mask`` is stored as ``torch.bool``: losses multiply by it (bool promotes to the float dtype of the
other operand) or index with it, and a bool can never hold a fractional weight by accident.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor
from torch.nested._internal.nested_tensor import NestedTensor

from .._errors import BatchError
from .jagged import has_holes, offsets_of, ragged_dim_of

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
LOSS_MASK = "loss_mask"
LOSS_MASK_DTYPE = torch.bool
ROUTED_EXPERTS = "routed_experts"
"""Each token's recorded expert indices ``(n, j, layers, top_k)`` for router replay (:mod:`..router_replay`)."""

INTEGER_FIELDS: tuple[str, ...] = (INPUT_IDS, POSITION_IDS, ROUTED_EXPERTS)
"""Per-token fields that hold token ids, positions or expert indices and must be integer."""

FLOAT_FIELDS: tuple[str, ...] = (
    "old_log_probs",
    "ref_log_prob",
    "log_probs",
    "advantages",
    "values",
    "returns",
    "entropy",
)
"""Per-token fields that hold real numbers and must be floating point."""

TOKEN_FIELDS: tuple[str, ...] = (*INTEGER_FIELDS, LOSS_MASK, *FLOAT_FIELDS)
"""Known per-token fields; they must be jagged. Any other jagged field is per-token too."""


def jagged(values: Tensor, offsets: Tensor) -> Tensor:
    """A jagged nested tensor of shape ``(n, j, *values.shape[1:])`` over flat ``values`` and ``offsets``."""
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def expand_to_tokens(values: Tensor, like: Tensor) -> Tensor:
    """A per-sequence ``(n, ...)`` tensor repeated over the tokens of the jagged ``(n, j)`` tensor ``like``: a
    jagged ``(n, j, ...)`` tensor on ``like``'s offsets (verl's ``expand_as_nested``: a per-sequence temperature
    or reward per token; the shared offsets let it combine with ``like``'s fields).

    Raises:
        BatchError: ``like`` is not a jagged ``(n, j)`` tensor, or ``values`` has not one row per sequence.
    """
    if not is_jagged(like) or like.dim() != 2 or ragged_dim_of(like) != 1:
        raise BatchError(
            f"expand_to_tokens: like must be a jagged (n, j) tensor such as input_ids, got {_describe(like)}."
        )
    offsets = offsets_of(like)
    n = len(offsets) - 1
    if values.is_nested or values.dim() < 1 or values.shape[0] != n:
        raise BatchError(
            f"expand_to_tokens: values must have one row per sequence ({n}), got {_describe(values)}."
        )
    flat = torch.repeat_interleave(
        values.to(offsets.device), offsets.diff(), dim=0, output_size=like.values().shape[0]
    )
    return jagged(flat, offsets)


def _flat_and_offsets(sequences: Sequence[Tensor], name: str) -> tuple[Tensor, Tensor]:
    if not sequences:
        raise BatchError(f"make_batch: {name} is empty; pass at least one sequence.")
    for i, seq in enumerate(sequences):
        if not isinstance(seq, torch.Tensor) or seq.dim() < 1:
            raise BatchError(f"make_batch: {name}[{i}] must be a tensor of shape (length, ...), got {seq!r}.")
    device = sequences[0].device
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64, device=device)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return torch.cat(list(sequences)), offsets


def _token_field(name: str, value: Sequence[Tensor], offsets: Tensor) -> Tensor:
    flat, own = _flat_and_offsets(value, name)
    if not torch.equal(own, offsets):
        raise BatchError(
            f"make_batch: per-token field {name!r} has sequence lengths {own.diff().tolist()} but input_ids "
            f"has {offsets.diff().tolist()}; give one value per token of each sequence."
        )
    return jagged(flat, offsets)


def make_batch(
    input_ids: Sequence[Tensor],
    *,
    position_ids: Sequence[Tensor] | None = None,
    loss_mask: Sequence[Tensor] | None = None,
    **fields: Sequence[Tensor] | Tensor,
) -> TensorDict:
    """Build a no-padding batch from per-sequence tensors.

    Args:
        input_ids: one 1-D integer tensor per sequence.
        position_ids: one ``(length,)`` or ``(length, extra...)`` tensor per sequence; defaults to
            ``arange(length)``.
        loss_mask: one tensor per sequence (converted to bool); defaults to all true.
        **fields: a list/tuple of per-sequence tensors becomes a jagged per-token field; a tensor whose first
            dim is the number of sequences becomes a dense per-sequence field.

    Returns:
        The batch; every jagged field shares ``input_ids``' offsets.

    Raises:
        BatchError: a field does not match the sequences.
    """
    flat_ids, offsets = _flat_and_offsets(input_ids, INPUT_IDS)
    n = len(input_ids)
    lengths = offsets.diff()
    out = {INPUT_IDS: jagged(flat_ids, offsets)}
    if position_ids is None:
        starts = torch.repeat_interleave(offsets[:-1], lengths)
        out[POSITION_IDS] = jagged(torch.arange(len(flat_ids), device=flat_ids.device) - starts, offsets)
    else:
        out[POSITION_IDS] = _token_field(POSITION_IDS, position_ids, offsets)
    if loss_mask is None:
        out[LOSS_MASK] = jagged(
            torch.ones(len(flat_ids), dtype=LOSS_MASK_DTYPE, device=flat_ids.device), offsets
        )
    else:
        mask = _token_field(LOSS_MASK, loss_mask, offsets)
        out[LOSS_MASK] = jagged(as_loss_mask(mask.values(), offsets, "make_batch: loss_mask"), offsets)
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.dim() < 1 or value.shape[0] != n:
                raise BatchError(
                    f"make_batch: dense field {name!r} has shape {tuple(value.shape)}, expected first dim {n} "
                    "(one row per sequence); pass a list of per-sequence tensors for a per-token field."
                )
            out[name] = value
        else:
            out[name] = _token_field(name, value, offsets)
    batch = TensorDict(out, batch_size=[n])
    validate_batch(batch, required=())
    return batch


def as_loss_mask(flat: Tensor, offsets: Tensor, label: str) -> Tensor:
    """``flat`` (one value per token, sequences delimited by ``offsets``) as a bool loss mask.

    NOTE: ``bool(nan)`` is true, so a NaN mask (a division by a zero count upstream) became "train on every
    token" without a word; the engine's own check of float fields never saw it once it was bool.

    Raises:
        BatchError: ``flat`` holds NaN or inf; ``label`` names the field, the message the first sequence.
    """
    if flat.dtype.is_floating_point:
        bad = ~torch.isfinite(flat)
        if bool(bad.any()):
            token = int(bad.nonzero()[0, 0])
            sequence = (
                int(torch.searchsorted(offsets, torch.tensor(token, device=offsets.device), right=True)) - 1
            )
            raise BatchError(
                f"{label} of sequence {sequence} holds {int(bad.sum())} non-finite value(s) (NaN or inf) in the "
                "batch; a loss mask is 0 or 1 per token: fix the values that produced it."
            )
    return flat.to(LOSS_MASK_DTYPE)


def move_batch(batch: TensorDict, device: str | torch.device, *, non_blocking: bool = False) -> TensorDict:
    """``batch`` on ``device``, every jagged field rebuilt on ONE moved copy of ``input_ids``' offsets.

    ``batch.to(device)`` copies each jagged field's offsets separately, so the moved fields stop sharing an
    offsets tensor (and lose it entirely when tensordict rebuilds them, e.g. from consolidated storage).
    A batch already on ``device`` whose jagged fields already share offsets is returned as is.

    Args:
        batch: a batch in the no-padding format.
        device: the target device (``"cuda"`` means the current CUDA device).
        non_blocking: passed to every copy (useful from pinned host memory).
    """
    target = _resolved(torch.device(device))
    offsets = offsets_of(batch.get(INPUT_IDS))
    if _already_on(batch, target, offsets):
        return batch
    lengths = offsets.diff()
    bounds: dict[str, Any] = (
        {}
        if offsets.device.type != "cpu"
        else {"min_seqlen": int(lengths.min()), "max_seqlen": int(lengths.max())}
    )
    moved_offsets = offsets.to(target, non_blocking=non_blocking)
    out = {}
    for key in field_names(batch):
        value = batch.get(key)
        if is_jagged(value):
            values = value.values().to(target, non_blocking=non_blocking)
            out[key] = torch.nested.nested_tensor_from_jagged(values, offsets=moved_offsets, **bounds)
        else:
            out[key] = value.to(target, non_blocking=non_blocking)
    return TensorDict(out, batch_size=batch.batch_size, device=target)


def _resolved(device: torch.device) -> torch.device:
    """``device`` with its index filled in for indexed device types (``cuda`` -> ``cuda:<current>``)."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.empty(0, device=device).device


def _already_on(batch: TensorDict, device: torch.device, offsets: Tensor) -> bool:
    for key in field_names(batch):
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or value.device != device:
            return False
        if is_jagged(value) and offsets_of(value) is not offsets:
            return False
    return True


def sequence_lengths(batch: TensorDict) -> Tensor:
    """Tokens of each sequence (int64, shape ``(n,)``), from ``input_ids``' offsets."""
    return offsets_of(batch[INPUT_IDS]).diff()


def is_jagged(value: object) -> bool:
    """Whether ``value`` is a nested tensor with the jagged layout.

    NOTE: torch implements the jagged layout as the ``NestedTensor`` subclass (a strided nested tensor is a
    plain ``Tensor``); asking the tensor for ``is_nested`` and ``layout`` instead goes through the subclass's
    ``__torch_function__``, about 70 us a call on the CPU, and a step asks some fifty times.
    """
    return isinstance(value, NestedTensor)


def token_keys(batch: TensorDict) -> list[str]:
    """Names of the jagged (per-token) fields of ``batch``."""
    return [k for k in field_names(batch) if is_jagged(batch.get(k))]


def field_names(batch: TensorDict) -> list[str]:
    """Top-level keys of ``batch`` (iterating a TensorDict walks its rows, not its keys)."""
    return list(map(str, batch.keys()))


def validate_batch(batch: TensorDict, required: Iterable[str] = (INPUT_IDS, POSITION_IDS)) -> None:
    """Check that ``batch`` follows the no-padding format.

    Args:
        batch: the batch to check.
        required: fields that must be present.

    Raises:
        BatchError: naming the first field that is wrong and how to fix it.
    """
    require_tensordict(batch)
    if len(batch.batch_size) != 1 or batch.batch_size[0] == 0:
        raise BatchError(
            f"batch must have batch_size=[num_sequences] with at least one sequence, got {list(batch.batch_size)}."
        )
    present = field_names(batch)
    missing = [k for k in (INPUT_IDS, *required) if k not in present]
    if missing:
        hint = " (a padded batch gives it as response_mask)" if missing[0] == LOSS_MASK else ""
        raise BatchError(f"batch is missing field {missing[0]!r}{hint}; it has {sorted(present)}.")
    _check_input_ids(batch[INPUT_IDS])
    offsets = offsets_of(batch[INPUT_IDS])
    n = batch.batch_size[0]
    for key in present:
        value = batch.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_nested or key in TOKEN_FIELDS:
            _check_token_field(key, value, offsets)
        elif value.dim() < 1 or value.shape[0] != n:
            raise BatchError(
                f"dense field {key!r} has shape {tuple(value.shape)}; its first dim must be {n}."
            )


def require_tensordict(batch: object) -> None:
    """Refuse anything but a ``TensorDict`` (a plain ``dict`` of tensors is the usual mistake)."""
    if not isinstance(batch, TensorDict):
        raise BatchError(
            f"batch must be a tensordict.TensorDict, got {type(batch).__name__}; build it with "
            "drivetrain_engine_core.job.make_batch(sequences, **fields) or padded_to_nopad(...)."
        )


def _check_input_ids(ids: Any) -> None:
    if not is_jagged(ids) or ragged_dim_of(ids) != 1 or ids.dim() != 2:
        raise BatchError(
            f"field 'input_ids' must be a jagged nested tensor of shape (n, j) with ragged dim 1, got "
            f"{_describe(ids)}; build batches with make_batch or padded_to_nopad."
        )


def _check_token_field(key: str, value: Tensor, offsets: Tensor) -> None:
    if not is_jagged(value):
        raise BatchError(
            f"per-token field {key!r} must be a jagged nested tensor (layout=torch.jagged), got "
            f"{_describe(value)}; build it with make_batch or nested_tensor_from_jagged(values, offsets)."
        )
    if has_holes(value):
        raise BatchError(
            f"per-token field {key!r} is a jagged tensor with holes (lengths set); build it from contiguous "
            "values with nested_tensor_from_jagged(values, offsets)."
        )
    if ragged_dim_of(value) != 1:
        raise BatchError(
            f"per-token field {key!r} has its ragged dim at {ragged_dim_of(value)}, it must be dim 1 "
            "(shape (n, j, extra...)); put extra per-token dims last."
        )
    if offsets_of(value) is not offsets and not torch.equal(offsets_of(value), offsets):
        raise BatchError(
            f"per-token field {key!r} has sequence lengths {offsets_of(value).diff().tolist()} but input_ids has "
            f"{offsets.diff().tolist()}; per-token fields need one value per token."
        )
    _check_dtype(key, value.dtype)


def _check_dtype(key: str, dtype: torch.dtype) -> None:
    if key in INTEGER_FIELDS and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        raise BatchError(f"field {key!r} must have an integer dtype, got {dtype}; convert with .long().")
    if key == LOSS_MASK and dtype.is_complex:
        raise BatchError(f"field 'loss_mask' must be bool, integer or float, got {dtype}; use torch.bool.")
    if key in FLOAT_FIELDS and not dtype.is_floating_point:
        raise BatchError(f"field {key!r} must have a floating dtype, got {dtype}; convert with .float().")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        if value.is_nested and not is_jagged(value):
            return f"a nested strided tensor of {value.size(0)} sequences"
        layout = "jagged" if is_jagged(value) else "dense"
        return f"a {layout} {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
