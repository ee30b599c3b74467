"""The environment registrar: environment name (``http``, ``calculator``, ...) -> its
:class:`~..environment.Environment` class."""

from __future__ import annotations

from .._errors import PluginError
from .roles import NamedRegistry


class EnvironmentRegistry(NamedRegistry):
    """Environment classes by name, so an environment (a game, a sandbox, a remote service) is a separate
    install that multi-turn rollouts find as ``environment=<name>``."""

    kind = "environment"
    install_hint = "pip install drivetrain-roles (the `http` environment) or the package of the environment"
    required_base = "drivetrain_engine_core.job:Environment"

    def register(self, name: str, environment: type | str) -> None:
        """Register ``environment`` (a class or ``"module:attr"``) under ``name``.

        Raises:
            PluginError: the name is already registered, empty, or ``environment`` is malformed.
        """
        if not name:
            raise PluginError("environment: name must name an environment such as 'http'.")
        self._add((name,), environment)

    def get(self, name: str) -> type:
        """The environment class registered under ``name``, imported on first use.

        Raises:
            PluginError: no such environment (lists the registered ones), or it cannot be imported.
        """
        return self._get(name)
