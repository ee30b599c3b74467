"""``trainer.placement`` and ``trainer.ray``: where a job's ranks run, in this launch or on an existing Ray cluster.

``trainer.placement=ray`` runs the job's ranks as Ray actors of a cluster that is already up (``ray start``, a
Ray cluster YAML, Ray on Slurm, SkyPilot), placed by one placement group (:mod:`.ray_launch`); the run itself
is the torchrun path's, rank for rank. Importing this module does not import Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.backend import ConfigError, DrivetrainError

from ..losses.names import choose

PLACEMENTS = ("local", "ray")
"""``trainer.placement``'s values: ranks started by this command (``--nproc``, ``--nnodes``) or by Ray."""
STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
"""Ray's placement-group strategies; ``trainer.ray.strategy`` takes them in any case (``spread``)."""
ROLLOUT_NODES = ("same", "other")
"""``trainer.ray.rollout_node``'s values: each rank's rollout server beside the rank, or on another node."""


class RayPlacementError(DrivetrainError):
    """The Ray cluster cannot run the job as placed; the message names the setting and the fix."""


@dataclass(kw_only=True, frozen=True)
class RayConfig:
    """How ``trainer.placement=ray`` places the ranks (read only then).

    Attributes:
        address: the cluster to join: ``auto`` (``RAY_ADDRESS``, else the cluster this node runs), or the head's
            ``HOST:PORT`` (the GCS port, 6379 by default).
        workers: ranks of the job (the torch.distributed world), one Ray actor each.
        cpus_per_worker: Ray CPUs each rank reserves.
        gpus_per_worker: Ray GPUs each rank reserves; default 1 with ``engine.device=cuda``, else 0.
        strategy: the placement group's strategy, in any case: ``SPREAD`` (ranks on as many nodes as possible),
            ``PACK`` (as few: suits nodes of several GPUs), or the ``STRICT_`` forms, which wait rather than bend.
        timeout_s: the bound on joining the cluster, placing the ranks and starting them (and their rollout
            servers); and, after a rank failed, on learning whether a node was lost (Ray marks a node dead after
            its health checks fail).
        rollout_node: where each rank's rollout server runs, for a rollout that runs one (``vllm-server``):
            ``same`` (the rank's node: a child process on a Unix socket) or ``other`` (another node of the
            cluster, nodes without ranks first: a Ray actor there reserving a rank's CPUs and GPUs starts it,
            and the rank connects over TCP, authenticated by the run's key; ``grpo`` and ``ppo`` only).
    """

    address: str = "auto"
    workers: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None
    strategy: str = "SPREAD"
    timeout_s: float = 60.0
    rollout_node: str = "same"

    def __post_init__(self) -> None:
        if not self.address.strip():
            raise ConfigError("trainer.ray.address is empty; pass auto or the head node's HOST:PORT.")
        if self.workers < 1:
            raise ConfigError(f"trainer.ray.workers must be >= 1, got {self.workers}.")
        if not self.cpus_per_worker >= 0:
            raise ConfigError(f"trainer.ray.cpus_per_worker must be >= 0, got {self.cpus_per_worker}.")
        if self.gpus_per_worker is not None and not self.gpus_per_worker >= 0:
            raise ConfigError(f"trainer.ray.gpus_per_worker must be >= 0, got {self.gpus_per_worker}.")
        if not self.timeout_s > 0:
            raise ConfigError(f"trainer.ray.timeout_s must be > 0, got {self.timeout_s}.")
        object.__setattr__(self, "strategy", self.strategy.upper())  # Ray's own spelling, whatever was typed
        for option, known in (("strategy", STRATEGIES), ("rollout_node", ROLLOUT_NODES)):
            try:
                choose(option, getattr(self, option), known)
            except ConfigError as e:
                raise ConfigError(f"trainer.ray.{e}") from e

    def bundle(self, device: str) -> dict[str, float]:
        """What one rank reserves on its node: ``{"CPU": ..., "GPU": ...}`` (no GPU key for none)."""
        gpus = self.gpus_per_worker if self.gpus_per_worker is not None else float(device == "cuda")
        return {"CPU": self.cpus_per_worker, **({"GPU": gpus} if gpus else {})}


def choose_placement(placement: str, ray: RayConfig) -> None:
    """Refuse an unknown ``trainer.placement``, naming the known ones and the closest, and a rollout server on
    another node without Ray's placement.

    Raises:
        ConfigError: naming the setting and the fix.
    """
    try:
        choose("placement", placement, PLACEMENTS)
    except ConfigError as e:
        raise ConfigError(f"trainer.{e}") from e
    if ray.rollout_node == "other" and placement != "ray":
        raise ConfigError(
            f"trainer.ray.rollout_node=other starts each rank's rollout server on another Ray node, which needs "
            f"the ranks on a Ray cluster, and trainer.placement={placement}; set trainer.placement=ray (and "
            "trainer.ray.address), or drop trainer.ray.rollout_node."
        )


def ray_placement(config: Any) -> RayConfig | None:
    """``config.trainer.ray`` when ``config.trainer.placement`` is ``ray``; ``None`` for ``local`` and for a
    command whose ``trainer`` section has no placement."""
    trainer = config.trainer
    if getattr(trainer, "placement", "local") != "ray":
        return None
    ray: RayConfig = trainer.ray
    return ray


__all__ = [
    "PLACEMENTS",
    "ROLLOUT_NODES",
    "STRATEGIES",
    "RayConfig",
    "RayPlacementError",
    "choose_placement",
    "ray_placement",
]
