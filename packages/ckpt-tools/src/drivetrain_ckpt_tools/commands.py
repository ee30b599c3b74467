"""The ``drivetrain ckpt`` command group: ``ls``, ``merge`` and ``verify``.

Heavy modules (torch, transformers, the backends) are imported inside each command, so that building the CLI
and ``drivetrain --help`` stay fast.
"""

from __future__ import annotations

import json

import click


def _fail(error: Exception) -> None:
    """Turn a drivetrain error into a one-line CLI error (exit status 1), without a traceback."""
    raise click.ClickException(str(error)) from error


@click.group(name="ckpt")
def ckpt() -> None:
    """Inspect, merge and verify drivetrain checkpoints."""


@ckpt.command(name="ls")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--check", is_flag=True, help="Also verify every file's size and SHA-256 against the manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls_command(root: str, check: bool, as_json: bool) -> None:
    """List the steps under ROOT: completeness, backend, world size, contents.

    With ``--check`` the exit status is 1 when a published step fails the file check, so a script can rely on it.
    """
    from drivetrain_engine_core.backend import DrivetrainError

    from .inspect import format_steps, list_steps

    try:
        steps = list_steps(root, check_files=check)
    except DrivetrainError as e:
        _fail(e)
    click.echo(json.dumps([s.to_dict() for s in steps], indent=2) if as_json else format_steps(steps))
    damaged = [s for s in steps if s.damaged]
    if damaged:
        raise click.ClickException(
            "the file check failed for "
            + "; ".join(f"step {s.global_step} ({s.path}): {s.problem}" for s in damaged)
        )


@ckpt.command(name="merge")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path())
@click.option(
    "--merge-lora", is_flag=True, help="Fold LoRA adapters into the base model instead of writing an adapter."
)
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="Safetensors shard size, e.g. 500MB."
)
@click.option(
    "--no-checksums", is_flag=True, help="Check file sizes only, not SHA-256 (faster on huge steps)."
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default=None,
    help="Cast the weights (e.g. bfloat16 for the source model's size); default: as the checkpoint holds them.",
)
@click.option(
    "--model-path",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="The model the checkpoint starts from, when it has moved since training (default: the manifest's).",
)
def merge_command(
    src: str,
    dst: str,
    merge_lora: bool,
    overwrite: bool,
    max_shard_size: str,
    no_checksums: bool,
    dtype: str | None,
    model_path: str | None,
):
    """Merge checkpoint step SRC (or the latest step of a root) into a Hugging Face directory DST."""
    from drivetrain_engine_core.backend import DrivetrainError

    from .merge import MergeOptions, merge_checkpoint
    from .writer import parse_size

    try:
        options = MergeOptions(
            merge_lora=merge_lora,
            overwrite=overwrite,
            max_shard_bytes=parse_size(max_shard_size),
            verify_checksums=not no_checksums,
            dtype=dtype,
            model_path=model_path,
        )
        result = merge_checkpoint(src, dst, options, progress=True)
    except (DrivetrainError, ValueError) as e:
        _fail(e)
    click.echo(f"merged {result.step_dir} -> {result.destination} ({result.kind}: {', '.join(result.files)})")


@ckpt.command(name="verify")
@click.argument("dst", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--against",
    "src",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The step DST came from.",
)
@click.option("--tolerance", default=1e-5, show_default=True, help="Largest allowed absolute difference.")
@click.option("--device", default="cpu", show_default=True, help="Device to run both models on.")
@click.option(
    "--model-path",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="The model the checkpoint starts from, when it has moved since training (default: the manifest's).",
)
def verify_command(dst: str, src: str, tolerance: float, device: str, model_path: str | None) -> None:
    """Compare DST (loaded by transformers) with the engine's own outputs from checkpoint SRC."""
    from drivetrain_engine_core.backend import DrivetrainError

    from .verify import verify_merged

    try:
        result = verify_merged(dst, src, tolerance=tolerance, device=device, model_path=model_path)
    except DrivetrainError as e:
        _fail(e)
    details = ", ".join(f"{key} {diff:.3e}" for key, diff in result.per_output.items())
    click.echo(f"max abs diff {result.max_abs_diff:.3e} over {result.num_tokens} tokens ({details})")
    if not result.passed:
        raise click.ClickException(
            f"max abs diff {result.max_abs_diff:.3e} exceeds the tolerance {tolerance:g}."
        )


__all__ = ["ckpt"]
