"""``drivetrain sft``: the click command; torch and the trainer are imported only when it runs."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click
from drivetrain_engine_core.command_config import config_options

if TYPE_CHECKING:
    from .trainer import SFTResult


@click.command("sft", context_settings={"show_default": True})
@config_options("drivetrain_roles.sft.config:SFTConfig")
@click.option(
    "--nproc", type=click.IntRange(min=1), default=1, help="Ranks to spawn (ignored under torchrun)."
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False),
    help="Run directory [default: outputs/sft-<timestamp>; with --resume the newest outputs/sft-* run].",
)
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint of the run directory.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete the checkpoints a previous run left in --output-dir and start over.",
)
def sft(
    config_file: str | None,
    nproc: int,
    output_dir: str | None,
    resume: bool,
    overwrite: bool,
    overrides: tuple[str, ...],
) -> None:
    """Supervised fine-tuning; with no arguments, a tiny model learns addition on CPU in about a minute.

    OVERRIDES are dotted config values such as engine.micro_batch.max_tokens=512 or trainer.total_steps=100;
    --help-config lists every field, --print-config shows the resolved config.
    """
    from ..jobs.launch import check_run_dir, resolve_output_dir, spawn_ranks, under_launcher
    from .assets import check_model_path
    from .config import load_config

    if resume and overwrite:
        raise click.UsageError("--resume continues a run and --overwrite deletes its checkpoints: pass one.")
    # A bad config or model path fails here once, before any rank starts or any folder is made.
    check_model_path(load_config(config_file, overrides).model.path)
    try:
        run_dir = resolve_output_dir(output_dir, resume, "sft")
    except FileNotFoundError as e:
        raise click.UsageError(str(e)) from e
    if nproc > 1 and not under_launcher():
        check_run_dir(run_dir, resume=resume, overwrite=overwrite)  # once, not once per spawned rank
        arguments = [*(["--config", config_file] if config_file else []), "--output-dir", str(run_dir)]
        flags = [*(["--resume"] if resume else []), *(["--overwrite"] if overwrite else [])]
        sys.exit(spawn_ranks(nproc, [*arguments, *flags, *overrides], "sft"))
    run_here(config_file, str(run_dir), resume, overwrite, overrides)


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
