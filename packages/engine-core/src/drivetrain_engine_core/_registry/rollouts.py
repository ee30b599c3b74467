"""The rollout registrar: inference backend name (``hf``, ``vllm``, ...) -> its :class:`~..rollout.Rollout` class."""

from __future__ import annotations

from .roles import NamedRegistry


class RolloutRegistry(NamedRegistry):
    """Rollout (generation) backends by name, so inference engines can be separate installs."""

    kind = "rollout"
    install_hint = "pip install drivetrain-roles (the Hugging Face `hf` rollout)"
    required_base = "drivetrain_engine_core.rollout:Rollout"
    example = "hf"

    def provider(self, name: str) -> str:
        """Who registered the rollout ``name`` (``drivetrain-rollout-vllm 0.2.0``), for messages; ``unknown``
        when nothing is registered under it."""
        registration = self._lookup((name,))
        return registration.source.describe() if registration is not None else "unknown"
