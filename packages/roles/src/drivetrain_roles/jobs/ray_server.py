"""``trainer.ray.rollout_node=other``: each rank's rollout server on another node of the Ray cluster.

The driver picks, for each rank, an alive node other than the rank's own (:func:`server_nodes`: nodes that run no
rank first) and hands the rank two variables (:func:`server_environment`): :data:`LAUNCHER_ENV`, which names
:func:`start_on_node` as the function a rollout that runs a server process (``vllm-server``) starts it through,
and :data:`PLACE_ENV`, where and with what. :func:`start_on_node` starts a :class:`ServerHost` actor on that node
(node affinity, not soft), which runs the rollout's command there, listening on TCP at the node's IP
(``command.start(host=ip)``), and returns a :class:`RemoteServer`: the handle the rollout asks (alive? where to
connect? the log's last lines?), each question one bounded Ray call to the actor. The command is the rollout's
plain data and the handle's methods are the whole contract, so this module knows nothing of vLLM and the
rollout nothing of Ray.

A node that dies takes the actor with it: the handle's ``poll`` then reports the server gone, so the rollout's
watch names it within about a second of Ray's noticing (:data:`POLL_S` bounds a call to a node that went
silent), and the driver's watch names the node (:meth:`.ray_ranks.PlacedRanks.lost_node`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import ConfigError

from .ray_config import RayConfig, RayPlacementError

LAUNCHER_ENV = "DRIVETRAIN_SERVER_LAUNCHER"
"""The variable a server-running rollout reads for the function that starts its server elsewhere."""
LAUNCHER = f"{__name__}:start_on_node"
PLACE_ENV = "DRIVETRAIN_RAY_SERVER_PLACE"
"""Where a rank's server goes: ``{"node": id, "ip": ..., "bundle": {...}, "timeout_s": ...}`` (JSON)."""
POLL_S = 10.0
"""The bound on one call to the server's actor; a call that takes longer counts as unanswered, not as lost."""
LOST = -signal.SIGKILL
"""The exit code a server whose actor is gone reports (its node died, or Ray killed it)."""

_started: list[str] = []
"""The nodes :func:`start_on_node` started servers on in this process (a rank's), for :func:`require_placed`."""


def server_nodes(ranks: list[tuple[str, str]], alive: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """For each rank's ``(node id, IP)``, the node its server goes to: an alive node other than the rank's,
    nodes that run no rank first, in turn."""
    with_ranks = {node for node, _ in ranks}
    free = [n for n in alive if n[0] not in with_ranks]
    chosen = []
    for index, (node, _) in enumerate(ranks):
        others = free or [n for n in alive if n[0] != node]
        chosen.append(others[index % len(others)])
    return chosen


def require_other_nodes(ray: Any, placement: RayConfig, config: Any, command: str) -> None:
    """Refuse ``rollout_node=other`` for a command without a rollout, or on a cluster of one alive node, before
    anything is placed.

    Raises:
        RayPlacementError: naming what is missing and the fix.
    """
    if placement.rollout_node != "other":
        return
    if not hasattr(config, "rollout"):
        raise RayPlacementError(
            f"trainer.ray.rollout_node=other places rollout servers, and drivetrain {command} samples no rollout; "
            "drop trainer.ray.rollout_node (grpo and ppo take it)."
        )
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) < 2:
        raise RayPlacementError(
            f"trainer.ray.rollout_node=other starts each rank's rollout server on another Ray node, and the "
            f"cluster has {len(alive)} alive node(s); add a node (ray start --address=HEAD:PORT on another "
            "machine), or set trainer.ray.rollout_node=same to run the servers beside their ranks."
        )


def server_environment(node: tuple[str, str], placement: RayConfig, device: str) -> dict[str, str]:
    """The variables that make a rank start its rollout server on ``node`` (id, IP)."""
    place = {
        "node": node[0],
        "ip": node[1],
        "bundle": placement.bundle(device),
        "timeout_s": placement.timeout_s,
    }
    return {LAUNCHER_ENV: LAUNCHER, PLACE_ENV: json.dumps(place)}


def require_placed(rollout: str) -> None:
    """Refuse, once the rank built its rollout, a rollout that started no server through :func:`start_on_node`
    where ``trainer.ray.rollout_node=other`` asked for one (it would sample on the rank's node unnoticed).

    Raises:
        ConfigError: naming the rollout and the fix.
    """
    if PLACE_ENV in os.environ and not _started:
        raise ConfigError(
            f"trainer.ray.rollout_node=other places each rank's rollout server on another node, and rollout "
            f"{rollout!r} runs no server process (it samples in the rank); set rollout.name=vllm-server, or "
            "trainer.ray.rollout_node=same."
        )


class ServerHost:
    """The actor on the server's node: runs the rollout's server command there and answers for its handle.
    Plain Python; :func:`start_on_node` wraps it with ``ray.remote``."""

    def __init__(self) -> None:
        self.server: Any = None

    def start(self, command: Any) -> tuple[int, str, str, str]:
        """Start ``command`` listening on TCP at this node's IP; returns ``(pid, log, node id, IP)``."""
        import ray

        node, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        self.server = command.start(host=ip)
        return self.server.pid, str(self.server.log), node, ip

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the server's handle here (``poll``, ``kill``, ``address``, ``log_tail``, ``dispose``)."""
        return getattr(self.server, method)(*args, **kwargs)


def start_on_node(command: Any) -> RemoteServer:
    """Start the rollout's server ``command`` on the node :data:`PLACE_ENV` names, in an actor that reserves a
    rank's resources there; returns its handle.

    Raises:
        RayPlacementError: the actor did not start there within ``trainer.ray.timeout_s`` (the node lacks the
            resources, or died), naming the node, the resources and the fixes.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    place = json.loads(os.environ[PLACE_ENV])
    bundle, timeout_s = place["bundle"], place["timeout_s"]
    host: Any = ray.remote(ServerHost)  # an actor class (Ray's stubs type it as the plain class)
    actor = host.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(place["node"], soft=False),
        num_cpus=bundle["CPU"],
        num_gpus=bundle.get("GPU", 0),
        max_restarts=0,
    ).remote()
    try:
        started = ray.get(actor.start.remote(command), timeout=timeout_s)
    except ray.exceptions.RayError as e:
        ray.kill(actor, no_restart=True)
        why = (
            f"did not start within trainer.ray.timeout_s={timeout_s:g} s"
            if isinstance(e, ray.exceptions.GetTimeoutError)
            else f"failed: {' '.join(str(e).split())[:300]}"
        )
        raise RayPlacementError(
            f"the rollout server's Ray actor on node {place['node']} ({place['ip']}), reserving {bundle}, {why}; "
            "free those resources on another node than the rank's (or add one), raise trainer.ray.timeout_s, or "
            "set trainer.ray.rollout_node=same."
        ) from e
    server = RemoteServer(ray, actor, *started)
    _started.append(server.node)
    print(
        f"drivetrain: rank {os.environ.get('RANK', '0')}'s rollout server runs on Ray node {server.node} "
        f"({server.ip}), pid {server.pid}",
        file=sys.stderr,
        flush=True,
    )
    return server


class RemoteServer:
    """The handle of a server a :class:`ServerHost` actor runs on another node, as the rollout asks it."""

    def __init__(self, ray: Any, actor: Any, pid: int, log: str, node: str, ip: str) -> None:
        self.ray, self.actor, self.pid, self.node, self.ip = ray, actor, pid, node, ip
        self.log = Path(log)  # on the server's node
        self.returncode: int | None = None
        self.lost: str | None = None
        """Why the actor is gone (Ray's words), once a call found it so."""

    @property
    def where(self) -> str:
        place = f"pid {self.pid} on Ray node {self.node[:12]} ({self.ip})"
        return place if self.lost is None else f"{place}, whose Ray actor is gone: {self.lost}"

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.ray.get(self.actor.call.remote(method, *args, **kwargs), timeout=POLL_S)

    def poll(self) -> int | None:
        """The exit code, :data:`LOST` once the actor is gone; None while it runs or does not answer in time."""
        if self.returncode is not None:
            return self.returncode
        try:
            self.returncode = self._call("poll")
        except (self.ray.exceptions.GetTimeoutError, self.ray.exceptions.ActorUnavailableError):
            return None  # a node gone silent: Ray's health checks decide, and a later poll learns it
        except self.ray.exceptions.RayError as e:
            self.lost, self.returncode = _first_sentence(e), LOST
        return self.returncode

    def kill(self) -> None:
        """Kill the server there; where its actor does not answer, end the actor and count the server lost (so
        that a wait after the kill ends)."""
        if self.poll() is not None:
            return
        try:
            self._call("kill")
        except self.ray.exceptions.RayError as e:
            self.ray.kill(self.actor, no_restart=True)  # the server's process ends with its trainer's socket
            self.lost, self.returncode = f"stopped unanswered ({_first_sentence(e)})", LOST

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the server exits or its actor is gone (``subprocess.TimeoutExpired`` after
        ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"the rollout server ({self.where})", timeout or 0.0)
            time.sleep(0.2)
        return code

    def address(self) -> Any:
        try:
            return self._call("address")
        except self.ray.exceptions.RayError:
            return None  # poll names what happened

    def log_tail(self) -> str:
        try:
            return str(self._call("log_tail"))
        except self.ray.exceptions.RayError as e:
            return f"(out of reach on Ray node {self.node} ({self.ip}): {_first_sentence(e)})\n"

    def dispose(self, *, keep_log: bool) -> None:
        """Remove the server's folder there (unless ``keep_log``) and end its actor."""
        # The node or the actor gone: nothing to remove.
        with contextlib.suppress(self.ray.exceptions.RayError):
            self._call("dispose", keep_log=keep_log)
        with contextlib.suppress(Exception):  # Ray itself may be shutting down (the trainer's exit)
            self.ray.kill(self.actor, no_restart=True)


def _first_sentence(error: Exception) -> str:
    """Ray's error's first sentence, on one line (its message runs on with ids and advice)."""
    return " ".join(str(error).split()).split(". ")[0].rstrip(".")[:300]


__all__ = [
    "LAUNCHER_ENV",
    "PLACE_ENV",
    "RemoteServer",
    "ServerHost",
    "require_other_nodes",
    "require_placed",
    "server_environment",
    "server_nodes",
    "start_on_node",
]
