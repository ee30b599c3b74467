"""Stream Hugging Face tensors out of a Megatron checkpoint step, one layer at a time, without process groups.

The megatron engine writes ``model/`` with dist_checkpointing's ``torch_dist`` format (``checkpoint.py``): a
torch.distributed.checkpoint directory keyed by global ``GPTModel`` names, tensor-parallel shards and pipeline
stages already placed in the global shape, and the transformer layers stacked on a leading axis
(``decoder.layers.<param>`` of shape ``(num_layers, ...)``). Each layer of each key is read alone (core's
:class:`DCPTensorReader`) and converted by :func:`.hf_names.checkpoint_tensors_to_hf`, the engine's own
mbridge conversion (q/k/v and gate/up split, vocabulary padding trimmed, value head onto ``score``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cached_property

import torch
from drivetrain_engine_core.backend import MODEL_DIR, CheckpointMerger, DCPTensorReader

_STACKED_PREFIX = "decoder.layers."


class MegatronCheckpointMerger(CheckpointMerger):
    """Reads the dist_checkpointing ``model/`` directory of a megatron step (any TP/PP/DP layout)."""

    @cached_property
    def _reader(self) -> DCPTensorReader:
        return DCPTensorReader(self.step_dir / self.manifest.backend_info.get("model_dir", MODEL_DIR))

    def _names(self) -> list[str]:
        return [name for name, _ in self._layers()]

    def _layers(self) -> Iterator[tuple[str, tuple[str, int | None]]]:
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
        from transformers import AutoConfig

        from .hf_names import checkpoint_tensors_to_hf

        # Lazily read: the conversion pulls one layer of one key at a time.
        megatron_tensors = (
            (name, self._reader.read(key, index=layer)) for name, (key, layer) in self._layers()
        )
        converted = checkpoint_tensors_to_hf(
            AutoConfig.from_pretrained(
                self.manifest.model_path, trust_remote_code=self.manifest.trust_remote_code
            ),
            megatron_tensors,
            value_model=self.manifest.model_type == "value_model",
            vocab_size=self.manifest.backend_info["vocab_size"],
        )
        for hf_name, tensor in converted:
            if wanted(hf_name):
                yield hf_name, tensor.contiguous()


__all__ = ["MegatronCheckpointMerger"]
