"""Typed registrars that plugin hooks fill: engines, roles, checkpoint mergers, rollouts and environments."""

from .base import KeyedRegistry, Registration
from .engines import ANY_DEVICE, EngineEntry, EngineRegistry
from .environments import EnvironmentRegistry
from .mergers import CheckpointMergerRegistry
from .roles import NamedEntry, RoleRegistry
from .rollouts import RolloutRegistry
from .source import DIRECT_SOURCE, PluginSource

__all__ = [
    "ANY_DEVICE",
    "DIRECT_SOURCE",
    "CheckpointMergerRegistry",
    "EngineEntry",
    "EngineRegistry",
    "EnvironmentRegistry",
    "KeyedRegistry",
    "NamedEntry",
    "PluginSource",
    "Registration",
    "RoleRegistry",
    "RolloutRegistry",
]
