"""One step's results: outputs back in sample order, the loss and metrics summed over data-parallel ranks in
one collective together with the step's work, and the ``perf/*`` metrics that work gives (:mod:`.throughput`)."""

from __future__ import annotations

import math
from typing import Any

from tensordict import TensorDict

from . import _distributed as distributed
from ._config import EngineConfig
from ._data.batch import INPUT_IDS
from ._data.jagged import offsets_of
from ._outputs import ForwardBackwardOutput, MicroBatchResult, host_floats
from ._throughput import StepClock, TransformerShape, peak_tflops, speed_metrics


class StepMeter:
    """The work of the engine's steps and its speed metrics.

    Args:
        config: the engine config (device, peak TFLOP/s, compute dtype).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.shape: TransformerShape | None = None
        """The model's shape, from which FLOPs are counted (``None``: no FLOP metrics)."""
        self.step_work = (0.0, 0.0)
        """Global ``(tokens, FLOPs)`` of the last ``forward_backward_batch``."""

    def local_work(self, batch: TensorDict, forward_only: bool) -> tuple[float, float]:
        """This rank's ``(tokens, FLOPs)`` of ``batch``, from its lengths on the host (NaN FLOPs: unknown)."""
        lengths = offsets_of(batch[INPUT_IDS]).diff().tolist()
        if self.shape is None:
            return float(sum(lengths)), math.nan
        return float(sum(lengths)), self.shape.step_flops(lengths, backward=not forward_only)

    def speed_metrics(self, clock: StepClock) -> dict[str, float]:
        """The ``perf/*`` metrics of the work since ``clock`` started (see :mod:`.throughput`)."""
        seconds, device_peak = clock.stop()
        tokens, flops = self.step_work
        return speed_metrics(
            seconds=seconds,
            tokens=tokens,
            flops=None if math.isnan(flops) else flops,
            devices=distributed.world_size(),
            peak=peak_tflops(self.config.device, self.config.peak_tflops, self.config.param_dtype),
            device_peak_bytes=device_peak,
        )

    def assemble(
        self,
        results: list[MicroBatchResult],
        micro_batches: Any,
        *,
        with_loss: bool,
        work: tuple[float, float],
        group: distributed.ProcessGroup | None,
        keep_outputs: bool,
    ) -> ForwardBackwardOutput:
        """Outputs in sample order and the metrics, with one collective for the loss, tokens and FLOPs."""
        outputs = None
        if keep_outputs:
            outputs = micro_batches.restore([r.outputs for r in results])
        losses = [r.loss for r in results if r.loss is not None]
        numbers = iter(host_floats([*losses, *(v for r in results for v in r.metrics.values())]))
        local_loss = sum(next(numbers) for _ in losses)
        metrics: dict[str, list[float] | float] = {}
        for result in results:
            for name in result.metrics:
                metrics.setdefault(name, []).append(next(numbers))  # type: ignore[union-attr]
        total_loss, *step_work = distributed.all_reduce_sums([local_loss, *work], group)
        self.step_work = (step_work[0], step_work[1])
        return ForwardBackwardOutput(outputs=outputs, loss=total_loss if with_loss else None, metrics=metrics)
