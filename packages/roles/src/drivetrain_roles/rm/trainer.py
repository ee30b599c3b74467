"""``drivetrain rm``: a Bradley-Terry reward model, a value head scoring the last response token of each side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import LossFn
from tensordict import TensorDict

from ..jobs.curves import Curves, Panel, train_and_held_out
from ..losses.preference import bradley_terry_loss_fn
from ..preference.batches import make_pair_batch
from ..preference.data import PairExample
from ..preference.trainer import PairTrainer
from .export import VALUE_START_DIR, export_reward_model, write_value_model_start

CURVES = Curves(
    (
        Panel(
            title="Bradley-Terry loss: -log sigmoid(score chosen - score rejected)",
            series=train_and_held_out("loss"),
            log_scale=True,
        ),
        Panel(
            title="pairwise accuracy: chosen scored above rejected",
            series=train_and_held_out("accuracy"),
            fraction=True,
        ),
        Panel(title="score margin: chosen - rejected", series=train_and_held_out("margin")),
    )
)
"""What a reward model's curve shows: its loss, pairwise accuracy and score margin."""


class RMTrainer(PairTrainer):
    """Reward modelling on preference pairs; held-out pairwise accuracy; exported for sequence classification."""

    command = "rm"
    model_type = "value_model"
    report_keys = ("val/loss", "val/accuracy", "val/margin")
    curves = CURVES

    def _start_model(self, start_model: str) -> str:
        return write_value_model_start(
            start_model, self.output_dir / VALUE_START_DIR, resume=self.folder.resume
        )

    def _prepare(self, engine: Engine, model_path: str, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        # Any in-vocabulary id: causal attention keeps it from changing the score it reads out.
        self.readout_token = next(
            (t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None), 0
        )

    def _loss_fn(self) -> LossFn:
        return bradley_terry_loss_fn(self.config.rm)

    def _batch(self, engine: Engine, uids: list[int]) -> TensorDict:
        return make_pair_batch(
            [self.uids[u] for u in uids],
            uids,
            readout_token=self.readout_token,
            eos_token_id=self.eos_token_id,
        )

    def _extra_eval(
        self, engine: Engine, tokenizer: Any, model_path: str, pairs: list[PairExample]
    ) -> dict[str, float]:
        return {}

    def _export(self, engine: Engine, model_path: str, tokenizer: Any, target: Path) -> None:
        export_reward_model(engine, model_path, tokenizer, target)
