"""``trainer.placement=ray``: a job's ranks as Ray actors on an existing cluster, placed by one placement group.

``drivetrain <command> trainer.placement=ray trainer.ray.address=HOST:PORT trainer.ray.workers=N`` (every job
command: ``sft``, ``dpo``, ``rm``, ``grpo``, ``ppo``) joins the cluster
(``ray.init(address=...)``), reserves one bundle per rank (``trainer.ray.cpus_per_worker``, ``gpus_per_worker``)
in a placement group of ``trainer.ray.strategy`` (``SPREAD``: ranks on different nodes), starts one
:class:`~.ray_rank.RayRank` actor in each bundle and runs the command's own rank there, with the environment
torchrun would give it (rank 0's node hosts the rendezvous). The run folder, the checkpoints, ``--resume`` and the
numbers are the torchrun path's; the run folder must be on storage every node shares, as with ``--nnodes``. With
``trainer.ray.rollout_node=other`` each rank's rollout server (``vllm-server``) runs on another node, which the
rank reaches over TCP (:mod:`.ray_server`); a node of the servers that dies is named as a rank's is.

Every wait is bounded: a cluster that does not answer, a placement the cluster cannot make and ranks that do not
start end in one line within ``trainer.ray.timeout_s``, with nothing written. While the ranks run, the driver
polls every :data:`~.ray_ranks.POLL_S` s; a node the cluster marks dead (Ray's health checks: about 15 s by
default) is named with the ranks it ran, and every rank is stopped (exit 1; ``--resume`` continues from the last
checkpoint). The first Ctrl-C is sent on to the ranks, which stop after the current step with a checkpoint
(exit 130, as under ``--nproc``; :mod:`.ray_ctrl_c`); a second stops every rank at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from typing import Any

import click

from .launch import check_run_dir, resolve_output_dir, under_launcher
from .ray_config import RayConfig, RayPlacementError
from .ray_ranks import PlacedRanks
from .ray_server import require_other_nodes
from .run_options import RunOptions


def launch_on_ray(placement: RayConfig, config: Any, job: type, run: RunOptions) -> int:
    """Run ``job`` on ``config`` as ``placement.workers`` Ray ranks; returns the command's exit status.

    Raises:
        RayPlacementError: the options ask for another launch too, Ray is not installed, the cluster does not
            answer, or it cannot place or start the ranks within ``trainer.ray.timeout_s`` (nothing written).
    """
    _refuse_other_launches(run)
    ray = _require_ray()
    owned = connect(ray, placement)
    try:
        require_other_nodes(ray, placement, config, run.command)
        ranks = PlacedRanks.place(ray, placement, config.engine.device, run.command)
        try:
            run_dir = resolve_output_dir(run.output_dir, run.resume, run.command).resolve()
            check_run_dir(run_dir, resume=run.resume, overwrite=run.overwrite)
            click.echo(ranks.describe(), err=True)
            return ranks.run(config, job, dataclasses.replace(run, output_dir=str(run_dir)))
        finally:
            ranks.stop()
    finally:
        if owned:
            ray.shutdown()


def _refuse_other_launches(run: RunOptions) -> None:
    if under_launcher():
        raise RayPlacementError(
            "trainer.placement=ray inside a launched rank (WORLD_SIZE is set): start the command once, outside "
            "torchrun; Ray starts the ranks."
        )
    if run.nproc > 1 or run.nodes.several:
        raise RayPlacementError(
            "trainer.placement=ray places the ranks itself: drop --nproc/--nnodes and set trainer.ray.workers."
        )


def _require_ray() -> Any:
    from ..workers.actors import RAY_INSTALL_HINT

    try:
        import ray
    except ImportError as e:
        raise RayPlacementError(
            f"trainer.placement=ray needs Ray, which is not installed; run {RAY_INSTALL_HINT}."
        ) from e
    return ray


def connect(ray: Any, placement: RayConfig) -> bool:
    """Join the cluster at ``trainer.ray.address`` within ``trainer.ray.timeout_s``; ``False`` when this process
    is already connected (a Python driver's own ``ray.init``), which is then kept.

    Raises:
        RayPlacementError: nothing answers at the address, or Ray's own connection fails or does not finish in
            time.
    """
    if ray.is_initialized():
        return False
    address = placement.address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "auto")
    if address not in ("auto", "local"):
        _check_answers(address, placement.timeout_s)
    outcome: dict[str, BaseException | None] = {}

    def init() -> None:
        try:
            ray.init(address=address, logging_level=logging.ERROR)
            outcome["error"] = None
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=init, daemon=True)
    thread.start()
    thread.join(placement.timeout_s)
    if "error" not in outcome:
        raise _unreachable(
            address, f"ray.init did not finish within trainer.ray.timeout_s={placement.timeout_s:g} s"
        )
    if outcome["error"] is not None:
        raise _unreachable(address, " ".join(str(outcome["error"]).split())[:300].rstrip(".")) from outcome[
            "error"
        ]
    return True


def _check_answers(address: str, timeout_s: float) -> None:
    """Fail fast when nothing accepts a connection at ``address`` (Ray's own client retries for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RayPlacementError(
            f"trainer.ray.address={address!r} is not HOST:PORT; pass the head node's address and GCS port "
            "(e.g. 10.0.0.1:6379), or auto."
        )
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout_s, 10.0)).close()
    except OSError as e:
        raise _unreachable(address, f"nothing answers at {host}:{port} ({e})") from e


def _unreachable(address: str, reason: str) -> RayPlacementError:
    return RayPlacementError(
        f"trainer.ray.address={address}: no Ray cluster answered: {reason}. Start one (ray start --head), pass "
        "its head node's HOST:PORT, or set trainer.placement=local."
    )


__all__ = ["connect", "launch_on_ray"]
