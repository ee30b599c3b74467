"""A step's full training state under Hugging Face names: what a checkpoint of one backend or layout hands another.

Every backend already maps its parameters to and from Hugging Face names (to export, to merge, to load a
model). Resuming across backends and layouts reuses exactly that: the source backend's checkpoint merger
streams the step's weights and Adam moments (``exp_avg``, ``exp_avg_sq``) as full tensors under Hugging Face
names, with fused QKV and gate/up split and vocabulary padding trimmed, and the target backend maps them onto
its own parameters and optimizer with the same transforms it uses to load a Hugging Face model (the
``hf_state_resume`` capability's ``_load_hf_state`` hook). One reader, one hook per backend; no converter
per pair of backends.

NOTE: Adam moments are elementwise, so every layout transform of a weight (a row permutation for fused QKV, a
concatenation for gate/up, row padding for the vocabulary) applies to its moments unchanged; padded vocabulary
rows get zero moments, as they had (their gradient is zero).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from .._errors import CheckpointError
from .manifest import Manifest
from .merger import CheckpointMerger

WEIGHT = "weight"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
"""The per-parameter AdamW state that moves with the weights (the step count moves as one number)."""
_SHOWN = 5

MergerLookup = Callable[[str], type[CheckpointMerger]]
"""How a step of another backend finds that backend's merger: the plugin registry's ``mergers.get``, which the
engine factory hands each engine (the registry sits above the engine, which sits above the checkpoint code)."""


class HFTrainingState:
    """The weights, Adam moments and Adam step of one checkpoint step, under Hugging Face names.

    Read offline (no process group) through the source backend's :class:`CheckpointMerger`; every rank of the
    target reads what it needs. Each part is read once, in full, on first use.

    Args:
        merger: the source step's merger (its backend's, from the plugin registry).
    """

    def __init__(self, merger: CheckpointMerger) -> None:
        self.merger = merger
        self.step_dir = merger.step_dir
        self.manifest = merger.manifest
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def from_step(cls, step_dir: Path, manifest: Manifest, mergers: MergerLookup | None) -> HFTrainingState:
        """The state of ``step_dir``, read by the merger its manifest's backend registers.

        Args:
            step_dir: the step folder.
            manifest: its manifest (``manifest.backend`` names the backend that wrote it).
            mergers: backend name -> its merger class; ``None`` where the engine was built without one.

        Raises:
            CheckpointError: the step holds LoRA adapters (they do not move across backends yet).
            PluginError: no merger is installed for the step's backend.
        """
        if mergers is None:
            raise CheckpointError(
                f"{step_dir} was written by the {manifest.backend!r} backend, and this engine was built without "
                "a way to find that backend's checkpoint merger: build it with drivetrain_engine_core.job."
                "create_engine, which hands it the installed backends' mergers (or pass "
                "mergers=plugins().mergers.get to the engine's constructor)."
            )
        if manifest.lora is not None:
            raise CheckpointError(
                f"{step_dir} holds LoRA adapters (model.lora, {manifest.backend} backend, world size "
                f"{manifest.world_size}); "
                "LoRA training state does not move across backends or layouts. Resume with the backend and "
                f"layout that wrote it, or merge it (`drivetrain ckpt merge {step_dir} OUT --lora merged`) and "
                "start a new run from OUT."
            )
        return cls(mergers(manifest.backend)(step_dir, manifest))

    def tensors(self, part: str) -> dict[str, torch.Tensor]:
        """``hf_name -> full tensor`` of ``part``: ``"weight"`` or an Adam moment (``"exp_avg"``, ...).

        NOTE: each rank holds one part in full while it maps it onto its shards (a model's weights, or one
        moment, in float32): the price of reading any source layout without its process groups.
        """
        if part not in self._parts:
            self._parts[part] = _read(self.merger, part)
        return self._parts[part]

    def release(self, part: str) -> None:
        """Drop ``part`` once the target holds it."""
        self._parts.pop(part, None)

    def adam_step(self) -> int:
        """How many AdamW updates the step's optimizer state has taken (its bias correction)."""
        return self.merger.adam_step()

    def check_fits(self, expected: Mapping[str, tuple[int, ...]], *, tied: Mapping[str, str] = {}) -> None:
        """Refuse a step whose weights do not map onto the target model, before any tensor is loaded.

        Args:
            expected: Hugging Face name -> shape of every weight the target model has.
            tied: names the target may fill from another (``lm_head.weight`` from the embedding of a model
                with tied embeddings, which a source may store once).

        Raises:
            CheckpointError: naming the first tensor whose shapes differ (both shapes), or the missing and
                unexpected names.
        """
        shapes = {name: tuple(tensor.shape) for name, tensor in self.tensors(WEIGHT).items()}
        for name, source in tied.items():
            if name not in shapes and source in shapes:
                shapes[name] = shapes[source]
        missing = sorted(set(expected) - set(shapes))
        unexpected = sorted(set(shapes) - set(expected) - set(tied) - set(tied.values()))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.step_dir} ({self.manifest.backend} backend) holds another model: the model being trained "
                f"lacks {_names(unexpected)} and the checkpoint lacks {_names(missing)}. Resume with the model "
                f"it was trained from ({self.manifest.model_path})."
            )
        for name, shape in sorted(expected.items()):
            if tuple(shape) != shapes[name]:
                raise CheckpointError(
                    f"{self.step_dir} ({self.manifest.backend} backend) holds another model: tensor {name!r} has "
                    f"shape {list(shapes[name])} there and {list(shape)} in the model being trained. Resume with "
                    f"the model it was trained from ({self.manifest.model_path})."
                )


def _read(merger: CheckpointMerger, part: str) -> dict[str, torch.Tensor]:
    if part == WEIGHT:
        return dict(merger.base_tensors())
    if part not in ADAM_MOMENTS:
        raise ValueError(f"HFTrainingState: part must be {WEIGHT!r} or one of {ADAM_MOMENTS}, got {part!r}.")
    return dict(merger.optimizer_tensors(part))


def _names(names: list[str]) -> str:
    if not names:
        return "nothing"
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{names[:_SHOWN]}{more}"


__all__ = ["ADAM_MOMENTS", "WEIGHT", "HFTrainingState", "MergerLookup"]
