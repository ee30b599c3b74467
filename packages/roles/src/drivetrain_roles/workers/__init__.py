"""Ray worker groups of drivetrain-roles: run a role (or several colocated parts and a rollout) on N Ray actors
and dispatch global batches over them; or rollouts on workers of their own, fed by a trainer group.

Importing this package does not import Ray; creating a :class:`RayWorkerGroup` does (``pip install
'drivetrain-roles[ray]'``). :class:`DispatchPlan` (shard/gather) works without Ray.
"""

from __future__ import annotations

from .actors import cluster_shortfall
from .colocated import ColocatedSpec, ColocatedWorker, RolloutSpec
from .colocated_group import ColocatedWorkerGroup
from .dispatch import DispatchPlan, WorkerTopology, check_topology
from .group import RayWorkerGroup, WorkerGroupError, require_ray
from .rollout_group import RolloutGroupSpec, RolloutWorker, RolloutWorkerGroup
from .spec import WorkerSpec
from .worker import RoleWorker

__all__ = [
    "ColocatedSpec",
    "ColocatedWorker",
    "ColocatedWorkerGroup",
    "DispatchPlan",
    "RayWorkerGroup",
    "RoleWorker",
    "RolloutGroupSpec",
    "RolloutSpec",
    "RolloutWorker",
    "RolloutWorkerGroup",
    "WorkerGroupError",
    "WorkerSpec",
    "WorkerTopology",
    "check_topology",
    "cluster_shortfall",
    "require_ray",
]
