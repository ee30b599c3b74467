"""Router replay on the FSDP engine: core's replay hooks around a micro-batch that carries recorded routes.

The formula and the record's layout are core's (``drivetrain_engine_core.kit``'s router replay); this module finds
the routers once and refuses what FSDP cannot replay (Ulysses gives each rank a slice of a sequence's tokens,
which the record's token layout does not follow).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from drivetrain_engine_core.backend import BatchError, MicroBatch
from drivetrain_engine_core.kit import ROUTED_EXPERTS, hf_routers, micro_batch_routes, replaying_routes


class RouterReplay:
    """Replays a micro-batch's :data:`ROUTED_EXPERTS` through the routers of one model."""

    def __init__(self, model: Any, sp_size: int) -> None:
        self._routers = hf_routers(model)
        self._model_name = type(model).__name__
        self._sp_size = sp_size

    def around(self, micro_batch: MicroBatch) -> AbstractContextManager[None]:
        """The context to run the micro-batch's forward and backward in (a no-op without recorded routes).

        Raises:
            BatchError: routes for a model without routers, or under Ulysses sequence parallelism.
        """
        routes = micro_batch_routes(micro_batch)
        if routes is None:
            return nullcontext()
        if not self._routers:
            raise BatchError(
                f"the batch carries {ROUTED_EXPERTS!r} (router replay), but {self._model_name} has no "
                "transformers TopKRouter to replay them through (a dense model?); turn router replay off "
                "(rollout.router_replay=disabled) or drop the field."
            )
        if self._sp_size > 1:
            raise BatchError(
                f"router replay ({ROUTED_EXPERTS!r} in the batch) with engine.ulysses_sequence_parallel_size="
                f"{self._sp_size} is not supported (each rank routes a slice of a sequence); set "
                "engine.ulysses_sequence_parallel_size=1 or rollout.router_replay=disabled."
            )
        return replaying_routes(self._routers, routes)
