"""The router's load-balancing loss on the Megatron engine: each router's logits into core's per-sequence term.

The formula, its normalisation and the reasons for them are core's (``drivetrain_engine_core.kit.RouterLoss``,
shared with the FSDP engine), so both backends add the same number for the same batch. megatron's own balance
losses stay off (mbridge sets ``moe_router_load_balancing_type="none"``): they pool a micro-batch's tokens.

:class:`RouterLogits` records what every ``TopKRouter.gating`` returns during one forward (its logits, ``[s,
b, E]``, sequence first); :meth:`RouterLogits.take` hands them over in the layout of the micro-batch's
``input_ids`` (``[b x s, E]``), the layout core's term reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.kit import RouterLoss, router_loss_of

from .config import MegatronEngineConfig


class RouterLogits:
    """The gating logits of every router of ``chunks``, recorded in forward order (one forward at a time)."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self._logits: list[torch.Tensor] = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    # NOTE: an instance attribute over the bound method: only these routers record, and the
                    # recorded tensor is the one the routing reads (the balance loss backpropagates through it).
                    module.gating = self._recording(module.gating)  # type: ignore[method-assign]

    def _recording(
        self, gating: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def recorded(hidden_states: torch.Tensor) -> torch.Tensor:
            logits = gating(hidden_states)
            self._logits.append(logits)
            return logits

        return recorded

    def clear(self) -> None:
        """Forget what earlier forwards recorded (call before each micro-batch's forward)."""
        self._logits = []

    def take(self) -> list[torch.Tensor]:
        """Per routed layer, the logits as ``[b x s, E]`` (the ``input_ids`` layout); clears the record."""
        taken = [logits.transpose(0, 1).reshape(-1, logits.shape[-1]) for logits in self._logits]
        self._logits = []
        return taken


def router_loss_settings(
    config: MegatronEngineConfig, hf_config: Any, model_type: str, gradient_checkpointing: bool
) -> RouterLoss | None:
    """The balance loss of the model (core's :func:`router_loss_of`), or ``None`` where it is not reported.

    Raises:
        ConfigError: a positive coefficient for a model without a router, with sequence parallelism (a
            router then sees a tensor rank's share of a sequence's tokens) or with activation recomputation
            (megatron recomputes the layers without autograd in the forward, so the router would get no
            gradient from it).
    """
    router = router_loss_of(config.router_aux_loss_coef, hf_config, model_type)
    refused = {
        "engine.sequence_parallel=True (a router then sees one tensor rank's share of each sequence)": (
            config.sequence_parallel
        ),
        "model.gradient_checkpointing=True (megatron's recomputed layers give the router no gradient from it)": (
            gradient_checkpointing
        ),
    }
    reasons = [reason for reason, applies in refused.items() if applies]
    if router is None or not reasons:
        return router
    if not router.coefficient:
        return None  # neither trained nor reported
    raise ConfigError(
        f"engine.router_aux_loss_coef={router.coefficient} trains the router load-balancing loss of "
        f"{type(hf_config).__name__} per sequence, which the megatron backend does not compute with "
        f"{' or '.join(reasons)}. Turn that off, or set engine.router_aux_loss_coef=0."
    )
