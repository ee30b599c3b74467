"""What every worker of a group builds: one engine from typed configs and one registered role around it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.backend import EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import CheckpointConfig


@dataclass(kw_only=True, frozen=True)
class WorkerSpec:
    """The role and engine each worker of a :class:`~.group.RayWorkerGroup` builds.

    Attributes:
        role: a role name in core's role registry (``actor``, ``critic``, ``reference``, or a plugin's).
        model_config: the model, passed to core's ``create_engine``.
        engine_config: the backend's engine config; its ``device`` picks the collective backend (gloo on
            CPU, nccl on CUDA).
        optimizer_config: ``None`` builds an inference-only engine (e.g. for the reference).
        checkpoint_config: checkpoint contents and retention.
        role_config: the role's own config (e.g. ``ActorConfig``), passed as its second argument, or a mapping
            of keyword arguments (e.g. ``{"temperature": 0.8}`` for ``Reference``); ``None`` uses the role's
            defaults.
        cpu_threads: torch intra-op threads per worker on CPU (1 avoids oversubscribing shared cores);
            ``None`` keeps torch's default.
        timeout_s: the process-group timeout, so a dead peer fails collectives instead of hanging them.
    """

    role: str
    model_config: ModelConfig
    engine_config: EngineConfig
    optimizer_config: OptimizerConfig | None = None
    checkpoint_config: CheckpointConfig | None = None
    role_config: Any = None
    cpu_threads: int | None = 1
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.role:
            raise ValueError("WorkerSpec.role is empty; name a registered role such as 'actor'.")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"WorkerSpec.cpu_threads must be >= 1 or None, got {self.cpu_threads}.")
        if not self.timeout_s > 0:
            raise ValueError(f"WorkerSpec.timeout_s must be > 0, got {self.timeout_s}.")

    @property
    def device(self) -> str:
        """The device type the engine runs on (``engine_config.device``)."""
        return self.engine_config.device

    @property
    def label(self) -> str:
        """What the group builds from this spec, for messages."""
        return f"role {self.role!r}"
