"""Run a rank's micro-batches through megatron's forward-backward schedule (no pipelining, 1F1B, interleaved).

Megatron calls ``forward_step(data_iterator, model)`` per micro-batch and chunk, and on the last pipeline
stage calls the returned loss function on the model output. That loss function computes drivetrain's
per-token outputs, asks the engine's :meth:`Engine.compute_micro_batch_loss` for the loss to backward, and
records a :class:`MicroBatchResult`. The loss is returned in megatron's three-value form with
``calculate_per_token_loss`` set, so the schedule neither divides it by the micro-batch count nor rescales
the gradients: drivetrain's losses are already normalised by the global token count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from drivetrain_engine_core import distributed as dist_utils
from drivetrain_engine_core.data.batch import move_batch
from drivetrain_engine_core.data.options import ForwardOptions
from drivetrain_engine_core.outputs import LossContext, LossFn, MicroBatchResult
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from tensordict import TensorDict

from .inputs import ModelInputs, prepare_model_inputs
from .outputs import language_model_outputs, value_model_outputs

ComputeLoss = Callable[
    [LossFn, TensorDict, TensorDict, LossContext], tuple[torch.Tensor, torch.Tensor, dict[str, float]]
]


@dataclasses.dataclass(kw_only=True)
class StepSpec:
    """What a schedule run needs to know besides the micro-batches.

    Attributes:
        value_model: the chunks end in a value head rather than the LM head.
        vocab_size: real vocabulary size (logits beyond it are padding).
        remove_padding: packed THD rows (``True``) or right-padded rows.
        device: device of the model inputs.
        compute_loss: the engine's ``compute_micro_batch_loss``.
    """

    value_model: bool
    vocab_size: int
    remove_padding: bool
    device: str
    compute_loss: ComputeLoss


def run_schedule(
    chunks: list[torch.nn.Module],
    micro_batches: Sequence[TensorDict],
    loss_fn: LossFn | None,
    forward_only: bool,
    options: ForwardOptions,
    context: LossContext,
    spec: StepSpec,
) -> list[MicroBatchResult]:
    """Forward (and backward) every micro-batch; results are complete on every rank except ``outputs``.

    ``outputs`` exist on the last pipeline stage only; losses and metrics are broadcast from it so that every
    rank reports the same numbers.
    """
    results: list[MicroBatchResult] = []
    forward_step = partial(
        _forward_step, loss_fn=loss_fn, options=options, context=context, spec=spec, results=results
    )
    iterators: Any = [_iterate(micro_batches) for _ in chunks] if len(chunks) > 1 else _iterate(micro_batches)
    # With variable_seq_lengths (always set) megatron sends shapes between stages; seq_length is a hint only.
    max_len = max(int(mb["input_ids"].offsets().diff().max()) for mb in micro_batches)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=max_len,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return _share_from_last_stage(results, len(micro_batches))


def _iterate(micro_batches: Sequence[TensorDict]) -> Iterator[tuple[int, TensorDict]]:
    return iter(enumerate(micro_batches))


def _forward_step(
    data_iterator: Iterator[tuple[int, TensorDict]],
    model: torch.nn.Module,
    *,
    loss_fn: LossFn | None,
    options: ForwardOptions,
    context: LossContext,
    spec: StepSpec,
    results: list[MicroBatchResult],
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]]:
    index, micro_batch = next(data_iterator)
    # On the device before packing: outputs are then unpacked on the micro-batch's own offsets, and the loss
    # combines them with its fields (one offsets tensor, one device).
    micro_batch = move_batch(micro_batch, spec.device)
    inputs = prepare_model_inputs(micro_batch, remove_padding=spec.remove_padding, device=spec.device)
    output = model(**inputs.model_kwargs())
    micro_context = dataclasses.replace(context, micro_batch_index=index)
    return output, partial(
        _loss_step, inputs=inputs, micro_batch=micro_batch, loss_fn=loss_fn, options=options,
        context=micro_context, spec=spec, results=results,
    )  # fmt: skip


def _loss_step(
    output: torch.Tensor,
    *,
    inputs: ModelInputs,
    micro_batch: TensorDict,
    loss_fn: LossFn | None,
    options: ForwardOptions,
    context: LossContext,
    spec: StepSpec,
    results: list[MicroBatchResult],
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Last stage: outputs, loss and metrics of one micro-batch in megatron's ``(loss, num_tokens, log)`` form."""
    if spec.value_model:
        model_output = value_model_outputs(output, inputs)
    else:
        model_output = language_model_outputs(output, inputs, options, spec.vocab_size)
    loss_to_backward = output.sum() * 0.0
    reported: torch.Tensor | None = None
    metrics: dict[str, float] = {}
    if loss_fn is not None:
        loss_to_backward, reported, metrics = spec.compute_loss(loss_fn, model_output, micro_batch, context)
    results.append(MicroBatchResult(outputs=model_output.detach(), loss=reported, metrics=metrics))
    # num_tokens=1: with calculate_per_token_loss megatron only sums it; it never rescales the loss by it.
    return loss_to_backward, torch.ones((), dtype=torch.int, device=output.device), {}


def _share_from_last_stage(results: list[MicroBatchResult], count: int) -> list[MicroBatchResult]:
    """Give every pipeline rank the last stage's losses and metrics (outputs stay on the last stage)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return results
    summary = (
        [(r.loss, r.metrics) for r in results] if mpu.is_pipeline_last_stage(ignore_virtual=True) else None
    )
    shared = dist_utils.broadcast_object(
        summary,
        src=mpu.get_pipeline_model_parallel_last_rank(),
        group=mpu.get_pipeline_model_parallel_group(),
    )
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        return results
    if not isinstance(shared, list):
        raise RuntimeError(
            f"expected the last pipeline stage's list of (loss, metrics) per micro-batch, got "
            f"{type(shared).__name__}; every pipeline rank must run the same schedule."
        )
    return [MicroBatchResult(outputs=None, loss=loss, metrics=metrics) for loss, metrics in shared][:count]
