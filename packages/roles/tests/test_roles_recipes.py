"""The Slurm recipe (``recipes/slurm/torchrun-multinode.sbatch``) run as Slurm would, with stand-ins for
``srun`` (one task per node, node ranks 0 and 1) and ``scontrol``: each node's command line is the one the
README promises and parses as ``drivetrain`` takes it (``--print-config``: no rank starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).parents[1] / "recipes" / "slurm" / "torchrun-multinode.sbatch"
SRUN = """#!/bin/bash
printf '%s\\n' "$*" >> "$CALLS"
for node in 0 1; do
    SLURM_NODEID=$node "${@:2}" > "$CALLS.node$node" || exit $?
done
"""
DRIVETRAIN = """#!/bin/bash
printf '%s\\n' "$*" >> "$CALLS.drivetrain"
exec {real} "$@"
"""
SCONTROL = "#!/bin/bash\nprintf 'gpu-a\\n'\nsleep 0.2\nprintf 'gpu-b\\n'\n"
"""Writes its lines one at a time, as a long node list is: a reader that stops after the first line makes the
second write fail (SIGPIPE), which ``set -o pipefail`` turned into the job's failure (exit 141)."""


def test_the_slurm_recipe_starts_one_launcher_per_node_with_its_node_rank(tmp_path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = Path(sys.executable).parent / "drivetrain"
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("drivetrain", DRIVETRAIN.format(real=real))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(tmp_path / "calls"),
        "SLURM_JOB_ID": "77",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_GPUS_ON_NODE": "4",
    }
    subprocess.run(
        ["bash", str(RECIPE), "trainer.total_steps=5", "--print-config"],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=120,
    )
    [call] = (tmp_path / "calls").read_text().splitlines()
    assert call.startswith("--kill-on-bad-exit=1 bash -c exec drivetrain")
    flags = f"--nproc 4 --rdzv-endpoint gpu-a:29400 --output-dir {tmp_path}/runs/sft-77 trainer.total_steps=5"
    assert (tmp_path / "calls.drivetrain").read_text().splitlines() == [
        f"sft --nnodes 2 --node-rank {node} {flags} --print-config" for node in (0, 1)
    ]
    for node in (0, 1):
        assert "total_steps: 5" in (tmp_path / f"calls.node{node}").read_text()
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


RECIPES = RECIPE.parents[1]
RAY = '#!/bin/bash\nprintf \'%s\\n\' "$*" >> "$CALLS.ray"\n'
"""A stand-in for Ray's CLI: notes each call (``ray start``, ``ray status``) and succeeds."""


def _stand_ins(tmp_path: Path, **scripts: str) -> dict[str, str]:
    """An environment whose PATH finds ``scripts`` first (by name) and a ``drivetrain`` that notes its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    real = Path(sys.executable).parent / "drivetrain"
    for name, text in {**scripts, "ray": RAY, "drivetrain": DRIVETRAIN.format(real=real)}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls")}


def _printed_config(tmp_path: Path) -> str:
    """What the recipe's ``drivetrain`` printed (``--print-config``: no rank starts, nothing is written)."""
    return (tmp_path / "calls.out").read_text()


def test_ray_on_slurm_starts_a_head_and_workers_then_places_one_rank_per_gpu(tmp_path) -> None:
    srun = (
        '#!/bin/bash\nprintf \'%s\\n\' "$*" >> "$CALLS"\n'
        'if [[ "$*" == *hostname* ]]; then echo "10.0.0.1 fe80::1"; fi\n'
    )
    env = {
        **_stand_ins(tmp_path, srun=srun, scontrol=SCONTROL),
        "SLURM_JOB_ID": "78",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_GPUS_ON_NODE": "4",
    }
    recipe = RECIPES / "slurm" / "ray-on-slurm.sbatch"
    with (tmp_path / "calls.out").open("w") as out:
        subprocess.run(
            ["bash", str(recipe), "trainer.total_steps=5", "--print-config"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            check=True,
            timeout=120,
        )
    head_ip, *daemons = (tmp_path / "calls").read_text().splitlines()
    assert head_ip == "--nodes=1 --ntasks=1 -w gpu-a hostname --ip-address"
    assert sorted(daemons) == [  # both run in the background: in either order
        "--nodes=1 --ntasks=1 --exclude=gpu-a ray start --address=10.0.0.1:6379 --num-gpus=4 --block",
        "--nodes=1 --ntasks=1 -w gpu-a ray start --head --node-ip-address=10.0.0.1 --port=6379 --num-gpus=4 --block",
    ]
    assert (tmp_path / "calls.ray").read_text().splitlines() == ["status --address=10.0.0.1:6379"]
    ray = "trainer.placement=ray trainer.ray.address=10.0.0.1:6379 trainer.ray.workers=8 trainer.ray.strategy=PACK"
    assert (tmp_path / "calls.drivetrain").read_text().splitlines() == [
        f"grpo {ray} trainer.ray.timeout_s=300 engine.device=cuda --output-dir {tmp_path}/runs/grpo-78 "
        "trainer.total_steps=5 --print-config"
    ]
    printed = _printed_config(tmp_path)
    assert "placement: ray" in printed and "address: 10.0.0.1:6379" in printed and "workers: 8" in printed
    assert not (tmp_path / "runs").exists()


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_the_ray_cluster_yaml_is_valid_for_ray_up_and_its_commands_run(tmp_path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    recipe = RECIPES / "ray" / "cluster.yaml"
    config = _yaml(recipe)
    validate_config(prepare_config(config))  # what `ray up` checks first
    env = {**_stand_ins(tmp_path), "RAY_HEAD_IP": "10.0.0.1"}
    for line in [*config["head_start_ray_commands"], *config["worker_start_ray_commands"]]:
        subprocess.run(["bash", "-c", line], env=env, check=True, timeout=30)
    assert (tmp_path / "calls.ray").read_text().splitlines() == [
        "stop",
        "start --head --port=6379 --autoscaling-config=~/ray_bootstrap_config.yaml",
        "stop",
        "start --address=10.0.0.1:6379",
    ]
    [job] = [
        line for line in recipe.read_text().splitlines() if line.startswith("#   ray exec cluster.yaml '")
    ]
    command = job.split("'")[1]
    with (tmp_path / "calls.out").open("w") as out:
        subprocess.run(
            ["bash", "-c", f"{command} --print-config"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            check=True,
            timeout=120,
        )
    assert "placement: ray" in _printed_config(tmp_path) and "workers: 16" in _printed_config(tmp_path)


def test_the_skypilot_task_runs_a_head_on_node_0_and_workers_elsewhere(tmp_path) -> None:
    task = _yaml(RECIPES / "skypilot" / "grpo-ray.yaml")
    assert task["num_nodes"] == 2 and set(task["envs"]) == {"RUN_BUCKET", "ARGS"}
    assert task["file_mounts"]["/runs"]["mode"] == "MOUNT"
    sky = {
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        "SKYPILOT_TASK_ID": "t-1",
        "ARGS": "trainer.total_steps=5 --print-config",
    }
    for rank in ("1", "0"):
        env = {**_stand_ins(tmp_path), **sky, "SKYPILOT_NODE_RANK": rank}
        with (tmp_path / "calls.out").open("w") as out:
            subprocess.run(
                ["bash", "-c", task["run"]], cwd=tmp_path, env=env, stdout=out, check=True, timeout=120
            )
    assert (tmp_path / "calls.ray").read_text().splitlines() == [
        "start --address=10.0.0.1:6380 --disable-usage-stats --block",
        "start --head --port=6380 --disable-usage-stats",
    ]
    [call] = (tmp_path / "calls.drivetrain").read_text().splitlines()
    assert call.startswith(
        "grpo trainer.placement=ray trainer.ray.address=10.0.0.1:6380 trainer.ray.workers=16 "
    )
    assert call.endswith("--output-dir /runs/grpo-t-1 trainer.total_steps=5 --print-config")
    assert "placement: ray" in _printed_config(tmp_path)
