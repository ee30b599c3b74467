"""``drivetrain sft`` and ``grpo`` with ``--nnodes 2``: two "nodes" simulated on one machine (two launchers, one
c10d rendezvous), equal to one node of two ranks; and the launches that cannot work end in one line on every
node, within ``--rdzv-timeout``, with nothing written.

Where the machine lets a user make network namespaces, GRPO's nodes run each in a network and host-name namespace
of its own (``node0`` at 10.77.0.1, ``node1`` at 10.77.0.2, joined by veth links to a bridge), so the ranks find
each other by host name over a real interface, as on a cluster; elsewhere on loopback, and the namespaced case is
skipped with the command that failed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
from drivetrain_engine_core.testing import free_port
from drivetrain_roles.jobs.nodes import Nodes
from drivetrain_roles.jobs.run_options import RunOptions
from safetensors.torch import load_file

IP = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
NAMESPACED_NODES = 2
HOLDER_NAMESPACES = ["unshare", "--user", "--map-root-user", "--net", "--mount"]
HOLDER = (
    "{ip} link set lo up && {ip} link add br0 type bridge && {ip} link set br0 up && "
    "mount --bind {hosts} /etc/hosts && echo ready && exec sleep infinity"
)
"""Run in the holder's new user, network and mount namespaces: the bridge every node's link joins, and the
nodes' host names in ``/etc/hosts`` (seen by every node, which shares the holder's mount namespace)."""
NODE = (
    "hostname node{node} && {ip} link set lo up && {ip} link add eth0 type veth peer name w$$ netns {holder} && "
    "{ip} addr add 10.77.0.{address}/24 dev eth0 && {ip} link set eth0 up && "
    'nsenter --target {holder} --net {ip} link set w$$ master br0 up && exec "$@"'
)
"""Run in a node's new network and host-name namespaces, then its command: its host name, and a veth link to the
holder's bridge (named by the shell's pid there: a link outlives its node for a moment)."""


@dataclass(frozen=True)
class _Network:
    """Where the simulated nodes run: this machine's network (node 0 at 127.0.0.1), or, given the pid of the
    process that holds the namespaces, each node in namespaces of its own (``HOLDER``, ``NODE``)."""

    holder: int | None = None

    def host(self, node: int) -> str:
        """The address the other nodes reach ``node`` at."""
        return "127.0.0.1" if self.holder is None else f"node{node}"

    def hostname(self, node: int) -> str:
        """The host name ``node``'s ranks see."""
        return socket.gethostname() if self.holder is None else f"node{node}"

    def wrap(self, node: int, command: Sequence[str]) -> list[str]:
        """``command`` run as ``node``."""
        if self.holder is None:
            return list(command)
        setup = NODE.format(node=node, ip=IP, holder=self.holder, address=node + 1)
        enter = ["nsenter", f"--target={self.holder}", "--user", "--net", "--mount", "--preserve-credentials"]
        return [*enter, "unshare", "--net", "--uts", "sh", "-c", setup, f"node{node}", *command]


LOOPBACK = _Network()


def _node(
    launches: Any,
    rank: int,
    nnodes: int,
    port: int,
    output_dir: str,
    cwd: Path,
    *,
    command: str = "sft",
    arguments: Sequence[str] | None = None,
    network: _Network = LOOPBACK,
    timeout: int = 60,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[str]:
    """The launcher of node ``rank`` of ``nnodes``: ``drivetrain <command>`` with one rank (``arguments``: the
    overrides, by default ``launches.tiny_sft``), the rendezvous at node 0's ``port``."""
    endpoint = f"{network.host(0)}:{port}"
    nodes = ["--nnodes", str(nnodes), "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
    flags = [*nodes, "--rdzv-timeout", str(timeout), "--output-dir", output_dir]
    return subprocess.Popen(
        network.wrap(rank, launches.line(command, *flags, *(arguments or launches.tiny_sft))),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _start_nodes(
    launches: Any, nnodes: int, output_dir: str, cwd: Path, **options: Any
) -> list[subprocess.Popen[str]]:
    """The launchers of ``nnodes`` nodes of one launch (one rendezvous); ``options`` as :func:`_node`'s."""
    port = free_port()
    return [_node(launches, rank, nnodes, port, output_dir, cwd, **options) for rank in range(nnodes)]


def _failed(args: Sequence[str], error: str) -> str:
    return f"this machine cannot give each node a network of its own: `{shlex.join(args)}` failed: {error.strip()}"


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Network | str]:
    """The namespaced network of :data:`NAMESPACED_NODES` nodes, proved by one node that sets itself up and
    ends; or why this machine cannot make it: the command that failed and its error."""
    if IP is None or not shutil.which("unshare") or not shutil.which("nsenter"):
        yield "nodes in network namespaces of their own need the commands ip (iproute2), unshare and nsenter"
        return
    hosts = tmp_path_factory.mktemp("network") / "hosts"
    names = "".join(f"10.77.0.{n + 1} node{n}\n" for n in range(NAMESPACED_NODES))
    hosts.write_text(f"127.0.0.1 localhost\n{names}")
    args = [*HOLDER_NAMESPACES, "sh", "-c", HOLDER.format(ip=IP, hosts=hosts)]
    holder = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stderr is not None
        if holder.stdout.readline() != "ready\n":
            yield _failed(args, holder.stderr.read())
            return
        network = _Network(holder.pid)
        probe = subprocess.run(network.wrap(0, ["true"]), capture_output=True, text=True, timeout=30)
        yield _failed(probe.args, probe.stderr) if probe.returncode else network
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture(params=["namespaces", "loopback"])
def network(request: pytest.FixtureRequest, namespaces: _Network | str) -> _Network:
    """The nodes' network for a launch the test makes once: namespaces of their own where the machine allows it
    (else that case is skipped with what failed), loopback only where it does not (the namespaced case is the
    same launch over a real interface)."""
    if request.param == "namespaces" and isinstance(namespaces, str):
        pytest.skip(namespaces)
    if request.param == "loopback" and isinstance(namespaces, _Network):
        pytest.skip("the nodes ran in network namespaces of their own; loopback would repeat that launch")
    return namespaces if isinstance(namespaces, _Network) else LOOPBACK


def _ends(*launchers: subprocess.Popen[str]) -> list[tuple[int, str]]:
    errors = [p.communicate(timeout=240)[1] for p in launchers]
    return [(p.returncode, err) for p, err in zip(launchers, errors, strict=True)]


def _losses(run: Path) -> list[float]:
    return [
        r["train/loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    ]


@pytest.mark.slow
def test_two_nodes_of_one_rank_equal_one_node_of_two_and_resume_as_one(launches, tmp_path) -> None:
    """Two nodes of one rank train 2 steps; one node of two ranks resumes that run to step 3 (the checkpoint's
    layout holds for any two ranks): losses and final weights equal an uninterrupted 3-step run of one node."""
    constant = ["optimizer.lr_schedule=constant", "optimizer.warmup_steps=0"]  # the same lr for 2 and 3 steps
    two_nodes, one_node = tmp_path / "two_nodes", tmp_path / "one_node"
    job = [*launches.tiny_sft, *constant]
    nodes = _start_nodes(launches, 2, str(two_nodes), tmp_path, arguments=[*job, "trainer.total_steps=2"])
    assert [status for status, _ in _ends(*nodes)] == [0, 0]
    assert not (two_nodes / ".drivetrain-nodes").exists()
    resume = ["--nproc", "2", "--resume", "--output-dir", str(two_nodes), "trainer.total_steps=3"]
    reference = ["--nproc", "2", "--output-dir", str(one_node), *job, "trainer.total_steps=3"]
    for arguments in (resume, reference):
        subprocess.run(launches.line("sft", *arguments), check=True, capture_output=True, timeout=240)
    resumed, expected = _losses(two_nodes), _losses(one_node)
    assert len(resumed) == 3 and max(abs(a - b) for a, b in zip(resumed, expected, strict=True)) <= 1e-6
    weights, final = (load_file(run / "final_model" / "model.safetensors") for run in (two_nodes, one_node))
    assert max((weights[k] - final[k]).abs().max().item() for k in final) <= 1e-6


@pytest.mark.slow
def test_grpo_on_two_nodes_equals_one_node_of_two_ranks(
    network, tiny_grpo_job, tiny_grpo_two_ranks, grpo_gaps, launches, tmp_path
) -> None:
    """Two launchers of one rank each train GRPO 2 steps: per step the reward, policy loss, KL and gradient norm of
    one node of two ranks within 1e-6, and each rank ran on a node of its own (its node in the rendezvous and
    its host name, as the reward function saw them)."""
    places, run = tmp_path / "places", tmp_path / "run"
    places.mkdir()
    env = {"DRIVETRAIN_TEST_PLACES": str(places)}
    launchers = _start_nodes(
        launches, 2, str(run), tmp_path, command="grpo", arguments=tiny_grpo_job, network=network, env=env
    )
    ends = _ends(*launchers)
    assert [status for status, _ in ends] == [0, 0], ends
    gaps = grpo_gaps(run, tiny_grpo_two_ranks)
    print(f"two nodes ({network.host(0)}, {network.host(1)}) vs one node of two ranks, largest gap: {gaps}")
    assert max(gaps.values()) <= 1e-6, gaps
    ranks = {int(p.name.removeprefix("rank")): p.read_text().split() for p in places.iterdir()}
    assert ranks == {rank: [str(rank), network.hostname(rank)] for rank in (0, 1)}


@pytest.mark.slow
def test_launches_that_cannot_work_end_in_one_line_on_every_node_with_nothing_written(
    launches, tmp_path
) -> None:
    """An endpoint nobody answers, nodes started with different --nnodes, and a run folder each node has its own
    copy of (the same path, here relative to another working directory): one line each, within the timeout."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    start = time.monotonic()
    alone = _node(launches, 1, 2, free_port(), "run", tmp_path / "a", timeout=2)
    port = free_port()
    mismatched = [
        _node(launches, 0, 2, port, "run", tmp_path / "a", timeout=3),
        _node(launches, 1, 3, port, "run", tmp_path / "b", timeout=3),
    ]
    [(status, err)] = _ends(alone)
    assert status == 1 and err.startswith(
        "drivetrain sft: error: node 1 of 2 could not reach the rendezvous at "
    )
    assert err.count("\n") == 1 and "within --rdzv-timeout 2 s (ConnectionRefusedError" in err
    for (status, err), (rank, nnodes) in zip(_ends(*mismatched), [(0, 2), (1, 3)], strict=True):
        assert (status, err.count("\n")) == (1, 1)
        assert err.startswith(
            f"drivetrain sft: error: node {rank} of {nnodes} could not complete the rendezvous"
        )
    assert time.monotonic() - start < 90
    port = free_port()
    # Node 1 started first: torch's rendezvous orders one host's nodes by process id, so rank 0 runs on node 1;
    # the message names each rank's node as the launch does (--node-rank), not as the rendezvous numbered it.
    unshared = [_node(launches, r, 2, port, "run", tmp_path / d, timeout=3) for r, d in ((1, "b"), (0, "a"))]
    ends = _ends(*unshared)
    assert ends[0] == ends[1] and ends[0][0] == 1
    assert ends[0][1] == (
        "drivetrain sft: error: the run folder run is not shared by every node: rank 0 (node 1, host "
        f"{socket.gethostname()}) cannot see the marker rank 1 (node 0, host {socket.gethostname()}) wrote there "
        "(.drivetrain-nodes/rank1-node0) within 3 s. Put --output-dir on storage every node mounts at the same "
        "path (NFS, Lustre, a shared volume), or raise --rdzv-timeout for storage that shows new files late.\n"
    )
    assert list((tmp_path / "a").iterdir()) == list((tmp_path / "b").iterdir()) == []


def test_several_nodes_need_an_endpoint_a_shared_folder_and_a_rank_in_range() -> None:
    with pytest.raises(click.UsageError, match="--nnodes 2 needs --rdzv-endpoint HOST:PORT"):
        Nodes(nnodes=2, node_rank=1)
    with pytest.raises(click.UsageError, match="give each node a rank from 0 to 1"):
        Nodes(nnodes=2, node_rank=2, rdzv_endpoint="h:1")
    with pytest.raises(click.UsageError, match="--nnodes 2 needs --output-dir DIR, the same on every node"):
        RunOptions(command="sft", nodes=Nodes(nnodes=2, rdzv_endpoint="h:1"))
    config = Nodes(nnodes=2, node_rank=1, rdzv_endpoint="h:1", rdzv_timeout_s=7).launch_config(
        "sft", 4, "x", ""
    )
    assert (
        config.min_nodes,
        config.max_nodes,
        config.nproc_per_node,
        config.run_id,
        config.rdzv_endpoint,
    ) == (2, 2, 4, "drivetrain-sft-2n", "h:1")
    assert config.rdzv_configs == {
        "join_timeout": 7,
        "read_timeout": 7,
        "last_call_timeout": 1,
        "is_host": False,
        "timeout": 7,
    }


@pytest.mark.slow
def test_under_an_outside_launcher_the_command_is_one_rank_and_spawns_nothing(launches, tmp_path) -> None:
    """torchrun or srun set RANK/WORLD_SIZE/MASTER_ADDR: the node flags are ignored (no rendezvous at the dead
    endpoint), the process is the rank; the shared-folder check passes for a world of one."""
    outside = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env = {**os.environ, **outside, "MASTER_PORT": str(free_port())}
    nodes = ["--nnodes", "2", "--node-rank", "1", "--nproc", "2", "--rdzv-endpoint", "127.0.0.1:1"]
    command = launches.line(
        "sft", *nodes, "--output-dir", str(tmp_path / "run"), *launches.tiny_sft, "trainer.total_steps=1"
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert [
        r["step"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    ] == [
        0,
        1,
        1,
    ]
