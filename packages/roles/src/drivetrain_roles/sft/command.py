"""``drivetrain sft``: the click command; torch and the trainer are imported only when it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..jobs.run_options import RunOptions, run_options
from ..runtime.command_config import config_options

if TYPE_CHECKING:
    from .trainer import SFTResult


@click.command("sft", context_settings={"show_default": True})
@run_options("sft")
@config_options("drivetrain_roles.sft.config:SFTConfig")
def sft(config_file: str | None, run: RunOptions, overrides: tuple[str, ...]) -> None:
    """Supervised fine-tuning; with no arguments, a tiny model learns addition on CPU in about a minute.

    OVERRIDES are dotted config values such as engine.micro_batch.max_tokens=512 or trainer.total_steps=100;
    --help-config lists every field, --print-config shows the resolved config.
    """
    from ..jobs.assets import check_model_path
    from .config import load_config

    # A bad config or model path fails here once, before any rank starts or any folder is made.
    check_model_path(load_config(config_file, overrides).model.path)
    run_dir = run.launch(config_file, overrides)
    run_here(config_file, str(run_dir), run.resume, run.overwrite, overrides)


def run_here(
    config_file: str | None, output_dir: str, resume: bool, overwrite: bool, overrides: tuple[str, ...]
) -> None:
    """Run this process's rank of the job and print where the results are."""
    from drivetrain_engine_core import distributed
    from transformers.utils import logging as hf_logging

    from ..jobs.launch import agreed_output_dir
    from .config import load_config
    from .trainer import SFTTrainer

    hf_logging.disable_progress_bar()  # one progress bar (ours) on the console
    config = load_config(config_file, overrides)
    run_dir = agreed_output_dir(output_dir, config.engine)
    result = SFTTrainer(config, run_dir, resume=resume, overwrite=overwrite).run()
    if distributed.rank() == 0:
        click.echo(_summary(result))


def _summary(result: SFTResult) -> str:
    lines = [f"run directory: {result.output_dir}"]
    if result.evaluations:
        first, last = result.evaluations[0], result.evaluations[-1]
        for key in ("val/loss", "val/accuracy"):
            if key in first:
                lines.append(
                    f"{key}: {first[key]:.4f} (step {first['step']}) -> {last[key]:.4f} (step {last['step']})"
                )
    if result.train_losses:
        lines.append(f"train/loss at the last step: {result.train_losses[-1]:.4f}")
    lines.append(
        f"trained model: {result.output_dir}/final_model (plain Hugging Face folder, with tokenizer)"
    )
    lines.append(f"metrics: {result.output_dir}/metrics.jsonl, curve: {result.output_dir}/loss_curve.png")
    return "\n".join(lines)
