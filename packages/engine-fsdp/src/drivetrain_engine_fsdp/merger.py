"""Stream full Hugging Face tensors out of an FSDP checkpoint step, one at a time, without a process group.

The FSDP engine writes ``model/`` with torch.distributed.checkpoint (DCP); its keys are the
``get_model_state_dict`` names of the Hugging Face (or PEFT) model. DCP's metadata lists every key with its
global shape and dtype, so each tensor is loaded on its own into a full-size buffer: DCP stitches the ranks'
shards together and reads only the bytes of that tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from drivetrain_engine_core.checkpoint import CheckpointMerger
from drivetrain_engine_core.errors import CheckpointError
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

MODEL_DIR = "model"


class FSDPCheckpointMerger(CheckpointMerger):
    """Reads the DCP ``model/`` directory of an FSDP step (any world size) tensor by tensor."""

    @property
    def model_dir(self) -> Path:
        return self.step_dir / MODEL_DIR

    @cached_property
    def _metadata(self) -> Metadata:
        try:
            return FileSystemReader(self.model_dir).read_metadata()
        except (OSError, EOFError, ValueError) as e:
            raise CheckpointError(
                f"cannot read the DCP metadata of {self.model_dir} (file .metadata): {e}. The step is damaged; "
                "use another step."
            ) from e

    def _tensor_entries(self) -> dict[str, TensorStorageMetadata]:
        entries = self._metadata.state_dict_metadata
        return {name: meta for name, meta in entries.items() if isinstance(meta, TensorStorageMetadata)}

    def _names(self) -> list[str]:
        return list(self._tensor_entries())

    def _tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, meta in self._tensor_entries().items():
            if wanted(name):
                yield name, self._load_one(name, meta)

    def _load_one(self, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
        """Load the full tensor ``name``; only its own chunks are read from the shard files."""
        buffer = {name: torch.empty(meta.size, dtype=meta.properties.dtype)}
        try:
            with warnings.catch_warnings():
                # Reading without a process group is the intent here, not a mistake worth a warning per tensor.
                warnings.filterwarnings(
                    "ignore", message=".*assuming the intent is to load in a single process"
                )
                dcp.load(buffer, storage_reader=FileSystemReader(self.model_dir), no_dist=True)
        except Exception as e:
            # DCP wraps per-file read failures (a shard cut short after the manifest was checked) in its own
            # exception types; name the tensor and the directory so the user knows which step is broken.
            raise CheckpointError(f"cannot read tensor {name!r} from {self.model_dir}: {e}") from e
        return buffer[name]


__all__ = ["FSDPCheckpointMerger"]
