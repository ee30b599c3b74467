"""The router's load-balancing loss on the FSDP engine: transformers' router logits into core's per-sequence term.

The formula, its normalisation and the reasons for them are core's (``drivetrain_engine_core.kit.RouterLoss``,
shared with the Megatron engine); this module asks transformers for the router logits and refuses what FSDP
cannot split (Ulysses spreads a sequence over ranks).
"""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.kit import ROUTER_AUX_METRIC as METRIC
from drivetrain_engine_core.kit import RouterLoss, router_loss_of

from .config import FSDPEngineConfig

__all__ = ["METRIC", "RouterLoss", "router_kwargs", "router_settings"]


def router_kwargs(router: RouterLoss | None) -> dict[str, bool]:
    """The forward's extra keyword arguments: transformers returns the router logits only when asked."""
    return {} if router is None else {"output_router_logits": True}


def router_settings(
    config: FSDPEngineConfig, hf_config: Any, model_type: str, sp_size: int
) -> RouterLoss | None:
    """The balance loss of the model ``hf_config`` describes (core's :func:`router_loss_of`), or ``None``.

    Raises:
        ConfigError: a positive coefficient for a model without a router, or with Ulysses sequence parallelism
            (a sequence's rows are then spread over ranks; not implemented: the loss is then neither trained
            nor reported).
    """
    router = router_loss_of(config.router_aux_loss_coef, hf_config, model_type)
    if router is None or sp_size == 1:
        return router
    if not router.coefficient:
        return None  # neither trained nor reported under Ulysses
    raise ConfigError(
        f"the router load-balancing loss of {type(hf_config).__name__} is computed per sequence, and "
        f"engine.ulysses_sequence_parallel_size={sp_size} spreads a sequence over ranks, which it does not "
        "support yet. Set engine.ulysses_sequence_parallel_size=1 for mixture-of-experts models."
    )
