"""Stream full Hugging Face tensors out of an FSDP checkpoint step, one at a time, without a process group.

The FSDP engine writes ``model/`` with torch.distributed.checkpoint (DCP); its keys are the
``get_model_state_dict`` names of the Hugging Face (or PEFT) model (see ``checkpoint.py``), full-shape in DCP's
metadata whatever the number of writing ranks. Each key is loaded on its own into a full-size buffer: DCP
stitches the ranks' shards together and reads only the bytes of that tensor. Weights the module holds in
another layout than Hugging Face checkpoints (fused MoE experts) are written in the checkpoint's layout, by
transformers' own conversion of the source model's class (built on ``meta`` from its ``config.json``).

NOTE: torch, transformers and the DCP reader are imported where tensors are read, not with the module:
``drivetrain ckpt ls`` builds a merger for each complete step to say how its optimizer state is stored (from
the manifest alone), and listing steps must not import them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from drivetrain_engine_core.backend import CheckpointMerger
from drivetrain_engine_core.kit import MODEL_DIR, OPTIMIZER_DIR

if TYPE_CHECKING:
    import torch
    from drivetrain_engine_core.kit import DCPTensorReader

_STATE = (
    "state."  # get_optimizer_state_dict's flattened keys: state.<parameter name>.<exp_avg|exp_avg_sq|step>
)


class FSDPCheckpointMerger(CheckpointMerger):
    """Reads the DCP ``model/`` directory of an FSDP step (any world size) tensor by tensor."""

    @cached_property
    def _reader(self) -> DCPTensorReader:
        from drivetrain_engine_core.kit import DCPTensorReader

        return DCPTensorReader(self.step_dir / MODEL_DIR)

    def _names(self) -> list[str]:
        return list(self._reader.tensors)

    @cached_property
    def _hf_model(self) -> Any:
        """The source model's transformers class on ``meta``: what its weight conversions are registered for."""
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(self.manifest.model_path)
        with torch.device("meta"):
            return getattr(transformers, self.auto_class).from_config(config)

    @cached_property
    def _optimizer_reader(self) -> DCPTensorReader:
        from drivetrain_engine_core.kit import DCPTensorReader

        return DCPTensorReader(self.step_dir / OPTIMIZER_DIR)

    def _in_hf_layout(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``name``'s tensor as the Hugging Face checkpoint holds it (fused experts split by transformers)."""
        from .conversion import unfuse

        yield from unfuse(self._hf_model, name, tensor).items()

    def _optimizer_tensors(self, moment: str) -> Iterator[tuple[str, torch.Tensor]]:
        suffix = f".{moment}"
        for key in self._optimizer_reader.tensors:
            if key.startswith(_STATE) and key.endswith(suffix):
                # Moments are elementwise: the weight's layout conversion applies to them unchanged.
                yield from self._in_hf_layout(
                    key[len(_STATE) : -len(suffix)], self._optimizer_reader.read(key)
                )

    def _adam_step(self) -> int:
        steps = [
            key for key in self._optimizer_reader.tensors if key.startswith(_STATE) and key.endswith(".step")
        ]
        # Every parameter steps together (one AdamW over the whole model); a never-stepped optimizer has none.
        return int(self._optimizer_reader.read(steps[0]).item()) if steps else 0

    def _tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._reader.tensors:
            if wanted(name):
                yield from self._in_hf_layout(name, self._reader.read(name))


__all__ = ["FSDPCheckpointMerger"]
