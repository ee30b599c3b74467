"""The interface a backend implements so that ckpt-tools can turn its checkpoint steps into Hugging Face models.

A merger is built from one complete step (its directory and manifest) and streams full, unsharded tensors
under Hugging Face names, one at a time, so that a merge never holds the whole model in memory. Core knows no
transformers: model classes are named by strings, and ckpt-tools resolves them.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError
from .manifest import Manifest
from .peft import PEFT_PREFIX, modules_to_save, peft_adapter_config, split_peft_name

if TYPE_CHECKING:
    import torch

AUTO_CLASSES = {
    "language_model": "AutoModelForCausalLM",
    "value_model": "AutoModelForTokenClassification",
}
"""The transformers auto class that loads a merged model of each model type."""

_HEAD_SUFFIXES = {
    "language_model": "ForCausalLM",
    "value_model": "ForTokenClassification",
}
_ARCHITECTURE_HEAD = re.compile(r"For[A-Z]\w*$")


class CheckpointMerger(ABC):
    """Reads one complete checkpoint step of one backend and streams its weights as Hugging Face tensors.

    Public methods hold the shared logic (model class, PEFT names, adapter config); backends implement the
    ``_``-prefixed hooks. Every streamed tensor is full (unsharded), on CPU, and yielded before the next is
    read, so peak memory stays near the largest tensor.

    Args:
        step_dir: the step directory (``global_step_<N>/``), already verified against its manifest.
        manifest: the step's manifest.
    """

    def __init__(self, step_dir: Path, manifest: Manifest) -> None:
        self.step_dir = Path(step_dir)
        self.manifest = manifest

    # ------------------------------------------------------------------ model class
    @property
    def auto_class(self) -> str:
        """Name of the transformers auto class that loads the merged model (``AutoModelForCausalLM``, ...)."""
        return AUTO_CLASSES[self.manifest.model_type]

    @property
    def is_lora(self) -> bool:
        """Whether the step holds LoRA adapters on top of a frozen base model."""
        return self.manifest.lora is not None

    def source_config(self) -> dict[str, Any]:
        """The ``config.json`` of the model the checkpoint was trained from, as a dict.

        Raises:
            CheckpointError: the source model directory recorded in the manifest has no readable config.
        """
        path = Path(self.manifest.model_path) / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"cannot read {path}, the config of the model this checkpoint was trained from (manifest "
                f"model_path). Restore that directory, or pass a copy of it with `--model-path DIR` (ckpt merge and "
                "verify)."
            ) from e

    @property
    def architecture(self) -> str:
        """Hugging Face architecture of the merged model, e.g. ``Qwen2ForTokenClassification`` for a critic.

        The source config names the model family; the head follows the manifest's model type, so a value
        model trained from a causal LM directory is still written as a token-classification model.
        """
        config = self.source_config()
        declared = (config.get("architectures") or [None])[0] or self._architecture_from_model_type(config)
        return _ARCHITECTURE_HEAD.sub("", declared) + _HEAD_SUFFIXES[self.manifest.model_type]

    @staticmethod
    def _architecture_from_model_type(config: dict[str, Any]) -> str:
        model_type = config.get("model_type")
        if not model_type:
            raise CheckpointError("the source config.json names neither `architectures` nor `model_type`.")
        return f"{model_type.capitalize()}ForCausalLM"

    # ------------------------------------------------------------------ tensors
    def tensor_names(self) -> list[str]:
        """Every tensor name stored in the step (backend naming), read from metadata only."""
        return self._names()

    def base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full tensor)`` for every weight of the (frozen, for LoRA) base model."""
        if not self.is_lora:
            yield from self._tensors(lambda name: True)
            return
        for name, tensor in self._tensors(lambda name: split_peft_name(name)[0] in ("base", "saved")):
            yield split_peft_name(name)[1], tensor

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(peft_name, tensor)`` for every LoRA weight, named as in a PEFT ``adapter_model.safetensors``.

        Raises:
            CheckpointError: the step holds no LoRA adapters.
        """
        self._require_lora("adapter_tensors()")
        for name, tensor in self._tensors(lambda name: split_peft_name(name)[0] in ("adapter", "saved")):
            kind, renamed = split_peft_name(name)
            yield (renamed if kind == "adapter" else PEFT_PREFIX + renamed), tensor

    def adapter_config(self) -> dict[str, Any]:
        """The PEFT ``adapter_config.json`` content for the step's adapters.

        Raises:
            CheckpointError: the step holds no LoRA adapters.
        """
        self._require_lora("adapter_config()")
        return peft_adapter_config(
            self.manifest.lora or {},
            model_type=self.manifest.model_type,
            model_path=self.manifest.model_path,
            modules_to_save=modules_to_save(self._names()),
        )

    def optimizer_tensors(self, moment: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full tensor)`` of one AdamW moment (``exp_avg`` or ``exp_avg_sq``) of every
        weight, with the same name and layout transforms as :meth:`base_tensors` (resuming on another backend
        or layout: :mod:`.hf_state`).

        Raises:
            CheckpointError: the step holds no optimizer state, or the backend cannot read it without its
                own process groups.
        """
        if self.optimizer_kind() is None:
            raise CheckpointError(
                f"{self.step_dir} holds no optimizer state (saved with checkpoint.save_optimizer=false); load it "
                "with load_optimizer=False for a fresh optimizer."
            )
        yield from self._optimizer_tensors(moment)

    def optimizer_kind(self) -> str | None:
        """How the step stores its optimizer state (shown by ``drivetrain ckpt ls``): ``None`` without one, else
        the backend's word for it (``per-parameter``, the default: a state per named parameter)."""
        return "per-parameter" if any(name.startswith("optimizer/") for name in self.manifest.files) else None

    def optimizer_moves(self) -> bool:
        """Whether :meth:`optimizer_tensors` can read the step's optimizer state, so that it resumes on another
        backend or layout (``False`` without one). Backends whose state needs more than its files override it."""
        return self.optimizer_kind() is not None

    def adam_step(self) -> int:
        """The number of AdamW updates the step's optimizer state has taken."""
        return self._adam_step()

    def _require_lora(self, what: str) -> None:
        if not self.is_lora:
            raise CheckpointError(
                f"{what}: {self.step_dir} holds no LoRA adapters (its manifest has lora=null)."
            )

    # ------------------------------------------------------------------ backend hooks
    @abstractmethod
    def _names(self) -> list[str]:
        """Every tensor name in the step, without reading tensor data (same naming as :meth:`_tensors`)."""

    @abstractmethod
    def _tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the model tensors whose name ``wanted`` accepts, one at a time, full and on CPU.

        Tensors not wanted should not be read at all where the format allows it.

        Names are the Hugging Face model's ``state_dict`` names; for LoRA checkpoints they are the PEFT model's
        names (``base_model.model.`` prefix, ``base_layer.weight``, ``lora_A.default.weight``), which the
        public methods split into base and adapter tensors.
        """

    def _optimizer_tensors(self, moment: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream one AdamW moment of every weight under Hugging Face names (full, on CPU).

        Backends whose optimizer state can be read this way override this and :meth:`_adam_step`; the default
        says the state does not move.
        """
        raise self._no_portable_optimizer()

    def _adam_step(self) -> int:
        """The AdamW step count stored in the step."""
        raise self._no_portable_optimizer()

    def _no_portable_optimizer(self) -> CheckpointError:
        return CheckpointError(
            f"{self.step_dir}: the {self.manifest.backend} backend's checkpoints hold optimizer state that "
            "cannot be read by another backend or layout. Load it with load_optimizer=False (weights only, a "
            "fresh optimizer), or resume with the backend and layout that wrote it."
        )


__all__ = ["AUTO_CLASSES", "CheckpointMerger"]
