"""``trainer.ray.rollout_node``: each rank's rollout server on another Ray node (the run itself is in
packages/rollout-vllm/tests/test_vllm_server_ray.py, which needs the vLLM environment). Here, without Ray: the
refusals, each one line naming the fix and raised before anything starts (at config load, or on joining the
cluster, before any rank is placed), and the choice of the servers' nodes."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.jobs.ray_config import RayConfig, RayPlacementError
from drivetrain_roles.jobs.ray_server import PLACE_ENV, require_other_nodes, require_placed, server_nodes


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.ray.rollout_node=othr"],
            "trainer.ray.rollout_node='othr' is not known; did you mean 'other'? choose one of same, other.",
        ),
        (
            ["trainer.ray.rollout_node=other"],
            "trainer.ray.rollout_node=other starts each rank's rollout server on another Ray node, which needs the "
            "ranks on a Ray cluster, and trainer.placement=local; set trainer.placement=ray (and "
            "trainer.ray.address), or drop trainer.ray.rollout_node.",
        ),
    ],
)
def test_a_server_node_without_ray_placement_is_refused_at_load(overrides, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["rollout.name=vllm-server", *overrides])


def _cluster(*alive: bool) -> SimpleNamespace:
    """A stand-in for the ``ray`` module as :func:`require_other_nodes` asks it: nodes alive or dead."""
    return SimpleNamespace(nodes=lambda: [{"NodeID": f"n{i}", "Alive": a} for i, a in enumerate(alive)])


def test_a_cluster_of_one_node_or_a_command_without_rollout_is_refused_before_placing() -> None:
    other, grpo = RayConfig(rollout_node="other"), SimpleNamespace(rollout=object())
    with pytest.raises(RayPlacementError) as one_node:
        require_other_nodes(_cluster(True, False), other, grpo, "grpo")
    assert str(one_node.value) == (
        "trainer.ray.rollout_node=other starts each rank's rollout server on another Ray node, and the cluster has "
        "1 alive node(s); add a node (ray start --address=HEAD:PORT on another machine), or set "
        "trainer.ray.rollout_node=same to run the servers beside their ranks."
    )
    with pytest.raises(
        RayPlacementError, match=r"drivetrain sft samples no rollout; drop trainer.ray.rollout_node"
    ):
        require_other_nodes(_cluster(True, True), other, SimpleNamespace(), "sft")
    require_other_nodes(_cluster(True, True), other, grpo, "grpo")
    require_other_nodes(_cluster(True), RayConfig(), grpo, "grpo")  # same: any cluster


def test_a_rollout_that_runs_no_server_is_refused_where_one_was_placed(monkeypatch) -> None:
    require_placed("hf")  # not asked for: nothing to check
    monkeypatch.setenv(PLACE_ENV, "{}")
    with pytest.raises(
        ConfigError, match=r"rollout 'hf' runs no server process .* set rollout.name=vllm-server"
    ):
        require_placed("hf")


def test_each_server_goes_to_another_node_than_its_rank_free_nodes_first() -> None:
    a, b, c = ("A", "10.0.0.1"), ("B", "10.0.0.2"), ("C", "10.0.0.3")
    assert server_nodes([a], [a, b]) == [b]
    assert server_nodes([a, b], [a, b]) == [b, a]
    assert server_nodes([a, b, a], [a, b, c]) == [c, c, c]
    assert server_nodes([a, a], [a, b, c]) == [b, c]


def test_a_dead_server_node_is_named_with_the_ranks_whose_servers_it_ran() -> None:
    from drivetrain_roles.jobs.ray_ranks import PlacedRanks

    nodes = [{"NodeID": "A", "Alive": True}, {"NodeID": "B", "Alive": False}]
    ranks = PlacedRanks(
        ray=SimpleNamespace(nodes=lambda: nodes),
        placement=RayConfig(rollout_node="other"),
        command="grpo",
        group=None,
        actors=[],
        nodes=[("A", "10.0.0.1"), ("A", "10.0.0.1")],
        gpus=False,
        device="cpu",
        servers=[("B", "10.0.0.2"), ("B", "10.0.0.2")],
    )
    assert ranks.lost_node("/runs/a") == (
        "drivetrain grpo: Ray node B (10.0.0.2) died while running the rollout servers of ranks [0, 1]; every rank "
        "was stopped. Continue from the last checkpoint with --resume --output-dir /runs/a once the cluster has the "
        "nodes again."
    )
    assert "rank 1 on node A (10.0.0.1); rank 0's rollout server to node B (10.0.0.2)" in ranks.describe()
