"""Starting the ranks of an SFT run: in this process, or ``N`` processes through ``torch.distributed.run``.

``drivetrain sft --nproc N`` re-launches itself under torchrun's module (``python -m torch.distributed.run
--standalone --nproc-per-node N -m drivetrain_roles.sft.rank_main ...``) with the same arguments, so a run
needs no separate launcher; under an outer ``torchrun`` (``WORLD_SIZE`` set) the command runs as one rank.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from drivetrain_engine_core.processes import run_process_group

OUTPUTS_ROOT = Path("outputs")
RUN_PREFIX = "sft-"


def under_launcher() -> bool:
    """Whether this process is one rank of a torchrun-style launch."""
    return "WORLD_SIZE" in os.environ


def new_output_dir(root: Path = OUTPUTS_ROOT) -> Path:
    """``outputs/sft-<UTC timestamp>``: a fresh run directory."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return root / f"{RUN_PREFIX}{stamp}"


def latest_output_dir(root: Path = OUTPUTS_ROOT) -> Path | None:
    """The newest ``outputs/sft-*`` run that holds a checkpoint (what ``--resume`` continues by default)."""
    runs = sorted(p for p in root.glob(f"{RUN_PREFIX}*") if (p / "checkpoints" / "latest").is_file())
    return runs[-1] if runs else None


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
    # torchrun and its ranks run in their own process group, killed as a whole when torchrun returns, so no
    # helper a rank started (megatron's checkpoint writer) outlives the command and holds its output open.
    return run_process_group(command, env=env)
