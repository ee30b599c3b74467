"""The options every job command (``sft``, ``dpo``, ``rm``, ``grpo``) takes: ``--nproc``, the nodes
(``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-timeout``: :mod:`.nodes`), ``--output-dir``,
``--resume``, ``--overwrite``, and the launch they drive.

``@run_options("sft")`` adds the options; the command receives them as one :class:`RunOptions` ``run`` and
calls :meth:`RunOptions.launch` for the run directory of this process (after spawning ``--nproc`` ranks
when asked). It goes above ``@config_options``, so ``--print-config --resume`` shows the config the resumed run
would use (the run's ``config.yaml`` and the overrides), not the defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from .nodes import DEFAULT_TIMEOUT_S, Nodes


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """What the command line asked of a job's run directory and ranks.

    Attributes:
        command: the command's name (``outputs/<command>-*`` run folders; the spawned ranks look it up by it:
            ``python -m drivetrain_roles.jobs.rank_entry <command>``).
        nproc: ranks to spawn on this node (ignored under an outer launcher).
        nodes: the nodes of the launch (:class:`~.nodes.Nodes`; ignored under an outer launcher).
        output_dir: the run directory as given; ``None`` picks one (see :meth:`launch`).
        resume: continue from the latest checkpoint of the run directory.
        overwrite: delete the checkpoints, final model and summary a previous run left in the run directory.

    Raises:
        click.UsageError: both ``resume`` and ``overwrite``; several nodes without ``output_dir`` (each node
            would name its own timestamped folder).
    """

    command: str
    nproc: int = 1
    nodes: Nodes = dataclasses.field(default_factory=Nodes)
    output_dir: str | None = None
    resume: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.resume and self.overwrite:
            raise click.UsageError(
                "--resume continues a run and --overwrite deletes its checkpoints: pass one."
            )
        if self.nodes.several and self.output_dir is None:
            raise click.UsageError(
                f"--nnodes {self.nodes.nnodes} needs --output-dir DIR, the same on every node, on storage they all "
                "share (NFS, Lustre, a shared volume)."
            )

    def resumed(self, config_file: str | None) -> tuple[RunOptions, str | None]:
        """For ``--resume`` without ``--config``: these options pinned to the run directory, and the run's own
        ``config.yaml`` as the config file (the overrides go on top of it); else both unchanged.

        NOTE: a resumed run was built from the defaults plus the resume command's overrides alone, so
        ``drivetrain sft --resume`` continued another run's model, data and learning rate on the first's
        checkpoint (a user model resumed as the embedded one failed with a size mismatch) and rewrote its
        ``config.yaml`` to say so.

        Raises:
            click.UsageError: ``--resume`` without ``--output-dir`` and no run to continue.
        """
        from .launch import CONFIG_FILE, resolve_output_dir

        if not self.resume or config_file is not None:
            return self, config_file
        try:
            run_dir = resolve_output_dir(self.output_dir, self.resume, self.command)
        except FileNotFoundError as e:
            raise click.UsageError(str(e)) from e
        saved = run_dir / CONFIG_FILE
        pinned = dataclasses.replace(self, output_dir=str(run_dir))
        return pinned, str(saved) if saved.is_file() else None

    def launch(self, config_file: str | None, overrides: Sequence[str]) -> Path:
        """The run directory this process runs in: ``--output-dir``; else with ``--resume`` the newest
        ``outputs/<command>-*`` run with a checkpoint; else a new ``outputs/<command>-<timestamp>``.

        With ``--nproc N > 1`` or several nodes, outside a launcher, this process runs ``N`` ranks of the command
        in that directory instead and exits with their status (the directory is checked once per node, not
        once per rank).

        Raises:
            click.UsageError: ``--resume`` without ``--output-dir`` and no run to continue.
            CheckpointError: the directory does not fit ``--resume`` / ``--overwrite`` (with ``--nproc``).
        """
        from .launch import check_run_dir, resolve_output_dir, spawn_ranks

        try:
            run_dir = resolve_output_dir(self.output_dir, self.resume, self.command)
        except FileNotFoundError as e:
            raise click.UsageError(str(e)) from e
        if self.spawns():
            check_run_dir(run_dir, resume=self.resume, overwrite=self.overwrite)
            arguments = self._rank_arguments(run_dir, config_file, overrides)
            sys.exit(spawn_ranks(self.nproc, arguments, self.command, run_dir, self.nodes))
        return run_dir

    def spawns(self) -> bool:
        """Whether this process launches ranks (``--nproc N > 1`` or several nodes, outside a launcher)."""
        from .launch import under_launcher

        return (self.nproc > 1 or self.nodes.several) and not under_launcher()

    def _rank_arguments(self, run_dir: Path, config_file: str | None, overrides: Sequence[str]) -> list[str]:
        return [
            *(["--config", config_file] if config_file else []),
            *["--output-dir", str(run_dir)],
            *(["--resume"] if self.resume else []),
            *(["--overwrite"] if self.overwrite else []),
            *overrides,
        ]


def run_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate the click command function of ``drivetrain <command>`` with the run options; it receives them
    as ``run=RunOptions(...)`` instead of one argument each."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def with_run(
            *,
            nproc: int,
            nnodes: int,
            node_rank: int,
            rdzv_endpoint: str | None,
            rdzv_timeout: int,
            output_dir: str | None,
            resume: bool,
            overwrite: bool,
            **kwargs: Any,
        ) -> Any:
            nodes = Nodes(
                nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout_s=rdzv_timeout
            )
            run = RunOptions(
                command=command,
                nproc=nproc,
                nodes=nodes,
                output_dir=output_dir,
                resume=resume,
                overwrite=overwrite,
            )
            run, kwargs["config_file"] = run.resumed(kwargs["config_file"])
            return function(run=run, **kwargs)

        for option in reversed(_options(command)):
            with_run = option(with_run)
        return with_run

    return decorate


def _options(command: str) -> tuple[Callable[[Callable[..., Any]], Callable[..., Any]], ...]:
    return (
        click.option(
            "--nproc",
            type=click.IntRange(min=1),
            default=1,
            help="Ranks to spawn on this node (ignored under torchrun).",
        ),
        click.option(
            "--nnodes",
            type=click.IntRange(min=1),
            default=1,
            help="Nodes of the launch (each runs this command).",
        ),
        click.option(
            "--node-rank",
            type=click.IntRange(min=0),
            default=0,
            help="This node's rank; node 0 hosts the rendezvous.",
        ),
        click.option(
            "--rdzv-endpoint", metavar="HOST:PORT", help="Node 0's address and a free port (c10d rendezvous)."
        ),
        click.option(
            "--rdzv-timeout",
            type=int,
            default=DEFAULT_TIMEOUT_S,
            metavar="SECONDS",
            help="Bound on the rendezvous and the shared run-folder check.",
        ),
        click.option(
            "--output-dir",
            type=click.Path(file_okay=False),
            help=f"Run directory [default: outputs/{command}-<timestamp>; with --resume the newest "
            f"outputs/{command}-* run].",
        ),
        click.option(
            "--resume", is_flag=True, help="Continue from the latest checkpoint of the run directory."
        ),
        click.option(
            "--overwrite",
            is_flag=True,
            help="Delete the checkpoints, final model and summary a previous run left in --output-dir and start over.",
        ),
    )
