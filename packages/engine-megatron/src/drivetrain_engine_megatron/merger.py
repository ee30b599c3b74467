"""Stream Hugging Face tensors out of a Megatron checkpoint step, one at a time, without process groups.

The megatron engine writes ``model/`` with dist_checkpointing's ``torch_dist`` format, which is a
torch.distributed.checkpoint (DCP) directory keyed by global ``GPTModel`` names whose tensors are full
(tensor-parallel shards and pipeline stages already placed in the global shape). Each key is loaded alone
from DCP and converted with the same mbridge bridge the engine uses (``bridge.py``): names mapped, fused
``linear_qkv`` split into q/k/v, ``linear_fc1`` into gate/up, vocabulary padding trimmed, and the value
model's ``output_layer`` mapped onto ``score``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from drivetrain_engine_core.checkpoint import CheckpointMerger
from drivetrain_engine_core.errors import CheckpointError
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


class MegatronCheckpointMerger(CheckpointMerger):
    """Reads the dist_checkpointing ``model/`` directory of a megatron step (any TP/PP/DP layout)."""

    @property
    def model_dir(self) -> Path:
        return self.step_dir / self.manifest.backend_info.get("model_dir", "model")

    @cached_property
    def _metadata(self) -> Metadata:
        try:
            return FileSystemReader(self.model_dir).read_metadata()
        except (OSError, EOFError, ValueError) as e:
            raise CheckpointError(
                f"cannot read the DCP metadata of {self.model_dir} (file .metadata): {e}. The step is damaged; "
                "use another step."
            ) from e

    @cached_property
    def _bridge(self) -> Any:
        """The engine's mbridge bridge for the source config, built for conversion only (no parallel groups)."""
        from mbridge.core.parallel_states import ParallelStates
        from transformers import AutoConfig

        from .bridge import bridge_class

        hf_config = AutoConfig.from_pretrained(self.manifest.model_path)
        cls = bridge_class(hf_config, value_model=self.manifest.model_type == "value_model")
        return cls(hf_config, dtype=torch.float32, parallel_states=ParallelStates())

    def _tensor_entries(self) -> dict[str, TensorStorageMetadata]:
        entries = self._metadata.state_dict_metadata
        return {
            name: meta
            for name, meta in entries.items()
            if isinstance(meta, TensorStorageMetadata) and not name.endswith("_extra_state")
        }

    def _names(self) -> list[str]:
        return list(self._tensor_entries())

    def _tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, meta in self._tensor_entries().items():
            if not any(wanted(hf_name) for hf_name in self._hf_names(name)):
                continue
            hf_names, tensors = self._bridge._weight_to_hf_format(name, self._load_one(name, meta))
            for hf_name, tensor in zip(hf_names, tensors, strict=True):
                if wanted(hf_name):
                    yield hf_name, self._trim_vocab(name, tensor).contiguous()

    def _hf_names(self, name: str) -> list[str]:
        try:
            return self._bridge._weight_name_mapping_mcore_to_hf(name)
        except (NotImplementedError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"{self.model_dir} holds {name!r}, which the mbridge bridge for "
                f"{self.manifest.backend_info.get('hf_model_type')!r} cannot map to a Hugging Face name: {e}"
            ) from e

    def _trim_vocab(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Drop the rows megatron padded the vocabulary with (tensor-parallel divisibility)."""
        vocab_size = self.manifest.backend_info.get("vocab_size")
        padded = name in _VOCAB_ROWS and not (self._bridge.value_head and name.startswith("output_layer"))
        return tensor[:vocab_size] if padded and vocab_size and tensor.shape[0] > vocab_size else tensor

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
            # DCP wraps per-file read failures in its own exception types; name the tensor and the directory.
            raise CheckpointError(f"cannot read tensor {name!r} from {self.model_dir}: {e}") from e
        return buffer[name]


__all__ = ["MegatronCheckpointMerger"]
