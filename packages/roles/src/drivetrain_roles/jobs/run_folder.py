"""The run directory of a training job (``sft``, ``dpo``, ``rm``, ``grpo``): preparing it, checkpoints, resume.

Every job's batches are a function of the step and a few config values (the seed, the batch size: see
:class:`~drivetrain_roles.jobs.batches.StepSampler`). Each checkpoint stores those values next to its step, and
a resumed run with other values is refused; with the model, optimizer, LR schedule and RNG state the engine
restores, a resumed run therefore reproduces the uninterrupted one exactly, provided the data are the same:
each checkpoint also stores a fingerprint of the tokenised training data, and a resumed run on other data is
warned about (it goes on: a fixed typo is a reason to). :func:`begin_run` is what every job does first, the run
directory's preparation last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from drivetrain_engine_core.backend import CheckpointError, Engine, EngineConfig
from drivetrain_engine_core.job import complete_steps, step_dir_name, write_durably
from drivetrain_engine_core.kit import distributed

from ..command_sections import LoopConfig
from ..runtime.command_config import to_yaml
from ..runtime.heartbeat import Heartbeat
from ..runtime.tracking import METRICS_FILE
from .batches import check_batch_size
from .final_model import FINAL_MODEL_DIR
from .launch import CHECKPOINT_DIR, CONFIG_FILE, SUMMARY_FILE, check_run_dir

if TYPE_CHECKING:
    from .metrics import MetricsWriter

logger = logging.getLogger(__name__)
DATA_FINGERPRINT_KEY = "data_fingerprint"
HEARTBEAT_DIR = "heartbeat"


@dataclass(kw_only=True, frozen=True)
class RunFolder:
    """One run's directory, as a new run, an overwriting run or a resumed run sees it.

    Attributes:
        path: the run directory.
        resume: continue from the latest checkpoint in ``<path>/checkpoints`` (an error when there is none).
        overwrite: delete the checkpoints, final model and summary a previous run left in ``path`` and start
            over (without it, a new run refuses a directory that holds checkpoints).
        data_order: the config values the data order depends on, by dotted field name (``"trainer.seed"``);
            a checkpoint stores each under its last part (``seed``) and a resumed run must match them.
        data_fingerprint: the training data's :func:`data_fingerprint` once loaded (:meth:`for_data`).
    """

    path: Path
    resume: bool = False
    overwrite: bool = False
    data_order: Mapping[str, int] = field(default_factory=dict)
    data_fingerprint: str | None = None

    def heartbeat(self) -> Heartbeat:
        """This rank's heartbeat in ``<run>/heartbeat``: a job loop beats at its phases and runs inside
        ``naming_laggards``, so a collective timeout names the ranks behind instead of a bare transport error."""
        return Heartbeat(self.path / HEARTBEAT_DIR, distributed.rank(), distributed.world_size())

    def for_data(self, sequences: Iterable[Sequence[int]]) -> RunFolder:
        """This folder knowing the training data (their token ids), whose fingerprint its checkpoints store."""
        return dataclasses.replace(self, data_fingerprint=data_fingerprint(sequences))

    @property
    def checkpoint_root(self) -> Path:
        return self.path / CHECKPOINT_DIR

    def step_path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is published."""
        return self.checkpoint_root / step_dir_name(step)

    def checkpoint_at_most(self, step: int) -> Path | None:
        """The newest complete checkpoint of a step ``<= step``, if any."""
        earlier = [path for saved, path in complete_steps(self.checkpoint_root) if saved <= step]
        return earlier[-1] if earlier else None

    def prepare(self, config: Any) -> None:
        """Check the directory fits the request, clear the previous run's checkpoints and results for
        ``overwrite`` and, for a new run, write ``config.yaml`` (collective: rank 0 writes once every rank has
        checked). A resumed run writes it once its checkpoint has loaded (:meth:`write_config`).

        NOTE: the results go too, since until this run wrote its own, ``summary.json``, ``metrics.jsonl`` and
        ``final_model/`` described another run (and a crash left them looking like this run's). Other files are
        replaced as the run writes them; TensorBoard's view drops the previous run's events (see the tracker).

        Raises:
            CheckpointError: see :func:`~drivetrain_roles.jobs.launch.check_run_dir`.
        """
        check_run_dir(self.path, resume=self.resume, overwrite=self.overwrite)
        distributed.barrier()  # every rank checked before rank 0 deletes anything
        if distributed.rank() == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            if self.overwrite and not self.resume:
                shutil.rmtree(self.checkpoint_root, ignore_errors=True)
                shutil.rmtree(self.path / FINAL_MODEL_DIR, ignore_errors=True)
                (self.path / SUMMARY_FILE).unlink(missing_ok=True)
                (self.path / METRICS_FILE).unlink(missing_ok=True)
            if not self.resume:
                self.write_config(config)
        distributed.barrier()

    def write_config(self, config: Any) -> None:
        """Write ``config`` as the run's ``config.yaml`` (rank 0), what a later ``--resume`` starts from.

        NOTE: a resumed run calls this only once its checkpoint has loaded and matched the run: a resume
        refused there (another model, other data-order values) rewrote config.yaml with the overrides it was
        refused for, so the run no longer resumed as it was saved. Replaced whole or not at all: a torn
        config.yaml (a kill mid-write) made --resume build the run from whatever it still held, or from the
        defaults when it was empty.
        """
        if distributed.rank() == 0:
            write_durably(self.path / CONFIG_FILE, to_yaml(config))

    def start_step(self, engine: Engine) -> int:
        """The step to start from: 0, or when resuming the latest checkpoint's, loaded into ``engine``
        (:meth:`prepare` made sure there is one).

        Raises:
            CheckpointError: the checkpoint was trained with other ``data_order`` values.
        """
        if not self.resume:
            return 0
        state = engine.load_checkpoint(self.checkpoint_root)
        for name, value in self.data_order.items():
            saved = state.get(_state_key(name))
            if saved != value:
                raise CheckpointError(
                    f"the checkpoint in {self.checkpoint_root} was trained with {name}={saved}, this run has "
                    f"{value}; resume with the same value or start a new --output-dir."
                )
        self._compare_data(state.get(DATA_FINGERPRINT_KEY))
        return int(state["global_step"])

    def save(self, engine: Engine, step: int, metrics: MetricsWriter) -> None:
        """Checkpoint ``engine`` after ``step`` steps, with the data position (collective); the metric records
        up to ``step`` are made durable first, so a checkpoint never outlives the lines of its steps."""
        metrics.sync()
        position: dict[str, Any] = {
            "next_step": step,
            **{_state_key(name): v for name, v in self.data_order.items()},
        }
        if self.data_fingerprint is not None:
            position[DATA_FINGERPRINT_KEY] = self.data_fingerprint
        engine.save_checkpoint(self.checkpoint_root, step, extra_state=position)

    def _compare_data(self, saved: str | None) -> None:
        """Warn (rank 0) when the checkpoint was trained on other data than this run loaded.

        NOTE: the batches are drawn by position from the step, the seed and the data's size, so a changed,
        added or removed example (or another tokenizer) silently gave the resumed run other batches than the
        uninterrupted one's; it is allowed (fixing the data is a reason to resume), but said.
        """
        if saved is None or self.data_fingerprint is None or saved == self.data_fingerprint:
            return
        if distributed.rank() == 0:
            logger.warning(
                "the training data differ from those the checkpoint in %s was trained on (data fingerprint %s, "
                "now %s: a changed, added or removed example, or another tokenizer); the resumed run goes on, but "
                "its batches are not the uninterrupted run's. Resume with the original data to reproduce it.",
                self.checkpoint_root,
                saved,
                self.data_fingerprint,
            )


def begin_run(
    folder: RunFolder, config: Any, *, engine: EngineConfig, trainer: LoopConfig, batch: tuple[str, int]
) -> None:
    """What every job does before any work: join the process group, set the CPU threads, check that the
    data-parallel ranks can split the batch (``(setting, size)``: before a warm start or any file), prepare the
    run directory.

    Raises:
        DataError: the batch does not split over the data-parallel ranks.
        CheckpointError: the directory does not fit ``resume`` / ``overwrite``.
    """
    distributed.init_distributed(engine.device, engine.dist_timeout_s)
    if engine.device == "cpu" and trainer.cpu_threads is not None:
        torch.set_num_threads(trainer.cpu_threads)
    check_batch_size(*batch, engine)
    folder.prepare(config)


def _state_key(name: str) -> str:
    # The last part of the field name, as checkpoints written before the fields were named in full hold it.
    return name.rpartition(".")[2]


def data_fingerprint(sequences: Iterable[Sequence[int]]) -> str:
    """A short hash of tokenised data (each sequence's token ids, in order): equal data, equal fingerprint."""
    digest = hashlib.sha256()
    for ids in sequences:
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(array("q", ids).tobytes())
    return digest.hexdigest()[:16]
