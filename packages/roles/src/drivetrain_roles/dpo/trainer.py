"""``drivetrain dpo``: Direct Preference Optimisation (sigmoid, IPO, reference-free) of a causal LM.

The reference log-probs of each sequence come from the starting model: scored once before training
(``dpo.reference=precomputed``), by a frozen copy in its own inference engine each step (``engine``), or by
the actor with its LoRA adapters disabled (``lora_base``). Held-out evaluation adds the greedy exact-match
accuracy of the chosen answers to the loss metrics (``rewards/accuracies`` is the preference accuracy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import LossFn
from drivetrain_engine_core.kit import distributed
from tensordict import TensorDict

from ..held_out_metrics import HeldOutMetrics
from ..jobs.curves import Curves, Panel, Series, train_and_held_out
from ..jobs.evaluate import greedy_evaluation
from ..jobs.final_model import save_final_model
from ..losses.aggregation import FlatTokens
from ..losses.preference import REF_LOGP, dpo_loss_fn
from ..output_ranks import require_outputs_on_every_rank
from ..preference.batches import make_pair_batch
from ..preference.data import PairExample
from ..preference.trainer import PairTrainer
from ..reference import Reference

PRECOMPUTE_CHUNK = 256
"""Pairs scored per reference forward pass when the reference is precomputed."""

CURVES = Curves(
    (
        Panel(title="DPO loss ({loss_type}, beta={beta})", series=train_and_held_out("loss"), log_scale=True),
        Panel(
            title="preference accuracy: chosen reward > rejected reward",
            series=train_and_held_out("rewards/accuracies"),
            fraction=True,
        ),
        Panel(
            title="reward margin: beta * (chosen - rejected log-ratio to the reference)",
            series=train_and_held_out("rewards/margins"),
        ),
        Panel(
            title="held-out exact match of greedy answers to the chosen ones (a side measure)",
            series=(Series(key="val/accuracy", label="held-out", style="s-"),),
            fraction=True,
        ),
    )
)
"""What a DPO run's curve shows: the loss, then TRL's preference accuracy and reward margins."""


class DPOTrainer(PairTrainer):
    """DPO on preference pairs; greedy exact-match accuracy on the held-out chosen answers."""

    command = "dpo"
    model_type = "language_model"
    report_keys = ("val/loss", "val/rewards/accuracies", "val/rewards/margins", "val/accuracy")
    curves = CURVES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reference: Reference | None = None
        self.ref_logps: dict[int, tuple[float, float]] = {}
        self.measures = HeldOutMetrics.load(self.trainer.eval_metrics)

    def _prepare(self, engine: Engine, model_path: str, tokenizer: Any) -> None:
        settings = self.config.dpo
        if settings.reference_free:
            return
        require_outputs_on_every_rank(engine, f"drivetrain dpo with dpo.reference={settings.reference}")
        if settings.reference == "engine":
            self.reference = Reference(self._build_engine(model_path, None))
        elif settings.reference == "lora_base":
            self.reference = Reference(engine, use_actor_base=True)
        else:
            self._precompute(Reference(engine))

    def _precompute(self, reference: Reference) -> None:
        """Score every pair once with the starting weights; every rank ends with every pair's values."""
        rank, size = distributed.rank(), distributed.world_size()
        uids = sorted(self.uids)
        for start in range(0, len(uids), PRECOMPUTE_CHUNK):
            chunk = uids[start : start + PRECOMPUTE_CHUNK]
            # NOTE: a short last chunk leaves some ranks without a pair; they score the chunk's first pair and
            # keep nothing, since every rank must run the collective forward.
            mine = chunk[rank::size]
            scoring = mine or chunk[:1]
            sums = reference_sums(
                reference, make_pair_batch([self.uids[u] for u in scoring], scoring)
            ).tolist()
            scored = {u: (sums[2 * i], sums[2 * i + 1]) for i, u in enumerate(mine)}
            for part in distributed.all_gather_objects(scored):
                self.ref_logps.update(part)  # type: ignore[call-overload]

    def _loss_fn(self) -> LossFn:
        return dpo_loss_fn(self.config.dpo)

    def _curve_fields(self) -> dict[str, str]:
        return {"loss_type": self.config.dpo.loss_type, "beta": f"{self.config.dpo.beta:g}"}

    def _curve_panels(self) -> tuple[Panel, ...]:
        return () if self.measures is None else (self.measures.panel,)

    def _batch(self, engine: Engine, uids: list[int]) -> TensorDict:
        pairs = [self.uids[u] for u in uids]
        if self.config.dpo.reference_free:
            return make_pair_batch(pairs, uids)
        if self.reference is not None:
            batch = make_pair_batch(pairs, uids)
            batch[REF_LOGP] = reference_sums(self.reference, batch)
            return batch
        logps = torch.tensor([value for u in uids for value in self.ref_logps[u]])
        return make_pair_batch(pairs, uids, ref_logps=logps)

    def _extra_eval(
        self, engine: Engine, tokenizer: Any, model_path: str, pairs: list[PairExample]
    ) -> dict[str, float]:
        samples = [p.chosen for p in pairs[: self.trainer.eval_samples]]
        if not samples:
            return {}
        return greedy_evaluation(
            engine,
            samples,
            tokenizer,
            max_new_tokens=self.trainer.max_new_tokens,
            model_path=model_path,
            progress=self.trainer.progress_bar,
            measures=self.measures,
        )

    def _export(self, engine: Engine, model_path: str, tokenizer: Any, target: Path) -> None:
        save_final_model(engine, model_path, tokenizer, target, max_new_tokens=self.trainer.max_new_tokens)


def reference_sums(reference: Reference, batch: TensorDict) -> torch.Tensor:
    """``(n,)`` the reference's summed log-prob of each sequence's loss tokens (collective)."""
    scored = reference.compute_ref_log_prob(batch)
    if scored is None:
        raise NotImplementedError(
            "DPO reference log-probs need the outputs on every rank; this backend keeps them on output ranks only."
        )
    tokens = FlatTokens.from_jagged(batch["loss_mask"])
    return tokens.per_sequence_sum(scored["ref_log_prob"].values()).detach()
