"""``DCPTensorReader``: single tensors, or single stacked layers, from a torch.distributed.checkpoint directory.

Backends' checkpoint mergers read their step's model tensors through it, one at a time and without a process
group, so a merge never holds the whole model in memory.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .._errors import CheckpointError


class DCPTensorReader:
    """Reads single tensors, or single slices along their first dimension, from a DCP directory.

    Needs no process group: DCP's metadata gives each key's global shape, and a load plan for just the
    wanted region makes DCP read only the chunks that overlap it, whatever the number of ranks that wrote them.
    Both FSDP (``get_model_state_dict`` keys) and Megatron (``torch_dist``, layers stacked on a leading axis)
    write such directories.

    Args:
        directory: the DCP checkpoint directory (with its ``.metadata`` file).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @cached_property
    def tensors(self) -> dict[str, TensorStorageMetadata]:
        """Global shape and dtype of every tensor key (non-tensor entries left out).

        Raises:
            CheckpointError: the metadata file is missing or unreadable.
        """
        try:
            metadata = FileSystemReader(self.directory).read_metadata()
        except Exception as e:
            # The metadata is a pickle: a damaged file fails with unpickling errors of any type, not just I/O.
            raise CheckpointError(
                f"cannot read the DCP metadata of {self.directory} (file .metadata): {e}. The step is damaged; "
                "use another step."
            ) from e
        entries = metadata.state_dict_metadata
        return {name: meta for name, meta in entries.items() if isinstance(meta, TensorStorageMetadata)}

    def read(self, name: str, *, index: int | None = None) -> torch.Tensor:
        """The full tensor ``name``, or only ``tensor[index]`` (one stacked layer) when ``index`` is given.

        Raises:
            CheckpointError: the key is unknown, or its data cannot be read (a damaged shard).
        """
        if name not in self.tensors:
            raise CheckpointError(f"{self.directory} has no tensor {name!r}.")
        meta = self.tensors[name]
        offsets, sizes = [0] * len(meta.size), list(meta.size)
        if index is not None:
            offsets[0], sizes[0] = index, 1
        buffer = {name: torch.empty(sizes, dtype=meta.properties.dtype)}
        planner = _RegionLoadPlanner(name, offsets, sizes)
        try:
            with warnings.catch_warnings():
                # Reading without a process group is the intent here, not a mistake worth a warning per tensor.
                warnings.filterwarnings(
                    "ignore", message=".*assuming the intent is to load in a single process"
                )
                dcp.load(
                    buffer, storage_reader=FileSystemReader(self.directory), planner=planner, no_dist=True
                )
        except Exception as e:
            # DCP wraps per-file read failures in its own exception types; name the tensor and the directory.
            raise CheckpointError(f"cannot read tensor {name!r} from {self.directory}: {e}") from e
        return buffer[name] if index is None else buffer[name][0]


def check_saved_shapes(step_dir: Path, directory: Path, shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse to load ``directory`` (a DCP directory of step ``step_dir``) into a model whose tensors have other
    shapes than the saved ones; ``shapes`` maps each key the backend loads to its global shape.

    Run by every rank before the collective load (the metadata is the same file for all, so every rank raises
    the same error and none waits in a load the others left). NOTE: DCP's own refusal was a traceback per rank
    ("Size mismatch between saved ... and current ...") after the run had started, on a ``--resume`` whose
    ``model.path`` named another model than the run's.

    Raises:
        CheckpointError: naming the first tensor whose shape differs, both shapes, and the step's model.
    """
    from .manifest import read_manifest

    saved = DCPTensorReader(directory).tensors
    for name, shape in shapes.items():
        meta = saved.get(name)
        if meta is not None and tuple(meta.size) != tuple(shape):
            raise CheckpointError(
                f"{step_dir} holds {name} of shape {list(meta.size)}, but the model being loaded has "
                f"{list(shape)}: the checkpoint was saved from another model ({read_manifest(step_dir).model_path}). "
                "Set model.path to the model the run started from, or start a new run without --resume."
            )


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Plans the reads of one region of one tensor (the buffer holds exactly that region)."""

    def __init__(self, name: str, offsets: list[int], sizes: list[int]) -> None:
        super().__init__()
        self._region = (name, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))

    def create_local_plan(self) -> LoadPlan:
        name, chunk = self._region
        checkpoint_meta = self.metadata.state_dict_metadata[name]  # type: ignore[union-attr]
        if not isinstance(checkpoint_meta, TensorStorageMetadata):
            raise CheckpointError(f"{name!r} is not a tensor in this checkpoint.")
        return LoadPlan(create_read_items_for_chunk_list(name, checkpoint_meta, [chunk]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        # The buffer is a plain tensor holding just the region; DCP would look for a shard at the region's
        # offset, which only sharded tensors have.
        return self.state_dict[index.fqn]
