"""Typed registrars that plugin hooks fill: engines, roles, checkpoint mergers and rollouts."""

from .base import KeyedRegistry, Registration
from .engines import ANY_DEVICE, EngineEntry, EngineRegistry
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
    "KeyedRegistry",
    "NamedEntry",
    "PluginSource",
    "Registration",
    "RoleRegistry",
    "RolloutRegistry",
]
