"""The policy GRPO starts from: a model directory, or for the embedded job a short SFT run's ``final_model``."""

from __future__ import annotations

from pathlib import Path

from ..jobs.assets import model_directory
from ..jobs.builtin_tasks import builtin_task
from ..jobs.resume_start import check_or_record_start
from ..sft.config import SFTConfig, warm_start_trainer
from .job_config import RolloutJobConfig


def start_model(config: RolloutJobConfig, output_dir: Path, *, resume: bool) -> str:
    """The local directory of ``model.path`` (a Hub id's cached snapshot), or for an embedded task
    (``builtin:<name>``) the ``final_model`` of an SFT warm start.

    The warm start is ``drivetrain sft`` for ``trainer.warm_start_steps`` steps in ``<run>/warm_start`` (same
    engine, data and seed): a resumed GRPO run reuses the one its first part finished, any other run makes
    its own (:func:`~drivetrain_roles.sft.warm_start.run_warm_start`). A resumed run is first checked against
    the start its ``config.yaml`` records, before anything loads or writes: the actor resumes from the
    checkpoint, but the KL reference (and PPO's critic start) would come from the asked model.

    Raises:
        CheckpointError: a resume asks for another ``model.path`` than the run started from.
        ModelPathError: ``model.path`` is neither a local Hugging Face model directory nor a cached Hub
            repository.
    """
    check_or_record_start(output_dir, config.model.path, resume=resume)
    if builtin_task(config.model.path) is None:
        return model_directory(config.model.path)
    from ..sft.warm_start import run_warm_start

    final_model, _ = run_warm_start(
        _warm_start_config(config),
        output_dir,
        reuse=resume,
        batch_size_setting="trainer.warm_start_batch_size",
    )
    return final_model


def _warm_start_config(config: RolloutJobConfig) -> SFTConfig:
    trainer = warm_start_trainer(
        config.trainer,
        steps=config.trainer.warm_start_steps,
        batch_size=config.trainer.warm_start_batch_size,
        max_new_tokens=config.rollout.max_new_tokens,
    )
    return SFTConfig(model=config.model, engine=config.engine, data=config.data, trainer=trainer)
