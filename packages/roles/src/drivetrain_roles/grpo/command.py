"""``drivetrain grpo``: the click command; torch and the trainer are imported only when it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..jobs.run_options import RunOptions, run_options
from ..runtime.command_config import config_options

if TYPE_CHECKING:
    from .trainer import GRPOResult


@click.command("grpo", context_settings={"show_default": True})
@run_options("grpo")
@config_options("drivetrain_roles.grpo.config:GRPOConfig")
def grpo(config_file: str | None, run: RunOptions, overrides: tuple[str, ...]) -> None:
    """GRPO; with no arguments, the arithmetic model is warmed up by SFT, then learns from exact-answer rewards.

    OVERRIDES are dotted config values such as rollout.n=8 or trainer.total_steps=100; --help-config lists
    every field, --print-config shows the resolved config.
    """
    from ..jobs.assets import check_model_path
    from .config import load_config

    check_model_path(load_config(config_file, overrides).model.path)
    run_dir = run.launch(config_file, overrides)
    _run_here(config_file, str(run_dir), run.resume, run.overwrite, overrides)


def _run_here(
    config_file: str | None, output_dir: str, resume: bool, overwrite: bool, overrides: tuple[str, ...]
) -> None:
    from drivetrain_engine_core import distributed
    from transformers.utils import logging as hf_logging

    from ..jobs.launch import agreed_output_dir
    from .config import load_config
    from .trainer import GRPOTrainer

    hf_logging.disable_progress_bar()
    config = load_config(config_file, overrides)
    run_dir = agreed_output_dir(output_dir, config.engine)
    result = GRPOTrainer(config, run_dir, resume=resume, overwrite=overwrite).run()
    if distributed.rank() == 0:
        click.echo(_summary(result))


def _summary(result: GRPOResult) -> str:
    lines = [f"run directory: {result.output_dir}"]
    if result.evaluations:
        first, last = result.evaluations[0], result.evaluations[-1]
        lines.append(
            f"val/accuracy: {first['val/accuracy']:.4f} (step {first['step']}) -> {last['val/accuracy']:.4f} "
            f"(step {last['step']}) in {result.seconds:.0f} s of GRPO"
        )
    lines.append(
        f"trained model: {result.output_dir}/final_model (plain Hugging Face folder, with tokenizer)"
    )
    lines.append(f"metrics: {result.output_dir}/metrics.jsonl, curve: {result.output_dir}/reward_curve.png")
    return "\n".join(lines)
