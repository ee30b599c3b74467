"""Stream Hugging Face tensors out of a Megatron checkpoint step, one at a time, without process groups.

The megatron engine writes ``model/`` with dist_checkpointing's ``torch_dist`` format (``checkpoint.py``): a
torch.distributed.checkpoint directory keyed by global ``GPTModel`` names, tensor-parallel shards and pipeline
stages already placed in the global shape, and the transformer layers stacked on a leading axis
(``decoder.layers.<param>`` of shape ``(num_layers, ...)``). One layer of one key is read at a time and
converted with the engine's own mbridge bridge (``bridge.py``): names mapped, fused ``linear_qkv`` split into
q/k/v, ``linear_fc1`` into gate/up, vocabulary padding trimmed, a value model's ``output_layer`` mapped onto
``score``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import torch
from drivetrain_engine_core.checkpoint import CheckpointMerger, DCPTensorReader
from drivetrain_engine_core.errors import CheckpointError

from .checkpoint import MODEL_DIR

_STACKED_PREFIX = "decoder.layers."
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


class MegatronCheckpointMerger(CheckpointMerger):
    """Reads the dist_checkpointing ``model/`` directory of a megatron step (any TP/PP/DP layout)."""

    @cached_property
    def _reader(self) -> DCPTensorReader:
        return DCPTensorReader(self.step_dir / self.manifest.backend_info.get("model_dir", MODEL_DIR))

    @cached_property
    def _bridge(self) -> Any:
        """The engine's bridge class for the source config, built for name and layout conversion only."""
        from mbridge.core.parallel_states import ParallelStates
        from transformers import AutoConfig

        from .bridge import bridge_class

        hf_config = AutoConfig.from_pretrained(self.manifest.model_path)
        cls = bridge_class(hf_config, value_model=self.manifest.model_type == "value_model")
        # Explicit single-rank states: conversion needs no megatron process groups.
        return cls(hf_config, dtype=torch.float32, parallel_states=ParallelStates())

    def _names(self) -> list[str]:
        return [name for name, _ in self._parts()]

    def _parts(self) -> Iterator[tuple[str, tuple[str, int | None]]]:
        """``(per-layer megatron name, (checkpoint key, layer index or None))`` for every stored tensor."""
        for key, meta in self._reader.tensors.items():
            if key.endswith("_extra_state"):
                continue
            if key.startswith(_STACKED_PREFIX) and not key.split(".")[2].isdigit():
                parameter = key.removeprefix(_STACKED_PREFIX)
                for layer in range(meta.size[0]):
                    yield f"{_STACKED_PREFIX}{layer}.{parameter}", (key, layer)
            else:
                yield key, (key, None)

    def _tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (key, layer) in self._parts():
            if not any(wanted(hf_name) for hf_name in self._hf_names(name)):
                continue
            hf_names, tensors = self._bridge._weight_to_hf_format(name, self._reader.read(key, index=layer))
            for hf_name, tensor in zip(hf_names, tensors, strict=True):
                if wanted(hf_name):
                    yield hf_name, self._trim_vocab(name, tensor).contiguous()

    def _hf_names(self, name: str) -> list[str]:
        try:
            return self._bridge._weight_name_mapping_mcore_to_hf(name)
        except (NotImplementedError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"{self._reader.directory} holds {name!r}, which the mbridge bridge for "
                f"{self.manifest.backend_info.get('hf_model_type')!r} cannot map to a Hugging Face name: {e}"
            ) from e

    def _trim_vocab(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Drop the rows megatron padded the vocabulary with (tensor-parallel divisibility)."""
        vocab_size = self.manifest.backend_info.get("vocab_size")
        padded = name in _VOCAB_ROWS and not (self._bridge.value_head and name.startswith("output_layer"))
        return tensor[:vocab_size] if padded and vocab_size and tensor.shape[0] > vocab_size else tensor


__all__ = ["MegatronCheckpointMerger"]
