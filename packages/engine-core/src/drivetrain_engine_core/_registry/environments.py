"""The environment registrar: environment name (``http``, ``calculator``, ...) -> its
:class:`~..environment.Environment` class."""

from __future__ import annotations

from .roles import NamedRegistry


class EnvironmentRegistry(NamedRegistry):
    """Environment classes by name, so an environment (a game, a sandbox, a remote service) is a separate
    install that multi-turn rollouts find as ``environment=<name>``."""

    kind = "environment"
    install_hint = "pip install drivetrain-roles (the `http` environment) or the package of the environment"
    required_base = "drivetrain_engine_core.job:Environment"
    example = "http"
