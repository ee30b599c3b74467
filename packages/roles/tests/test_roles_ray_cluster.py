"""``drivetrain grpo`` and ``sft`` with ``trainer.placement=ray`` on Ray's multi-node test cluster (two raylets on
one machine).

One cluster for the module: a head node and a worker node of one CPU each. ``STRICT_SPREAD`` puts the two ranks on
different nodes (the node ids the launch names are the cluster's two); the run's per-step losses, rewards and KL
equal the torchrun path's two ranks (``--nproc 2``) within 1e-6, with the same run folder, for GRPO and for SFT
(the placement is every command's). Ctrl-C on the driver stops both ranks after the same step with its
checkpoint, as under ``--nproc``. A Ray address nobody answers and a placement the cluster cannot make are one
line each within the timeout, with nothing written; a node killed mid-run is named, with its ranks, within a
bound, and every rank stops.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import complete_steps
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.runtime.tracking import read_records

HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
"""The test cluster marks a dead node within about a second (Ray's default: about 15 s)."""
NODE_DEATH_BOUND_S = 30


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head node and one worker node (one CPU each), with fast health checks."""
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH},
        )
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        try:
            yield cluster
        finally:
            cluster.shutdown()


def _ray(address: str, *extra: str) -> list[str]:
    return [
        "trainer.placement=ray",
        f"trainer.ray.address={address}",
        "trainer.ray.workers=2",
        "trainer.ray.cpus_per_worker=1",
        "trainer.ray.strategy=STRICT_SPREAD",
        *extra,
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.placement=rayy", "trainer.placement='rayy' is not known; did you mean 'ray'?"),
        (
            "trainer.ray.strategy=spred",
            "trainer.ray.strategy='SPRED' is not known; did you mean 'SPREAD'? choose one of SPREAD, PACK, "
            "STRICT_SPREAD, STRICT_PACK.",
        ),
        ("trainer.ray.workers=0", "trainer.ray.workers must be >= 1, got 0."),
    ],
)
def test_placement_settings_are_checked_with_the_fix(override, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


@pytest.mark.parametrize("command", ["sft", "dpo", "rm", "grpo", "ppo"])
def test_every_command_takes_the_placement_in_any_case(command) -> None:
    from drivetrain_roles.runtime.command_config import load_config as load
    from drivetrain_roles.runtime.command_config.options import resolve_target

    configs = {
        "sft": "drivetrain_roles.sft.config:SFTConfig",
        "dpo": "drivetrain_roles.dpo.config:DPOConfig",
        "rm": "drivetrain_roles.rm.config:RMConfig",
        "grpo": "drivetrain_roles.grpo.config:GRPOConfig",
        "ppo": "drivetrain_roles.ppo.config:PPOConfig",
    }
    trainer = load(
        resolve_target(configs[command]), None, ["trainer.placement=ray", "trainer.ray.strategy=spread"]
    )
    assert (trainer.trainer.placement, trainer.trainer.ray.strategy) == ("ray", "SPREAD")


def test_each_rank_reserves_a_gpu_on_cuda_and_other_launch_flags_are_refused(tmp_path) -> None:
    ray = load_config(None, ["trainer.ray.cpus_per_worker=0.5"]).trainer.ray
    assert ray.bundle("cuda") == {"CPU": 0.5, "GPU": 1.0} and ray.bundle("cpu") == {"CPU": 0.5}
    result = CliRunner().invoke(
        drivetrain_cli, ["grpo", "--nproc", "2", "--output-dir", str(tmp_path / "run"), *_ray("auto")]
    )
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: trainer.placement=ray places the ranks itself: drop --nproc/--nnodes and set trainer.ray.workers."
    )
    assert not (tmp_path / "run").exists()


def _placed(stderr: str) -> dict[int, str]:
    """Rank -> the node id (first 12 characters) the launch's placement line names."""
    [line] = [line for line in stderr.splitlines() if "ranks placed by Ray" in line]
    found = re.findall(r"rank (\d+) on node (\w+) \(", line)
    return {int(rank): node for rank, node in found}


def _tree(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if "heartbeat" not in p.parts}


@pytest.mark.slow
def test_ranks_on_two_nodes_equal_the_torchrun_path(
    cluster, tiny_grpo_job, tiny_grpo_two_ranks, grpo_gaps, tmp_path, launches
) -> None:
    on_ray = launches.run(
        "grpo", "--output-dir", str(tmp_path / "ray"), *tiny_grpo_job, *_ray(cluster.address), cwd=tmp_path
    )
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    nodes = {cluster.head_node.node_id[:12], next(iter(cluster.worker_nodes)).node_id[:12]}
    placed = _placed(on_ray.stderr)
    assert sorted(placed) == [0, 1] and set(placed.values()) == nodes
    gaps = grpo_gaps(tmp_path / "ray", tiny_grpo_two_ranks)
    print(f"Ray vs torchrun, largest gap per metric over 2 steps: {gaps}")
    assert max(gaps.values()) <= 1e-6, gaps
    assert _tree(tmp_path / "ray") == _tree(tiny_grpo_two_ranks)
    assert (tmp_path / "ray" / "checkpoints" / "latest").exists()


def _losses(run: Path) -> list[float]:
    return [r["train/loss"] for r in read_records(run / "metrics.jsonl") if "train/loss" in r]


@pytest.mark.slow
def test_sft_ranks_on_two_nodes_equal_the_torchrun_path(cluster, tmp_path, launches) -> None:
    job = [*launches.tiny_sft, "trainer.total_steps=2", "trainer.save_every=1"]
    on_ray = launches.run(
        "sft", "--output-dir", str(tmp_path / "ray"), *job, *_ray(cluster.address), cwd=tmp_path
    )
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert len(set(_placed(on_ray.stderr).values())) == 2
    local = launches.run("sft", "--output-dir", str(tmp_path / "torchrun"), *job, nproc=2, cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    got, expected = _losses(tmp_path / "ray"), _losses(tmp_path / "torchrun")
    gap = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    print(f"SFT on Ray vs torchrun, losses {got} vs {expected}: largest gap {gap:.1e}")
    assert len(got) == 2 and gap <= 1e-6
    assert _tree(tmp_path / "ray") == _tree(tmp_path / "torchrun")


@pytest.mark.slow
def test_ctrl_c_on_the_driver_stops_the_ranks_after_one_step_and_saves_it(
    cluster, tmp_path, launches
) -> None:
    """Ctrl-C on the Ray path stopped every rank at once, losing every step since the last save. The driver
    sends it on to the ranks in their step loop: both stop after the same step and save it, as under --nproc."""
    run = tmp_path / "run"
    job = [*launches.tiny_sft, "trainer.total_steps=1000"]
    arguments = ["--output-dir", str(run), *job, *_ray(cluster.address)]
    driver = launches.start("sft", *arguments, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while _beats(run) < 1:  # both ranks in their step loop
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
            time.sleep(0.05)
        os.killpg(driver.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    finally:
        _, err = launches.finish(driver)
    steps = [r["step"] for r in read_records(run / "metrics.jsonl") if "train/loss" in r]
    done = steps[-1]
    saved = run / "checkpoints" / f"global_step_{done}"
    assert driver.returncode == 130, err[-3000:]
    said = [
        line
        for line in err.splitlines()
        if line.startswith("drivetrain sft:") and "placed by Ray" not in line
    ]
    assert said == [
        "drivetrain sft: Ctrl-C: every rank stops after the current step and saves a checkpoint; Ctrl-C again "
        "stops them at once.",
        f"drivetrain sft: interrupted after step {done} of 1000; saved checkpoint {saved}. Continue with: "
        f"drivetrain sft --resume --output-dir {run}",
    ], err[-3000:]
    assert steps == list(range(1, done + 1)) and [s for s, _ in complete_steps(saved.parent)] == [done]


def _beats(run: Path) -> int:
    """The lowest step both ranks' heartbeats report (-1 before both have one)."""
    steps = []
    for rank in (0, 1):
        try:
            steps.append(json.loads((run / "heartbeat" / f"rank{rank}.json").read_text())["step"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return -1
    return min(steps)


@pytest.mark.slow
def test_a_placement_the_cluster_cannot_make_is_one_line_in_time_with_nothing_written(
    cluster, tiny_grpo_job, tmp_path, launches
) -> None:
    started = time.monotonic()
    placement = _ray(cluster.address, "trainer.ray.workers=3", "trainer.ray.timeout_s=3")
    result = launches.run("grpo", *tiny_grpo_job, *placement, cwd=tmp_path)
    assert time.monotonic() - started < 60 and result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: the Ray cluster could not place trainer.ray.workers=3 ranks of {'CPU': 1.0} each with "
        "trainer.ray.strategy=STRICT_SPREAD within trainer.ray.timeout_s=3 s; it has 2 alive node(s) and "
        "{'CPU': 2.0} in all. Lower trainer.ray.workers or the per-worker resources, choose a strategy that is "
        "not STRICT_, or add nodes."
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_ray_address_nobody_answers_is_one_line_in_time_with_nothing_written(
    tiny_grpo_job, tmp_path, launches
) -> None:
    started = time.monotonic()
    result = launches.run(
        "grpo", *tiny_grpo_job, *_ray("127.0.0.1:1", "trainer.ray.timeout_s=5"), cwd=tmp_path
    )
    assert time.monotonic() - started < 60
    assert result.returncode == 1
    assert (
        result.stderr.strip().splitlines() == [result.stderr.strip().splitlines()[0]]
        and "trainer.ray.address=127.0.0.1:1: no Ray cluster answered: nothing answers at 127.0.0.1:1"
        in result.stderr
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_node_killed_mid_run_is_named_and_every_rank_stops(
    cluster, tiny_grpo_job, tmp_path, launches
) -> None:
    """Runs last: it takes the worker node away."""
    run = tmp_path / "run"
    worker = next(iter(cluster.worker_nodes))
    killed: list[float] = []

    def kill_after_first_checkpoint() -> None:
        while not (run / "checkpoints" / "latest").exists():
            time.sleep(0.2)
        cluster.remove_node(worker, allow_graceful=False)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    arguments = ["--output-dir", str(run), *tiny_grpo_job, "trainer.total_steps=50", *_ray(cluster.address)]
    result = launches.run("grpo", *arguments, cwd=tmp_path)
    ended = time.monotonic()
    assert killed, result.stderr[-3000:]
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if "died while running" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    line = lines[0]
    on_worker = [r for r, node in _placed(result.stderr).items() if worker.node_id.startswith(node)]
    assert line.startswith(f"drivetrain grpo: Ray node {worker.node_id} (") and f"ranks {on_worker}" in line
    assert f"--resume --output-dir {run}" in line
    print(f"the node's death was reported {ended - killed[0]:.1f} s after it was killed")
    assert ended - killed[0] < NODE_DEATH_BOUND_S
