"""The rollout a job's ``rollout`` section names: the check that it can run as set, and building it.

``rollout.options`` are plain values in the config (``rollout.options.<key>=<value>``, a YAML mapping) because
which keys exist depends on ``rollout.name``: each rollout plugin declares its own as a dataclass
(:class:`~drivetrain_engine_core.rollout.RolloutOptions`), and core builds them against it. That is
checked up front, before the warm start, on every rank: a misspelt key would otherwise surface after minutes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from drivetrain_engine_core.job import create_rollout, rollout_options
from drivetrain_engine_core.rollout import Rollout, RolloutOptions

from ..jobs.ray_server import require_placed
from . import router_replay
from .trainer_config import versions_in_flight

if TYPE_CHECKING:
    from drivetrain_engine_core.backend import EngineConfig

    from .trainer_config import TrainerConfig


class RolloutSection(Protocol):
    """The rollout section as :func:`require_rollout` reads it: its backend's name and settings."""

    @property
    def name(self) -> str: ...
    @property
    def router_replay(self) -> str: ...
    @property
    def options(self) -> dict[str, Any]: ...


def require_rollout(section: RolloutSection, engine: EngineConfig, trainer: TrainerConfig) -> None:
    """The rollout ``rollout.name`` is installed, takes ``rollout.options`` (for the ``trainer``'s versions:
    :func:`job_rollout_options`) and serves ``rollout.router_replay`` on the ``engine``.

    Raises:
        PluginError: no such rollout or engine. ConfigError: an option it does not take or of the wrong type (as
            :func:`~drivetrain_engine_core.job.rollout_options`), one keeping fewer versions than the trainer
            samples from, router replay it cannot serve (as :func:`.router_replay.require_rollout`).
    """
    job_rollout_options(section, trainer)
    router_replay.require_rollout(section.name, section.router_replay, engine)


def job_rollout_options(section: RolloutSection, trainer: TrainerConfig) -> RolloutOptions:
    """``rollout.options`` built for ``rollout.name`` and sized for the weight versions the ``trainer``
    samples from at once (:meth:`RolloutOptions.serving_versions`, :func:`.trainer_config.versions_in_flight`)."""
    versions, why = versions_in_flight(trainer)
    return rollout_options(section.name, section.options).serving_versions(versions, why=why)


def build_rollout(section: RolloutSection, model_path: str, device: str, trainer: TrainerConfig) -> Rollout:
    """The rollout ``rollout.name`` with ``rollout.options`` (:func:`job_rollout_options`), serving
    ``model_path`` on ``device``."""
    options = job_rollout_options(section, trainer)
    rollout = create_rollout(section.name, model_path=model_path, device=device, options=options)
    require_placed(section.name)  # trainer.ray.rollout_node=other: the rollout started its server elsewhere
    return rollout
