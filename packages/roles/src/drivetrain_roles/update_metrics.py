"""Reducing the per-micro-batch metrics of the losses to one value per update.

Loss functions return each metric as this micro-batch's *contribution* (normalised by global counts), so
the mini-batch value is the sum over micro-batches and data-parallel ranks; the update value is the mean
over its mini-batches (optimizer steps). The sums over ranks wait for the end of the update: one all-reduce
of every metric of every optimizer step, not one per metric and step.
"""

from __future__ import annotations

from collections import defaultdict

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import ForwardBackwardOutput, ProcessGroup
from drivetrain_engine_core.kit import ROUTER_AUX_METRIC, distributed

ENGINE_METRICS: tuple[str, ...] = ("grad_norm", "lr")
"""Metrics the engine itself reports once per step (not per micro-batch)."""

ENGINE_LOSS_METRICS: tuple[str, ...] = (ROUTER_AUX_METRIC,)
"""Terms the engine adds to the loss per micro-batch (a mixture-of-experts model's router balance loss):
reported like the loss function's metrics whenever the engine returns them."""


class UpdateMetrics:
    """Accumulates the metrics of successive ``train_batch`` calls of one update."""

    def __init__(self, dp_group: ProcessGroup | None) -> None:
        self._dp_group = dp_group
        self._local: dict[str, list[float]] = defaultdict(list)
        """This rank's contributions to each loss metric, one per optimizer step (summed over ranks later)."""
        self._values: dict[str, list[float]] = defaultdict(list)
        """The engine's metrics, global already, one per optimizer step."""

    def add(self, output: ForwardBackwardOutput, names: tuple[str, ...]) -> None:
        """Record one optimizer step: this rank's part of each loss metric in ``names``, and the engine metrics.

        Every rank must call it with the same ``names`` (:meth:`summary` reduces them together).

        Raises:
            ConfigError: a name the loss function does not report (a misspelled ``PolicyObjective.metric_names``
                entry read as 0 at every step); on every rank alike, as every rank runs the same loss.
        """
        missing = [name for name in names if name not in output.metrics]
        if missing:
            reported = sorted(
                n for n in output.metrics if n not in ENGINE_METRICS and not n.startswith("perf/")
            )
            raise ConfigError(
                f"the loss function reports no metric {missing}; it reports {reported}. Fix the metric names "
                "(PolicyObjective.metric_names) or the metrics the loss function returns."
            )
        for name in (*names, *(n for n in ENGINE_LOSS_METRICS if n in output.metrics and n not in names)):
            contributions = output.metrics.get(name, [])
            local = sum(contributions) if isinstance(contributions, list) else float(contributions)
            self._local[name].append(local)
        for name in ENGINE_METRICS:
            if name in output.metrics:
                self._values[name].append(float(output.metrics[name]))  # type: ignore[arg-type]

    def summary(self) -> dict[str, float]:
        """Mean of each metric over the recorded steps (collective: the loss metrics' sums over ranks)."""
        flat = [value for values in self._local.values() for value in values]
        # Every rank recorded the same names and steps, so all skip the collective when there is nothing.
        reduced = iter(distributed.all_reduce_sums(flat, self._dp_group) if flat else [])
        steps = {name: [next(reduced) for _ in values] for name, values in self._local.items()}
        values = {**steps, **self._values}
        return {name: sum(per_step) / len(per_step) for name, per_step in values.items() if per_step}
