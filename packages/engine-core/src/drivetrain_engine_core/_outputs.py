"""Types that cross the boundary between the engine, the loss function and the caller."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict


@dataclass(frozen=True)
class LossContext:
    """What a loss function needs beyond the micro-batch to normalise globally.

    Losses divide by ``global_token_count`` (loss-mask tokens in the whole mini-batch, summed over all
    data-parallel ranks) or ``global_sequence_count``, never by micro-batch sizes, so loss and gradient are the
    same whatever the micro-batching, dynamic batching or data-parallel size. How the engine scales the loss
    for its gradient reduction is not the loss's concern (``drivetrain_engine_core.backend.MicroBatch`` does it).

    Attributes:
        global_token_count: loss-mask tokens of the mini-batch over every data-parallel rank.
        global_sequence_count: sequences of the mini-batch over every data-parallel rank.
        micro_batch_index: index of the micro-batch on this rank.
        num_micro_batches: micro-batches on this rank (equal on every rank).
    """

    global_token_count: int
    global_sequence_count: int
    micro_batch_index: int = 0
    num_micro_batches: int = 1


LossFn = Callable[
    [TensorDict, TensorDict, LossContext], tuple[torch.Tensor, Mapping[str, float | torch.Tensor]]
]
"""``loss_fn(model_output, micro_batch, context) -> (loss, metrics)``.

``model_output`` holds jagged per-token ``log_probs`` (and ``entropy`` when asked) for language models or
``values`` for value models, aligned with ``micro_batch["input_ids"]``: position ``i`` scores token ``i``
given the tokens before it (position 0 of every sequence is 0). ``loss`` is this micro-batch's
contribution to the global mini-batch loss (a scalar); ``metrics`` are floats or scalar tensors (a tensor
stays on the device until the engine reads every micro-batch's numbers at once: a ``float()`` in the loss
waits for the device after each micro-batch).
"""


@dataclass
class MicroBatchResult:
    """What a backend returns for one micro-batch (in micro-batch order).

    Attributes:
        outputs: per-token outputs as jagged tensors, ``None`` on ranks that hold no outputs.
        loss: the detached, unscaled loss contribution, ``None`` without a loss function or output.
        metrics: metrics returned by the loss function (scalar tensors stay on the device until the engine reads
            all micro-batches' numbers at once).
    """

    outputs: TensorDict | None
    loss: torch.Tensor | None = None
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass
class ForwardBackwardOutput:
    """Result of ``forward_backward_batch`` / ``train_batch`` / ``infer_batch``.

    Attributes:
        outputs: per-token outputs in the caller's sample order (``None`` where ``is_output_rank`` is false).
        loss: the mini-batch loss over all data-parallel ranks, or ``None`` without a loss function.
        metrics: per-micro-batch metric values keyed by name, plus engine metrics (``grad_norm``, ``lr``).
    """

    outputs: TensorDict | None
    loss: float | None
    metrics: dict[str, list[float] | float] = field(default_factory=dict)


def host_floats(values: Sequence[float | torch.Tensor]) -> list[float]:
    """Python floats of scalar ``values``, reading device tensors back with one transfer per device.

    The micro-batches' losses and metrics of a step are read here once, after the last micro-batch, so the
    host never waits for the device in the middle of a step.
    """
    floats: list[float] = [v if not isinstance(v, torch.Tensor) else 0.0 for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(index)
    for indices in by_device.values():
        stacked = torch.stack([values[i].reshape(()).double() for i in indices])  # type: ignore[union-attr]
        for index, number in zip(indices, stacked.tolist(), strict=True):
            floats[index] = float(number)
    return floats
