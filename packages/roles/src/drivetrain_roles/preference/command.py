"""``drivetrain dpo`` and ``drivetrain rm``: one click command per pairwise trainer, built by :func:`pair_command`.

torch and the trainers are imported only when a command runs, so registering them stays cheap.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click
from drivetrain_engine_core.command_config import config_options

"""Entry module of a spawned rank: ``python -m drivetrain_roles.preference.rank_main <command> ...``."""


def pair_command(
    name: str, *, config: str, trainer: str, summary_keys: tuple[str, ...], doc: str
) -> click.Command:
    """The click command ``name`` running ``trainer`` (``"module:Class"``) on the config ``config`` (same form).

    Args:
        name: command name (also the run-folder prefix ``outputs/<name>-<timestamp>``).
        config: the config dataclass's ``"module:attr"`` path; the module has ``load_config``.
        trainer: the trainer class's ``"module:attr"`` path.
        summary_keys: held-out measures printed at the end (first -> last evaluation).
        doc: the command's help text.
    """

    @click.command(name, context_settings={"show_default": True}, help=doc)
    @config_options(config)
    @click.option(
        "--nproc", type=click.IntRange(min=1), default=1, help="Ranks to spawn (ignored under torchrun)."
    )
    @click.option(
        "--output-dir",
        type=click.Path(file_okay=False),
        help=f"Run directory [default: outputs/{name}-<timestamp>].",
    )
    @click.option(
        "--overwrite", is_flag=True, help="Delete the checkpoints a previous run left in --output-dir."
    )
    def command(
        config_file: str | None,
        nproc: int,
        output_dir: str | None,
        overwrite: bool,
        overrides: tuple[str, ...],
    ) -> None:
        from ..jobs.launch import check_run_dir, resolve_output_dir, spawn_ranks, under_launcher
        from ..sft.assets import check_model_path

        loaded = _load(config, config_file, overrides)
        check_model_path(loaded.model.path)  # once, before any rank starts or any folder is made
        run_dir = resolve_output_dir(output_dir, False, name)
        if nproc > 1 and not under_launcher():
            check_run_dir(run_dir, resume=False, overwrite=overwrite)
            arguments = [
                *(["--config", config_file] if config_file else []),
                "--output-dir",
                str(run_dir),
            ]
            sys.exit(
                spawn_ranks(nproc, [*arguments, *(["--overwrite"] if overwrite else []), *overrides], name)
            )
        run_here(loaded, trainer, str(run_dir), overwrite, summary_keys)

    return command


def run_here(
    config: Any, trainer: str, output_dir: str, overwrite: bool, summary_keys: tuple[str, ...]
) -> None:
    """Run this process's rank and print where the results are."""
    from drivetrain_engine_core import distributed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    distributed.init_distributed(config.engine.device, config.engine.dist_timeout_s)
    output_dir = str(distributed.broadcast_object(output_dir))  # one timestamp under an outer torchrun
    result = _attr(trainer)(config, output_dir, overwrite=overwrite).run()
    if distributed.rank() == 0:
        click.echo(summary(result, summary_keys))


def summary(result: Any, keys: tuple[str, ...]) -> str:
    """The lines printed at the end of a run: held-out measures from the first to the last evaluation."""
    lines = [f"run directory: {result.output_dir} ({result.seconds:.0f} s)"]
    if result.warm_start:
        lines.append("warm start (SFT): " + ", ".join(f"{k}={v:.4f}" for k, v in result.warm_start.items()))
    if result.evaluations:
        first, last = result.evaluations[0], result.evaluations[-1]
        for key in keys:
            if key in first:
                lines.append(
                    f"{key}: {first[key]:.4f} (step {first['step']}) -> {last[key]:.4f} (step {last['step']})"
                )
    lines.append(
        f"trained model: {result.output_dir}/final_model (plain Hugging Face folder, with tokenizer)"
    )
    lines.append(f"metrics: {result.output_dir}/metrics.jsonl, curve: {result.output_dir}/loss_curve.png")
    return "\n".join(lines)


def _load(config: str, config_file: str | None, overrides: tuple[str, ...]) -> Any:
    module = importlib.import_module(config.partition(":")[0])
    return module.load_config(config_file, overrides)


def _attr(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


dpo = pair_command(
    "dpo",
    config="drivetrain_roles.dpo.config:DPOConfig",
    trainer="drivetrain_roles.dpo.trainer:DPOTrainer",
    summary_keys=("val/loss", "val/rewards/accuracies", "val/rewards/margins", "val/accuracy"),
    doc="Direct Preference Optimisation; with no arguments, an SFT warm start of a tiny model on addition, then "
    "DPO on correct-vs-wrong answers, on CPU in a few minutes.\n\nOVERRIDES are dotted config values such as "
    "dpo.beta=0.2 or dpo.loss_type=ipo; --help-config lists every field.",
)

rm = pair_command(
    "rm",
    config="drivetrain_roles.rm.config:RMConfig",
    trainer="drivetrain_roles.rm.trainer:RMTrainer",
    summary_keys=("val/loss", "val/accuracy", "val/margin"),
    doc="Bradley-Terry reward model; with no arguments, an SFT warm start of a tiny model on addition, then a "
    "reward model of correct-vs-wrong answers, on CPU in a few minutes.\n\nOVERRIDES are dotted config values "
    "such as trainer.total_steps=100; --help-config lists every field.",
)
