"""The rollout a job's ``rollout`` section names: the check that it can run as set, and building it.

``rollout.options`` are plain values in the config (``rollout.options.<key>=<value>``, a YAML mapping) because
which keys exist depends on ``rollout.name``: each rollout plugin declares its own as a dataclass
(:class:`~drivetrain_engine_core.rollout.RolloutOptions`), and core builds them against it. That is
checked up front, before the warm start, on every rank: a misspelt key would otherwise surface after minutes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from drivetrain_engine_core.job import create_rollout, rollout_options
from drivetrain_engine_core.rollout import Rollout

from . import router_replay

if TYPE_CHECKING:
    from drivetrain_engine_core.backend import EngineConfig


class RolloutSection(Protocol):
    """The rollout section as :func:`require_rollout` reads it: its backend's name and settings."""

    @property
    def name(self) -> str: ...
    @property
    def router_replay(self) -> str: ...
    @property
    def options(self) -> dict[str, Any]: ...


def require_rollout(section: RolloutSection, engine: EngineConfig) -> None:
    """The rollout ``rollout.name`` is installed, takes ``rollout.options`` and serves ``rollout.router_replay``
    on the ``engine``.

    Raises:
        PluginError: no such rollout or engine. ConfigError: an option it does not take or of the wrong type (as
            :func:`~drivetrain_engine_core.job.rollout_options`), router replay it cannot serve (as
            :func:`.router_replay.require_rollout`).
    """
    rollout_options(section.name, section.options)
    router_replay.require_rollout(section.name, section.router_replay, engine)


def build_rollout(section: RolloutSection, model_path: str, device: str) -> Rollout:
    """The rollout ``rollout.name`` with ``rollout.options``, serving ``model_path`` on ``device``."""
    return create_rollout(section.name, model_path=model_path, device=device, options=section.options)
