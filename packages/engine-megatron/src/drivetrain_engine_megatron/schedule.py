"""Run a rank's micro-batches through megatron's forward-backward schedule (no pipelining, 1F1B, interleaved).

Megatron owns the loop: it calls ``forward_step(data_iterator, model)`` per micro-batch and chunk, and on the
last pipeline stage calls the returned loss function on the model output. The iterator yields core's
:class:`~drivetrain_engine_core.backend.MicroBatch` objects (already laid out and on the device). On the last
stage of a language model the output layer is passed through (:mod:`.head`), so the model output is the last
hidden states; the loss function computes the per-position fields from them (or from the value head's
output) and hands them to ``MicroBatch.finish``, which returns the loss to
backward (scaled by the engine's ``gradient_divisor``, 1: megatron sums) and the micro-batch result. The loss
is returned in megatron's three-value form with ``calculate_per_token_loss`` set, so the schedule neither
divides it by the micro-batch count nor rescales the gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from drivetrain_engine_core.backend import MicroBatch, MicroBatchResult, host_floats
from drivetrain_engine_core.kit import RouterLoss, distributed
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from .head import hidden_states_out, output_shard
from .inputs import model_kwargs
from .outputs import language_model_fields, value_fields
from .replay import MegatronRouterReplay
from .router_loss import RouterLogits

_FieldsFn = Callable[[torch.Tensor, MicroBatch], dict[str, torch.Tensor]]


@dataclasses.dataclass(kw_only=True)
class StepSpec:
    """What a schedule run needs to know besides the micro-batches.

    Attributes:
        value_model: the chunks end in a value head rather than the LM head.
        vocab_size: real vocabulary size (output rows beyond it are padding).
        chunk_size: positions whose logits exist at once (``engine.entropy_chunk_size``).
        router: the router balance loss to add (a mixture-of-experts language model), or ``None``.
        router_logits: what records the routers' logits (set with ``router``).
        replay: what routes each micro-batch through its recorded experts (router replay), or ``None``.
    """

    value_model: bool
    vocab_size: int
    chunk_size: int
    router: RouterLoss | None = None
    router_logits: RouterLogits | None = None
    replay: MegatronRouterReplay | None = None


def run_schedule(
    chunks: list[torch.nn.Module], micro_batches: Sequence[MicroBatch], forward_only: bool, spec: StepSpec
) -> list[MicroBatchResult]:
    """Forward (and backward) every micro-batch; results are complete on every rank except ``outputs``.

    ``outputs`` exist on the last pipeline stage only; losses and metrics are broadcast from it so that every
    rank reports the same numbers.
    """
    results: list[MicroBatchResult] = []
    forward_step = partial(_forward_step, spec=spec, results=results)
    iterators: Any = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    try:
        # With variable_seq_lengths (always set) megatron sends shapes between stages; seq_length is a hint.
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=max(micro_batch.inputs.max_seqlen for micro_batch in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        if spec.replay is not None:
            spec.replay.clear()
    return _share_from_last_stage(results, len(micro_batches))


def _forward_step(
    data_iterator: Iterator[MicroBatch],
    model: torch.nn.Module,
    *,
    spec: StepSpec,
    results: list[MicroBatchResult],
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]]:
    micro_batch = next(data_iterator)
    gpt = unwrap_model(model)
    language_head = not spec.value_model and gpt.post_process
    if spec.router_logits is not None:
        spec.router_logits.clear()
    if spec.replay is not None:
        # No pipelining for routed models: the previous micro-batch's backward (and recomputation) is done.
        spec.replay.set(micro_batch)
    with hidden_states_out(gpt) if language_head else nullcontext():
        output = model(**model_kwargs(micro_batch))
    # Only the last stage's loss step runs; on other stages ``fields_of`` is never called.
    fields_of: _FieldsFn = (
        partial(language_model_fields, shard=output_shard(gpt, spec.vocab_size), chunk_size=spec.chunk_size)
        if language_head
        else value_fields
    )
    return output, partial(
        _loss_step, micro_batch=micro_batch, fields_of=fields_of, results=results, spec=spec
    )


def _loss_step(
    output: torch.Tensor,
    *,
    micro_batch: MicroBatch,
    fields_of: _FieldsFn,
    results: list[MicroBatchResult],
    spec: StepSpec,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Last stage: finish one micro-batch (its router balance loss added), in megatron's ``(loss, num_tokens,
    log)`` form."""
    loss, result = micro_batch.finish(fields_of(output, micro_batch))
    if spec.router is not None and spec.router_logits is not None and spec.router.applies(micro_batch):
        # No pipelining for routed models: this micro-batch's forward, every routed layer, just ran here.
        loss, result = spec.router.add(loss, result, spec.router_logits.take(), micro_batch)
    results.append(result)
    # num_tokens=1: with calculate_per_token_loss megatron only sums it; it never rescales the loss by it.
    return loss, torch.ones((), dtype=torch.int, device=output.device), {}


def _share_from_last_stage(results: list[MicroBatchResult], count: int) -> list[MicroBatchResult]:
    """Give every pipeline rank the last stage's losses and metrics (outputs stay on the last stage)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return results
    summary = _host_summary(results) if mpu.is_pipeline_last_stage(ignore_virtual=True) else None
    shared = distributed.broadcast_object(
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
    return [
        MicroBatchResult(outputs=None, loss=None if loss is None else torch.tensor(loss), metrics=metrics)
        for loss, metrics in shared
    ][:count]


def _host_summary(results: list[MicroBatchResult]) -> list[tuple[float | None, dict[str, float]]]:
    """Each micro-batch's ``(loss, metrics)`` as Python floats, read from the device in one transfer.

    NOTE: a device tensor in ``broadcast_object`` is pickled with its device, so every other stage would
    unpickle it onto the last stage's GPU (a CUDA context there, or a failure where that GPU is not visible).
    """
    values: list[float | torch.Tensor] = []
    for result in results:
        values += [*([] if result.loss is None else [result.loss]), *result.metrics.values()]
    numbers = iter(host_floats(values))
    return [
        (
            None if result.loss is None else next(numbers),
            {name: next(numbers) for name in result.metrics},
        )
        for result in results
    ]
