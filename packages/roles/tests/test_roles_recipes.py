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
SCONTROL = "#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\n'\n"


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
