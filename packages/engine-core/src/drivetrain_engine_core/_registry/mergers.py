"""The checkpoint-merger registrar: backend name -> class that merges that backend's checkpoints."""

from __future__ import annotations

from .roles import NamedRegistry


class CheckpointMergerRegistry(NamedRegistry):
    """Checkpoint mergers by the backend whose sharded checkpoints they read."""

    kind = "checkpoint merger"
    install_hint = "pip install drivetrain-ckpt-tools"
    required_base = "drivetrain_engine_core.backend:CheckpointMerger"
    example = "fsdp"
