"""Ray worker group of drivetrain-roles: run a role on N Ray actors and dispatch global batches over them.

Importing this package does not import Ray; creating a :class:`RayWorkerGroup` does (``pip install
'drivetrain-roles[ray]'``). :class:`DispatchPlan` (shard/gather) works without Ray.
"""

from __future__ import annotations

from .dispatch import DispatchPlan, WorkerTopology, check_topology
from .group import RayWorkerGroup, WorkerGroupError, require_ray
from .spec import WorkerSpec
from .worker import RoleWorker

__all__ = [
    "DispatchPlan",
    "RayWorkerGroup",
    "RoleWorker",
    "WorkerGroupError",
    "WorkerSpec",
    "WorkerTopology",
    "check_topology",
    "require_ray",
]
