"""Starting the ranks of an SFT run: in this process, or ``N`` processes through ``torch.distributed.run``.

``drivetrain sft --nproc N`` re-launches itself under torchrun's module (``python -m torch.distributed.run
--standalone --nproc-per-node N -m drivetrain_roles.sft.rank_main ...``) with the same arguments, so a run
needs no separate launcher; under an outer ``torchrun`` (``WORLD_SIZE`` set) the command runs as one rank.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

OUTPUTS_ROOT = Path("outputs")
RUN_PREFIX = "sft-"
CHECKPOINT_DIR = "checkpoints"


def under_launcher() -> bool:
    """Whether this process is one rank of a torchrun-style launch."""
    return "WORLD_SIZE" in os.environ


def new_output_dir(root: Path = OUTPUTS_ROOT) -> Path:
    """``outputs/sft-<UTC timestamp>``: a fresh run directory."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return root / f"{RUN_PREFIX}{stamp}"


def latest_output_dir(root: Path = OUTPUTS_ROOT) -> Path | None:
    """The newest ``outputs/sft-*`` run that holds a checkpoint (what ``--resume`` continues by default)."""
    from drivetrain_engine_core.checkpoint import complete_steps

    runs = sorted(p for p in root.glob(f"{RUN_PREFIX}*") if complete_steps(p / CHECKPOINT_DIR))
    return runs[-1] if runs else None


def check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """A resumed run needs a checkpoint in ``run_dir``; a new run needs none there unless told to overwrite.

    Checked before any rank starts, so that a new run never prunes or overwrites another run's steps and
    metrics, and ``--resume`` never silently starts from step 0.

    Raises:
        CheckpointError: the run directory does not fit the request; the message names the flag to change.
    """
    from drivetrain_engine_core.checkpoint import step_entries
    from drivetrain_engine_core.errors import CheckpointError

    root = run_dir / CHECKPOINT_DIR
    complete = [entry.path.name for entry in step_entries(root) if entry.complete]
    if resume and not complete:
        raise CheckpointError(
            f"--resume: {root} holds no complete checkpoint, so there is nothing to continue. Drop --resume to "
            f"start a new run in {run_dir}, or pass the --output-dir of the run to continue."
        )
    if not resume and not overwrite and complete:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints of a run ({', '.join(complete)}); a new run there would prune "
            "and overwrite them. Continue that run with --resume, choose another --output-dir, or pass "
            "--overwrite to delete them and start over."
        )


def resolve_output_dir(output_dir: str | None, resume: bool) -> Path:
    """The run directory: as given; else for ``--resume`` the newest resumable run; else a new one.

    Raises:
        FileNotFoundError: ``--resume`` without ``--output-dir`` and no resumable run under ``outputs/``.
    """
    if output_dir is not None:
        return Path(output_dir)
    if resume:
        latest = latest_output_dir()
        if latest is None:
            raise FileNotFoundError(
                f"--resume found no run with a checkpoint under {OUTPUTS_ROOT.resolve()}/{RUN_PREFIX}*; pass "
                "--output-dir DIR of the run to continue."
            )
        return latest
    return new_output_dir()


def spawn_ranks(nproc: int, arguments: Sequence[str]) -> int:
    """Run ``nproc`` ranks of ``drivetrain sft <arguments>`` under torchrun; returns the launcher's exit code."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "drivetrain_roles.sft.rank_main",
        *arguments,
    ]
    # Two ranks on a small CPU machine: one intra-op thread each avoids oversubscribing the cores.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    return subprocess.call(command, env=env)
