"""``rollout.router_replay``: the option, and the checks of router replay (R3) before a run starts.

Recording needs a rollout that records routed experts (``hf``); replaying needs an engine that declares the
``router_replay`` capability (FSDP: core's ``router_replay`` hooks around each micro-batch; Megatron:
megatron-core's ``RouterReplay``). Both are refused up front, before the warm start, with the option named:
the batch-time refusals (the rollout's, an engine's) come after minutes of work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from drivetrain_engine_core.backend import ConfigError, EngineConfig
from drivetrain_engine_core.job import plugins

if TYPE_CHECKING:
    from drivetrain_engine_core.backend import Engine


@dataclass(kw_only=True, frozen=True)
class RouterReplayOption:
    """The rollout section's router replay option (a base of ``RolloutConfig``, which ``grpo`` and ``ppo`` use).

    Attributes:
        router_replay: ``disabled``, or ``R3`` (rollout routing replay, verl's ``router_replay.mode=R3``; R2 is
            not implemented): the rollout records each token's routed experts (a mixture-of-experts model,
            ``rollout.name=hf``) and every engine forward over the batch (actor, reference; ppo's critic) routes
            through them, the gating weights still from its own routers.
    """

    router_replay: Literal["disabled", "R3"] = "disabled"

    @property
    def records_routes(self) -> bool:
        """Whether the rollout records routed experts (``SamplingConfig.record_routed_experts``)."""
        return self.router_replay == "R3"


def check_router_replay(
    mode: str, rollout_name: str, rollout_class: type, engine_class: type[Engine]
) -> None:
    """Raises: ConfigError: R3 with a rollout that does not record routes or an engine that does not replay
    them (its ``capabilities.router_replay``)."""
    from drivetrain_engine_core.rollout import RecordsRoutedExperts  # torch: not needed to build the config

    if mode == "disabled":
        return
    if not issubclass(rollout_class, RecordsRoutedExperts):
        raise ConfigError(
            f"rollout.router_replay={mode} needs each token's routed experts, which rollout.name={rollout_name} "
            "does not record; use rollout.name=hf or set rollout.router_replay=disabled."
        )
    if not engine_class.capabilities.router_replay:
        raise ConfigError(
            f"rollout.router_replay={mode}: engine.backend={engine_class.backend_name} does not replay routed "
            "experts (its engine does not declare the router_replay capability); use engine.backend=fsdp or "
            "megatron, or set rollout.router_replay=disabled."
        )


def require_rollout(name: str, router_replay: str, engine: EngineConfig) -> None:
    """The rollout ``rollout.name`` is installed and serves ``rollout.router_replay`` on ``engine.backend``.

    Raises:
        PluginError: no such rollout or engine. ConfigError: as :func:`check_router_replay`.
    """
    registry = plugins()
    rollout_class = registry.rollouts.get(name)
    if router_replay != "disabled":
        engine_class = registry.engines.get("language_model", engine.backend, engine.device)
        check_router_replay(router_replay, name, rollout_class, engine_class)
