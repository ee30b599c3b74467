"""The ranks of ``trainer.placement=ray`` in their placement group, and the driver's watch over them.

:class:`PlacedRanks` reserves one bundle per rank and starts a :class:`~.ray_rank.RayRank` actor in each, gives
each rank torchrun's environment and runs them; :class:`RunWatch` waits for them, polling their nodes, and says
how the run ended (:mod:`.ray_launch` joins the cluster and drives both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter
from typing import Any

import click
from drivetrain_engine_core.job import INTERRUPTED

from .interrupt import send_ctrl_c
from .nodes import NODE_RANK_ENV, TIMEOUT_ENV
from .ray_config import RayConfig, RayPlacementError
from .ray_ctrl_c import DriverCtrlC
from .ray_rank import RankCrashed, RankFailed, RankInterrupted, RayRank
from .ray_server import server_environment, server_nodes
from .run_options import RunOptions

POLL_S = 1.0
"""How often the driver checks that the ranks' nodes are alive while it waits for them."""


@dataclasses.dataclass
class PlacedRanks:
    """The ranks' actors in their placement group, the Ray node (id, IP) each runs on, each one's inbox folder
    there (:mod:`.ray_ctrl_c`) and, with ``trainer.ray.rollout_node=other``, the node each one's rollout server
    goes to (:mod:`.ray_server`), in rank order."""

    ray: Any
    placement: RayConfig
    command: str
    group: Any
    actors: list[Any]
    nodes: list[tuple[str, str]]
    gpus: bool
    device: str
    inboxes: list[str] = dataclasses.field(default_factory=list)
    servers: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @classmethod
    def place(cls, ray: Any, placement: RayConfig, device: str, command: str) -> PlacedRanks:
        """Reserve the bundles and start one actor in each.

        Raises:
            RayPlacementError: the cluster cannot place the bundles, or a rank does not start, in time (names
                what was asked and what the cluster has).
        """
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = placement.bundle(device)
        group = placement_group([dict(bundle)] * placement.workers, strategy=placement.strategy)
        ranks = cls(ray, placement, command, group, [], [], "GPU" in bundle, device)
        try:
            if not ray.wait([group.ready()], timeout=placement.timeout_s)[0]:
                raise RayPlacementError(ranks._unplaceable(bundle))
            actor = ray.remote(RayRank)
            for index in range(placement.workers):
                strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
                options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), "max_restarts": 0}
                ranks.actors.append(actor.options(scheduling_strategy=strategy, **options).remote())
            places = ranks._wait([a.where.remote() for a in ranks.actors], "start")
            ranks.nodes = [(node, ip) for node, ip, _ in places]
            ranks.inboxes = [inbox for _, _, inbox in places]
            if placement.rollout_node == "other":
                alive = [(n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")]
                ranks.servers = server_nodes(ranks.nodes, alive)
        except BaseException:
            ranks.stop()
            raise
        return ranks

    def _unplaceable(self, bundle: dict[str, float]) -> str:
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        have = {k: v for k, v in self.ray.cluster_resources().items() if k in ("CPU", "GPU")}
        p = self.placement
        return (
            f"the Ray cluster could not place trainer.ray.workers={p.workers} ranks of {bundle} each with "
            f"trainer.ray.strategy={p.strategy} within trainer.ray.timeout_s={p.timeout_s:g} s; it has "
            f"{len(alive)} alive node(s) and {have} in all. Lower trainer.ray.workers or the per-worker "
            "resources, choose a strategy that is not STRICT_, or add nodes."
        )

    def _wait(self, refs: list[Any], what: str) -> list[Any]:
        _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=self.placement.timeout_s)
        if pending:
            late = [refs.index(ref) for ref in pending]
            raise RayPlacementError(
                f"ranks {late} did not {what} within trainer.ray.timeout_s={self.placement.timeout_s:g} s; check "
                "that every node of the cluster has drivetrain installed (ray status, the Ray logs)."
            )
        try:
            return list(self.ray.get(refs))
        except self.ray.exceptions.RayError as e:  # an actor that died starting, or failed to import
            raise RayPlacementError(
                f"a rank did not {what}: {' '.join(str(e).split())[:300]}. Check that every node of the cluster "
                "has drivetrain installed (ray status, the Ray logs)."
            ) from e

    def describe(self) -> str:
        """One line: the node (id, IP) of each rank (and of its rollout server, placed on another)."""
        ranks = ", ".join(f"rank {r} on node {node[:12]} ({ip})" for r, (node, ip) in enumerate(self.nodes))
        servers = "".join(
            f"; rank {r}'s rollout server to node {node[:12]} ({ip})"
            for r, (node, ip) in enumerate(self.servers)
        )
        return (
            f"drivetrain {self.command}: {len(self.nodes)} ranks placed by Ray ({self.placement.strategy}): "
            f"{ranks}{servers}"
        )

    def environments(self, master: tuple[str, int]) -> list[dict[str, str]]:
        """Each rank's torchrun environment: its rank, its node's place and local rank, rank 0's rendezvous."""
        node_ids = list(dict.fromkeys(node for node, _ in self.nodes))
        per_node = Counter(node for node, _ in self.nodes)
        seen: Counter[str] = Counter()
        environments = []
        for rank, (node, _) in enumerate(self.nodes):
            local = seen[node]
            seen[node] += 1
            environments.append(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(len(self.nodes)),
                    # Ray shows each GPU rank only its own GPU, which is device 0 inside the actor.
                    "LOCAL_RANK": "0" if self.gpus else str(local),
                    "LOCAL_WORLD_SIZE": str(per_node[node]),
                    "GROUP_RANK": str(node_ids.index(node)),
                    NODE_RANK_ENV: str(node_ids.index(node)),  # the node its messages name
                    "MASTER_ADDR": master[0],
                    "MASTER_PORT": str(master[1]),
                    TIMEOUT_ENV: str(int(self.placement.timeout_s)),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    **(
                        server_environment(self.servers[rank], self.placement, self.device)
                        if self.servers
                        else {}
                    ),
                }
            )
        return environments

    def run(self, config: Any, job: type, run: RunOptions) -> int:
        """Run every rank; returns 0 (rank 0's closing lines printed), 1 (one line printed for the failure)
        or 130 (Ctrl-C: the ranks stopped after a step and saved it, or, pressed twice or outside the step loop,
        at once)."""
        master = (self.nodes[0][1], self._wait([self.actors[0].free_port.remote()], "pick a port")[0])
        refs = [
            actor.run.remote(self.command, config, job, run, environment)
            for actor, environment in zip(self.actors, self.environments(master), strict=True)
        ]
        ctrl_c = DriverCtrlC(self.command)
        try:
            with ctrl_c.handled():
                outcome = RunWatch(self, refs, str(run.output_dir), ctrl_c).outcome()
        except KeyboardInterrupt:
            click.echo(f"drivetrain {self.command}: interrupted; every rank was stopped.", err=True)
            return INTERRUPTED
        click.echo(outcome.text, err=outcome.status != 0)
        return outcome.status

    def send_ctrl_c(self) -> bool:
        """Send Ctrl-C to every rank in its step loop, by one Ray task on each rank's node; whether one took it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        send = self.ray.remote(num_cpus=0, max_retries=0)(send_ctrl_c)
        refs = [
            send.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(inbox)
            for (node, _), inbox in zip(self.nodes, self.inboxes, strict=True)
        ]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.placement.timeout_s)
        taken = []
        for ref in ready:
            with contextlib.suppress(
                self.ray.exceptions.RayError
            ):  # a node gone meanwhile: the watch names it
                taken.append(self.ray.get(ref))
        return any(taken)

    def lost_node(self, run_dir: str) -> str | None:
        """The line naming a node of the ranks (or of their rollout servers) that the cluster lists as dead, or
        ``None``."""
        alive = {n["NodeID"]: n.get("Alive", False) for n in self.ray.nodes()}
        for node, ip in dict.fromkeys([*self.nodes, *self.servers]):
            if not alive.get(node, False):
                ranks = [r for r, (n, _) in enumerate(self.nodes) if n == node]
                servers = [r for r, (n, _) in enumerate(self.servers) if n == node]
                ran = ((f"ranks {ranks}", ranks), (f"the rollout servers of ranks {servers}", servers))
                running = " and ".join(what for what, on in ran if on)
                return (
                    f"drivetrain {self.command}: Ray node {node} ({ip}) died while running {running}; every "
                    f"rank was stopped. Continue from the last checkpoint with --resume --output-dir {run_dir} "
                    "once the cluster has the nodes again."
                )
        return None

    def stop(self) -> None:
        """Kill every rank's actor and free the placement group (best effort: a node may be gone)."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)
        self.actors = []


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the run ended: the exit status and the text to print."""

    status: int
    text: str


class RunWatch:
    """Waits for the ranks of a run, polling their nodes, and says how the run ended.

    A user error ends the wait at once (every rank agrees on it). A crash or a dead actor may be what a lost node
    left behind (a peer's broken connection comes first), so the watch waits up to ``trainer.ray.timeout_s`` for
    the other ranks or for the cluster to mark the node dead, and names the node when it does.
    """

    def __init__(self, ranks: PlacedRanks, refs: list[Any], run_dir: str, ctrl_c: DriverCtrlC) -> None:
        self.ranks, self.ray, self.run_dir, self.ctrl_c = ranks, ranks.ray, run_dir, ctrl_c
        self.rank_of = {ref: rank for rank, ref in enumerate(refs)}
        self.pending = list(refs)
        self.results: dict[int, Any] = {}
        self.failures: list[str] = []
        self.interrupted: dict[int, str] = {}
        self.actor_died = False

    def outcome(self) -> Outcome:
        settle_by = float("inf")
        while self.pending or (self.actor_died and time.monotonic() < settle_by):
            self.ctrl_c.forward(self.ranks.send_ctrl_c)
            lost = self.ranks.lost_node(self.run_dir)
            if lost is not None:
                return Outcome(1, lost)
            if time.monotonic() >= settle_by:
                break
            ready, self.pending = self._wait_one()
            for ref in ready:
                user_error = self._collect(ref)
                if user_error is not None:
                    return Outcome(1, user_error)
            if self.failures and settle_by == float("inf"):
                settle_by = time.monotonic() + self.ranks.placement.timeout_s
        if self.failures:
            return Outcome(1, self.ranks.lost_node(self.run_dir) or self.failures[0])
        if self.interrupted:  # every rank stopped after the same step and saved it
            return Outcome(INTERRUPTED, self.interrupted[min(self.interrupted)])
        return Outcome(0, self.results.get(0) or "")

    def _wait_one(self) -> tuple[list[Any], list[Any]]:
        if not self.pending:  # every rank ended; a dead actor's node may not be marked dead yet
            time.sleep(POLL_S)
            return [], []
        ready, pending = self.ray.wait(self.pending, num_returns=1, timeout=POLL_S)
        return list(ready), list(pending)

    def _collect(self, ref: Any) -> str | None:
        """Note one finished rank: its result, or its failure; returns a user error's line."""
        rank = self.rank_of[ref]
        try:
            self.results[rank] = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as e:
            cause = e.cause
            if isinstance(cause, RankInterrupted):  # the others are saving the same step: wait for them
                self.interrupted[rank] = str(cause)
            elif isinstance(cause, RankFailed) and not isinstance(cause, RankCrashed):
                return str(cause)
            else:
                self.failures.append(str(cause) if isinstance(cause, RankFailed) else f"rank {rank}: {e}")
        except self.ray.exceptions.RayActorError as e:
            detail = " ".join(str(e).split())[:300]
            self.failures.append(f"drivetrain {self.ranks.command}: rank {rank}'s Ray actor died: {detail}")
            self.actor_died = True
        return None


__all__ = ["POLL_S", "Outcome", "PlacedRanks", "RunWatch"]
