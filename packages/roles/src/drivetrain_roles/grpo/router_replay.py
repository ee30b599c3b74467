"""``rollout.router_replay``: the checks of router replay (R3) before a run starts.

Recording needs a rollout that records routed experts (``hf``); replaying needs an engine that replays them
(FSDP: core's ``router_replay`` hooks around each micro-batch). Both are refused up front, before the warm
start, with the option named: the batch-time refusals (the rollout's, Megatron's) come after minutes of work.
"""

from __future__ import annotations

from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.rollout import RecordsRoutedExperts

ROUTER_REPLAY_MODES = ("disabled", "R3")
"""``rollout.router_replay``: off, or the rollout's routing replayed in training (R3)."""

REPLAYING_BACKENDS = ("fsdp",)
"""Engine backends whose forward replays recorded routes."""


def check_mode(mode: str) -> None:
    """Raises: ConfigError: ``mode`` is not one of :data:`ROUTER_REPLAY_MODES`."""
    if mode not in ROUTER_REPLAY_MODES:
        raise ConfigError(
            f"rollout.router_replay={mode!r}: choose from {list(ROUTER_REPLAY_MODES)} (R2, the replay of the old "
            "policy's own routing, is not implemented)."
        )


def check_router_replay(mode: str, rollout_name: str, rollout_class: type, backend: str) -> None:
    """Raises: ConfigError: R3 with a rollout that does not record routes or an engine that does not replay
    them."""
    if mode == "disabled":
        return
    if not issubclass(rollout_class, RecordsRoutedExperts):
        raise ConfigError(
            f"rollout.router_replay={mode} needs each token's routed experts, which rollout.name={rollout_name} "
            "does not record; use rollout.name=hf or set rollout.router_replay=disabled."
        )
    if backend not in REPLAYING_BACKENDS:
        raise ConfigError(
            f"rollout.router_replay={mode}: engine.backend={backend} does not replay routed experts (only "
            f"{list(REPLAYING_BACKENDS)} does); use engine.backend=fsdp or set rollout.router_replay=disabled."
        )
