"""Where a launch's ranks meet: one node (a private rendezvous on a free local port), or several, as torchrun does.

``drivetrain <command> --nnodes 2 --node-rank R --nproc N --rdzv-endpoint HOST:PORT --output-dir DIR`` on each
node launches ``N`` ranks there through torch's elastic launcher with a c10d rendezvous at ``HOST:PORT``: node
rank 0 hosts the rendezvous store (``HOST`` must reach it), the others join it; global ranks are assigned by the
rendezvous. Every wait is bounded by ``--rdzv-timeout`` (the rendezvous, reaching its store, rank 0's check that
the run folder is shared: :mod:`.shared_folder`), so a node that never comes, an endpoint nobody answers or
nodes started with different ``--nnodes`` end in one error on every node, not a wait of torch's 15 minutes.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

import click

DEFAULT_TIMEOUT_S = 60
_HOST_GRACE_S = 5
TIMEOUT_ENV = "DRIVETRAIN_RDZV_TIMEOUT_S"
"""Set by the launcher for its ranks from ``--rdzv-timeout``: how long rank 0 waits to see every rank's marker in
the run folder (:mod:`.shared_folder`; 60 s under an outer launcher)."""
NODE_RANK_ENV = "DRIVETRAIN_NODE_RANK"
"""Set by the launcher for its ranks from ``--node-rank`` (by ``trainer.placement=ray``: the node's place among the
ranks' nodes): the node a rank's messages name. torch's ``GROUP_RANK`` numbers the nodes in the rendezvous's own
order (by host name, then process id), not by ``--node-rank``."""
RUN_ID = "drivetrain-{command}-{nnodes}n"
"""The rendezvous id of a launch over several nodes: the same on every node without being passed (the endpoint
names the launch); the node count in it keeps nodes started with different ``--nnodes`` apart, so they fail
with the rendezvous timeout instead of forming a world of the wrong size."""


@dataclass(kw_only=True, frozen=True)
class Nodes:
    """The nodes of a launch, as the command line gave them.

    Attributes:
        nnodes: how many nodes take part (each runs ``drivetrain <command>`` with the same flags).
        node_rank: this node's place, ``0 <= node_rank < nnodes``; node 0 hosts the rendezvous store.
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous (node 0's address); required with several nodes.
        rdzv_timeout_s: the bound on every wait of the launch before the ranks train.

    Raises:
        click.UsageError: a node rank outside ``[0, nnodes)``, several nodes without an endpoint, or a timeout
            below one second.
    """

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_timeout_s: int = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise click.UsageError(
                f"--node-rank {self.node_rank} with --nnodes {self.nnodes}: give each node a rank from 0 to "
                f"{self.nnodes - 1}."
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise click.UsageError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node: node 0's "
                "address, where it hosts the rendezvous, and a free port (e.g. --rdzv-endpoint node0:29400)."
            )
        if self.rdzv_timeout_s < 1:
            raise click.UsageError(f"--rdzv-timeout {self.rdzv_timeout_s}: give at least 1 second.")

    @property
    def several(self) -> bool:
        return self.nnodes > 1

    def launch_config(self, command: str, nproc: int, run_id: str, signals: str) -> Any:
        """torch's ``LaunchConfig`` for this node's ``nproc`` ranks (one node: a private rendezvous)."""
        from torch.distributed.launcher.api import LaunchConfig

        timeout = self.rdzv_timeout_s
        # NOTE: the node hosting the store waits a little longer, so that a joining node that gives up leaves
        # first: one that sees the store close under it prints torch's C++ warning with a stack per attempt.
        join = timeout + _HOST_GRACE_S if self.several and self.node_rank == 0 else timeout
        return LaunchConfig(
            min_nodes=self.nnodes,
            max_nodes=self.nnodes,
            nproc_per_node=nproc,
            run_id=RUN_ID.format(command=command, nnodes=self.nnodes) if self.several else run_id,
            rdzv_backend="c10d",
            rdzv_endpoint=self.rdzv_endpoint or "localhost:0",
            rdzv_timeout=timeout,
            rdzv_configs={
                "join_timeout": join,
                "read_timeout": timeout,
                "last_call_timeout": 1,
                **({"is_host": self.node_rank == 0} if self.several else {}),
            },
            max_restarts=0,
            signals_to_handle=signals,
        )

    def unreachable(self, command: str) -> str | None:
        """A node other than 0: the one line when node 0's rendezvous store never accepted a connection within
        the timeout, else None (it did, or this node hosts it).

        NOTE: checked here, before torch's launcher, which would print two pages of C++ stack per attempt to
        connect (its c10d logging, set when torch is imported) before its own error.
        """
        if not self.several or self.node_rank == 0 or self.rdzv_endpoint is None:
            return None
        host, _, port = self.rdzv_endpoint.rpartition(":")
        deadline = time.monotonic() + self.rdzv_timeout_s
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return None
            except (OSError, ValueError) as e:
                error = e
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        return (
            f"drivetrain {command}: error: node {self.node_rank} of {self.nnodes} could not reach the rendezvous at "
            f"{self.rdzv_endpoint} within --rdzv-timeout {self.rdzv_timeout_s} s ({type(error).__name__}: {error}). "
            "Start node 0 (--node-rank 0) with the same --rdzv-endpoint, its address and a port open to this node."
        )

    def describe(self) -> str:
        """`` on node R (host)`` for lines about this node's ranks in a launch over several; else empty."""
        return f" on node {self.node_rank} ({socket.gethostname()})" if self.several else ""

    def rendezvous_failed(self, command: str, error: BaseException) -> str:
        """The one line for a rendezvous that did not complete: what this node waited for and the likely fixes."""
        cause = " ".join(str(error).split())[:200]
        return (
            f"drivetrain {command}: error: node {self.node_rank} of {self.nnodes} could not complete the rendezvous "
            f"at {self.rdzv_endpoint} within --rdzv-timeout {self.rdzv_timeout_s} s ({type(error).__name__}"
            f"{': ' + cause if cause and cause != type(error).__name__ else ''}). Start every node with the same "
            "--nnodes, --nproc and --rdzv-endpoint (node 0's address, reachable from every node), node 0 first, "
            "or raise --rdzv-timeout."
        )


__all__ = ["DEFAULT_TIMEOUT_S", "NODE_RANK_ENV", "TIMEOUT_ENV", "Nodes"]
