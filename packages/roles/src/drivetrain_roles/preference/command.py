"""``drivetrain dpo`` and ``drivetrain rm``: one click command per pairwise trainer, built by :func:`pair_command`.

torch and the trainers are imported only when a command runs, so registering them stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from ..jobs.run_options import RunOptions, run_options
from ..runtime.command_config import config_options


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
    @run_options(name)
    @config_options(config)
    def command(config_file: str | None, run: RunOptions, overrides: tuple[str, ...]) -> None:
        from ..jobs.assets import check_model_path

        loaded = _load(config, config_file, overrides)
        check_model_path(loaded.model.path)  # once, before any rank starts or any folder is made
        run_dir = run.launch(config_file, overrides)
        run_here(loaded, trainer, str(run_dir), run, summary_keys)

    return command


def run_here(
    config: Any, trainer: str, output_dir: str, run: RunOptions, summary_keys: tuple[str, ...]
) -> None:
    """Run this process's rank and print where the results are."""
    from drivetrain_engine_core import distributed
    from transformers.utils import logging as hf_logging

    from ..jobs.launch import agreed_output_dir

    hf_logging.disable_progress_bar()
    output_dir = agreed_output_dir(output_dir, config.engine)  # one timestamp under an outer torchrun
    result = _attr(trainer)(config, output_dir, resume=run.resume, overwrite=run.overwrite).run()
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
