"""The command factory: ``drivetrain <name>`` from a :class:`~.job.TrainingJob` subclass, in one call.

``job_command("sft", job="drivetrain_roles.sft.trainer:SFTTrainer", config="drivetrain_roles.sft.config:SFTConfig",
help=...)`` is the whole command: the run options (``--nproc``, ``--output-dir``, ``--resume``, ``--overwrite``),
the config options (``--config``, ``--print-config``, ``--help-config``, ``OVERRIDES``), the checks made once
before any rank starts, the launch, this process's rank of the job and the lines printed at the end. The job
and the config are named ``"module:attr"`` so that torch and the job are imported only when the command runs
(registering commands stays cheap); a class works too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..runtime.command_config import config_options
from ..runtime.command_config.options import resolve_target
from .run_options import RunOptions, run_options


def job_command(name: str, *, job: str | type, config: str | type, help: str) -> click.Command:
    """The click command ``drivetrain <name>`` running ``job`` on the config ``config``.

    Args:
        name: the command's name, under which it is registered (the run-folder prefix
            ``outputs/<name>-<timestamp>``; spawned ranks find it by it: ``python -m
            drivetrain_roles.jobs.rank_entry <name>``).
        job: the :class:`~.job.TrainingJob` subclass, or its ``"module:attr"`` path.
        config: the config dataclass (sections ``model``, ``engine``, ``trainer``, ...), or its ``"module:attr"``
            path.
        help: the command's help text.
    """

    @click.command(name, context_settings={"show_default": True}, help=help)
    @run_options(name)
    @config_options(config)
    def command(config_file: str | None, run: RunOptions, overrides: tuple[str, ...]) -> None:
        from .launch import quiet_torch_cpp_logs

        if run.spawns():
            quiet_torch_cpp_logs()  # before anything imports torch
        from .assets import check_model_path

        loaded = _load_config(config, config_file, overrides)
        check_model_path(loaded.model.path)  # once, before any rank starts or any folder is made
        run_dir = run.launch(config_file, overrides)
        run_here(loaded, resolve_target(job), str(run_dir), run)

    return command


def run_here(config: Any, job: type, output_dir: str, run: RunOptions) -> None:
    """Run this process's rank of ``job`` and print (rank 0) where the results are, or, when Ctrl-C stopped
    it, the checkpoint it saved."""
    from drivetrain_engine_core.kit import distributed
    from transformers.utils import logging as hf_logging

    from .interrupt import RunInterrupted, hand_over
    from .launch import agreed_output_dir
    from .shared_folder import check_shared_run_dir

    hf_logging.disable_progress_bar()  # one progress bar (ours) on the console
    output_dir = agreed_output_dir(output_dir, config.engine)  # one timestamp under an outer torchrun
    check_shared_run_dir(Path(output_dir))  # before anything is written: one folder every rank sees
    instance = job(config, output_dir, resume=run.resume, overwrite=run.overwrite)
    try:
        result = instance.run()
    except RunInterrupted as e:  # Ctrl-C, with the checkpoint saved: its one line, status 130
        raise SystemExit(hand_over(instance.command, e)) from None
    if distributed.rank() == 0:
        click.echo(instance.report(result))


def _load_config(config: str | type, config_file: str | None, overrides: tuple[str, ...]) -> Any:
    from ..runtime.command_config import load_config

    return load_config(resolve_target(config), config_file, overrides)


__all__ = ["job_command", "run_here"]
