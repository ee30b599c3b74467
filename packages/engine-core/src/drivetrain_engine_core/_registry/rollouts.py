"""The rollout registrar: inference backend name (``hf``, ``vllm``, ...) -> its :class:`~..rollout.Rollout` class."""

from __future__ import annotations

from .._errors import PluginError
from .roles import NamedRegistry


class RolloutRegistry(NamedRegistry):
    """Rollout (generation) backends by name, so inference engines can be separate installs."""

    kind = "rollout"
    install_hint = "pip install drivetrain-roles (the Hugging Face `hf` rollout)"
    required_base = "drivetrain_engine_core.rollout:Rollout"

    def register(self, name: str, rollout: type | str) -> None:
        """Register ``rollout`` (a class or ``"module:attr"``) under ``name``.

        Raises:
            PluginError: the name is already registered, empty, or ``rollout`` is malformed.
        """
        if not name:
            raise PluginError("rollout: name must name a backend such as 'hf'.")
        self._add((name,), rollout)

    def get(self, name: str) -> type:
        """The rollout class registered under ``name``, imported on first use.

        Raises:
            PluginError: no such rollout (lists the registered ones), or it cannot be imported.
        """
        return self._get(name)

    def provider(self, name: str) -> str:
        """Who registered the rollout ``name`` (``drivetrain-rollout-vllm 0.2.0``), for messages; ``unknown``
        when nothing is registered under it."""
        registration = self._lookup((name,))
        return registration.source.describe() if registration is not None else "unknown"
