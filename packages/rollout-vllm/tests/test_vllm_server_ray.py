"""The vLLM server on another node than its trainer: ``trainer.placement=ray trainer.ray.rollout_node=other`` on
Ray's multi-node test cluster (two raylets on one machine, one CPU each), the trainer in this Python, the server
in the vLLM environment's (drivetrain-roles' Ray launcher, this package's TCP transport).

Three steps of ``drivetrain grpo`` on the embedded chat task (prompts of a 368-token shared system prefix, graded
rewards, a whole hand-off then deltas) run the rank on one node and its vLLM server on the other (the node ids the
rank's server actor reports and the driver's placement line name), and sample as the same job with the server
beside the trainer (the separate placement's GRPO run, shared through conftest): the same rewards, losses, KL and
gradient norms within 1e-6, the server's log-probs the actor's within 1e-5 every step.
A server whose node is lost mid-request is named, with its node, within a bound, instead of hanging the rank."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import pytest
from drivetrain_rollout_vllm.process import PYTHON_VARIABLE, ServerProcess
from drivetrain_rollout_vllm.wire import AUTHKEY_VARIABLE, RolloutServerError

ray = pytest.importorskip("ray")
if importlib.util.find_spec("vllm") is not None:
    pytest.skip("the trainer side runs in the workspace environment (with Ray)", allow_module_level=True)

pytestmark = pytest.mark.slow

HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
"""The test cluster marks a dead node within about a second (Ray's default: about 15 s)."""
LOST_NODE_BOUND_S = 30
"""Ray's health checks here, and the rollout's one-second watch, with room for a loaded machine."""
METRICS = ("train/reward", "train/pg_loss", "train/kl", "train/grad_norm")


@pytest.fixture(scope="module")
def cluster(request) -> Iterator[Any]:
    """A head node and one worker node (one CPU each), with fast health checks; their workers (the ranks) name
    the vLLM environment's Python where there is one."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        with suppress(pytest.skip.Exception):  # the lost-node test needs no vLLM
            patch.setenv(PYTHON_VARIABLE, request.getfixturevalue("vllm_python"))
        # A server outlives its dead worker, as a lost machine's server does to its trainer (no end of file on
        # the socket); otherwise Ray's worker kills its children as it exits.
        patch.setenv("RAY_kill_child_processes_on_worker_exit", "0")
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH},
        )
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        try:
            yield cluster
        finally:
            cluster.shutdown()


def test_grpo_with_its_vllm_server_on_another_node_samples_as_with_it_beside(
    cluster, vllm_python, chat_task_on_a_server, chat_task_beside, chat_task_steps, grpo_on_server, tmp_path
):
    run = tmp_path / "ray"
    placement = ["trainer.placement=ray", f"trainer.ray.address={cluster.address}", "trainer.ray.workers=1"]
    on_ray = grpo_on_server(
        run, vllm_python, *chat_task_on_a_server, *placement, "trainer.ray.rollout_node=other"
    )
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    said = on_ray.stdout + on_ray.stderr
    [(rank_node, planned)] = re.findall(
        r"rank 0 on node (\w+) \(.*; rank 0's rollout server to node (\w+) \(", said
    )
    [ran_on] = re.findall(r"rank 0's rollout server runs on Ray node (\w+) ", said)
    nodes = {cluster.head_node.node_id[:12], next(iter(cluster.worker_nodes)).node_id[:12]}
    assert ran_on.startswith(planned) and {rank_node, planned} == nodes, said[-3000:]
    got, expected = chat_task_steps(run), chat_task_steps(chat_task_beside)
    gaps = {key: max(abs(a[key] - b[key]) for a, b in zip(got, expected, strict=True)) for key in METRICS}
    drift = max(row["rollout/log_prob_diff_max"] for row in got)
    print(f"server on another node vs beside: largest gaps {gaps}; log-prob gap to the actor {drift:.1e}")
    assert max(gaps.values()) <= 1e-6 and len({row["train/reward"] for row in got}) == 3, gaps
    for row in got:
        assert row["rollout/log_prob_diff_max"] <= 1e-5 and row["rollout/mismatch_kl"] <= 1e-10, row


# argv: -m drivetrain_rollout_vllm.server tcp://HOST/PATH MODEL DEVICE; takes its trainer, then never answers.
SILENT_SERVER = f"""
import os, sys, time
from drivetrain_rollout_vllm.transport import accept_trainer, listen
with listen(sys.argv[3], bytes.fromhex(os.environ[{AUTHKEY_VARIABLE!r}])) as listener:
    connection = accept_trainer(listener)
time.sleep(600)
"""


@pytest.mark.timeout(120)  # without the handle's report of the lost actor, the rank waited for good
def test_a_server_whose_node_is_lost_mid_request_is_named_in_time(cluster, tmp_path, monkeypatch):
    """Runs last: it takes the worker node away. The server (a stand-in that takes its trainer and never
    answers) runs on the worker node through the Ray launcher; the node is killed while a request waits, and the
    stand-in lives on with its socket open, as a vanished machine's does to its trainer: only the handle's
    report that the server's actor is gone ends the wait, not the request's deadline (60 s here)."""
    from drivetrain_roles.jobs.ray_config import RayConfig
    from drivetrain_roles.jobs.ray_server import PLACE_ENV, server_environment, start_on_node

    script, python = tmp_path / "silent_server.py", tmp_path / "python"
    script.write_text(SILENT_SERVER)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(0o755)
    worker = next(iter(cluster.worker_nodes))
    place = server_environment((worker.node_id, worker.node_ip_address), RayConfig(), "cpu")
    monkeypatch.setenv(PLACE_ENV, place[PLACE_ENV])
    ray.init(address=cluster.address)
    server = None
    try:
        server = ServerProcess.start(
            python=str(python), model_path=str(tmp_path), device="cpu", launch=start_on_node
        )
        assert server.process.node == worker.node_id
        killed: list[float] = []

        def kill_the_node() -> None:
            time.sleep(1.0)
            cluster.remove_node(worker, allow_graceful=False)
            killed.append(time.monotonic())

        threading.Thread(target=kill_the_node, daemon=True).start()
        with pytest.raises(RolloutServerError) as error:
            server.call("generate", [[1, 2]], {}, what="generating", seconds=60)
        named = time.monotonic() - killed[0]
        message = str(error.value)
        print(f"the lost node was named {named:.1f} s after it was killed: {message.splitlines()[0]}")
        assert named < LOST_NODE_BOUND_S and f"on Ray node {worker.node_id[:12]} (" in message
        assert "whose Ray actor is gone" in message and "exited while generating with exit code -9" in message
    finally:
        if server is not None:
            with suppress(ProcessLookupError):  # the stand-in that outlived its node (one machine here)
                os.kill(server.process.pid, signal.SIGKILL)
        ray.shutdown()
