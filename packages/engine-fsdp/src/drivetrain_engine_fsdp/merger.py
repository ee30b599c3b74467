"""Stream full Hugging Face tensors out of an FSDP checkpoint step, one at a time, without a process group.

The FSDP engine writes ``model/`` with torch.distributed.checkpoint (DCP); its keys are the
``get_model_state_dict`` names of the Hugging Face (or PEFT) model (see ``checkpoint.py``), full-shape in DCP's
metadata whatever the number of writing ranks. Each key is loaded on its own into a full-size buffer: DCP
stitches the ranks' shards together and reads only the bytes of that tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cached_property

import torch
from drivetrain_engine_core.backend import MODEL_DIR, CheckpointMerger, DCPTensorReader


class FSDPCheckpointMerger(CheckpointMerger):
    """Reads the DCP ``model/`` directory of an FSDP step (any world size) tensor by tensor."""

    @cached_property
    def _reader(self) -> DCPTensorReader:
        return DCPTensorReader(self.step_dir / MODEL_DIR)

    def _names(self) -> list[str]:
        return list(self._reader.tensors)

    def _tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._reader.tensors:
            if wanted(name):
                yield name, self._reader.read(name)


__all__ = ["FSDPCheckpointMerger"]
