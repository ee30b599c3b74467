"""The checkpoint-merger registrar: backend name -> class that merges that backend's checkpoints."""

from __future__ import annotations

from .._errors import PluginError
from .roles import NamedRegistry


class CheckpointMergerRegistry(NamedRegistry):
    """Checkpoint mergers by the backend whose sharded checkpoints they read."""

    kind = "checkpoint merger"
    install_hint = "pip install drivetrain-ckpt-tools"
    required_base = "drivetrain_engine_core.backend:CheckpointMerger"

    def register(self, backend: str, merger: type | str) -> None:
        """Register ``merger`` (a class or ``"module:attr"``) for checkpoints written by ``backend``.

        Raises:
            PluginError: the backend already has a merger, or ``merger`` is malformed.
        """
        if not backend:
            raise PluginError("checkpoint merger: backend must name a backend such as 'fsdp'.")
        self._add((backend,), merger)

    def get(self, backend: str) -> type:
        """The merger class for ``backend``'s checkpoints, imported on first use.

        Raises:
            PluginError: no merger for that backend (lists the registered ones), or it cannot be imported.
        """
        return self._get(backend)
