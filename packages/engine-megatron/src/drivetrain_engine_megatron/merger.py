"""Stream Hugging Face tensors out of a Megatron checkpoint step, one layer at a time, without process groups.

The megatron engine writes ``model/`` with dist_checkpointing's ``torch_dist`` format (``checkpoint.py``): a
torch.distributed.checkpoint directory keyed by global ``GPTModel`` names, tensor-parallel shards and pipeline
stages already placed in the global shape, and the transformer layers stacked on a leading axis
(``decoder.layers.<param>`` of shape ``(num_layers, ...)``). Each layer of each key is read alone (core's
:class:`DCPTensorReader`) and converted by :func:`.hf_names.checkpoint_tensors_to_hf`, the engine's own
mbridge conversion (q/k/v and gate/up split, vocabulary padding trimmed, value head onto ``score``).

NOTE: torch and the DCP reader are imported where tensors are read, not with the module: ``drivetrain ckpt ls``
builds a merger for each complete step to say how its optimizer state is stored (from the manifest and the
layout record), and listing steps must not import them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

from drivetrain_engine_core.backend import CheckpointError, CheckpointMerger
from drivetrain_engine_core.kit import MODEL_DIR, OPTIMIZER_DIR

from .dist_opt_record import has_layout, read_adam_step, read_moments

if TYPE_CHECKING:
    import torch
    from drivetrain_engine_core.kit import DCPTensorReader

_STACKED_PREFIX = "decoder.layers."
_OPTIMIZER_STATE = "optimizer.state"


class MegatronCheckpointMerger(CheckpointMerger):
    """Reads the dist_checkpointing ``model/`` directory of a megatron step (any TP/PP/DP layout), and the Adam
    moments of ``optimizer/`` where they are stored per parameter (``engine.use_distributed_optimizer=false``)."""

    @cached_property
    def _reader(self) -> DCPTensorReader:
        from drivetrain_engine_core.kit import DCPTensorReader

        return DCPTensorReader(self.step_dir / self.manifest.backend_info.get("model_dir", MODEL_DIR))

    @cached_property
    def _optimizer_reader(self) -> DCPTensorReader:
        from drivetrain_engine_core.kit import DCPTensorReader

        return DCPTensorReader(self.step_dir / self.manifest.backend_info.get("optimizer_dir", OPTIMIZER_DIR))

    def _names(self) -> list[str]:
        shapes = {key: tuple(meta.size) for key, meta in self._reader.tensors.items()}
        return [name for name, _ in _layers(shapes, "")]

    def _tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, tensor in self._converted(_stored(self._reader, "")):
            if wanted(hf_name):
                yield hf_name, tensor

    def _optimizer_tensors(self, moment: str) -> Iterator[tuple[str, torch.Tensor]]:
        if self.optimizer_kind() != "distributed":
            yield from self._converted(_stored(self._optimizer_reader, f"{_OPTIMIZER_STATE}.{moment}."))
            return
        if not self.optimizer_moves():
            raise CheckpointError(
                f"{self.step_dir} holds megatron optimizer state saved with engine.use_distributed_optimizer=true "
                "by a drivetrain-engine-megatron that did not record where each parameter sits in its flat "
                "buffers (dp_reshardable format, which then only the same tensor- and pipeline-parallel layout "
                "can read): its Adam moments cannot move to another backend or layout. Resume with the layout "
                "that wrote it (its next save, by this version, records the layout and then moves), or load it "
                "with load_optimizer=False (weights only)."
            )
        moments = read_moments(self.step_dir, self._optimizer_reader, moment)
        missing = sorted(
            key for key in self._reader.tensors if key not in moments and "_extra_state" not in key
        )
        if missing:
            raise CheckpointError(
                f"{self.step_dir}: the distributed optimizer's layout record places no moments for {missing[:5]}; "
                "the step is damaged or was written by another version. Resume with the layout that wrote it, "
                "or load it with load_optimizer=False (weights only)."
            )
        yield from self._converted(_in_layers(moments))

    def optimizer_kind(self) -> str | None:
        """``distributed`` for megatron's DistributedOptimizer (flat per-bucket state), else the default."""
        kind = super().optimizer_kind()
        if kind is not None and self.manifest.backend_info.get("use_distributed_optimizer", True):
            return "distributed"
        return kind

    def optimizer_moves(self) -> bool:
        """A distributed optimizer's state moves only with the layout record its save wrote."""
        distributed = self.optimizer_kind() == "distributed"
        return super().optimizer_moves() and (not distributed or has_layout(self.step_dir))

    def _adam_step(self) -> int:
        if has_layout(self.step_dir):
            return read_adam_step(self.step_dir)
        import torch

        common = self.step_dir / self.manifest.backend_info.get("optimizer_dir", OPTIMIZER_DIR) / "common.pt"
        return _common_step(torch.load(common, weights_only=True)) if common.is_file() else 0

    def _converted(
        self, megatron_tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``megatron_tensors`` (per-layer megatron names) converted to Hugging Face names."""
        from transformers import AutoConfig

        from .hf_names import checkpoint_tensors_to_hf

        converted = checkpoint_tensors_to_hf(
            AutoConfig.from_pretrained(
                self.manifest.model_path, trust_remote_code=self.manifest.trust_remote_code
            ),
            megatron_tensors,
            value_model=self.manifest.model_type == "value_model",
            vocab_size=self.manifest.backend_info["vocab_size"],
        )
        for hf_name, tensor in converted:
            yield hf_name, tensor.contiguous()


def _stored(reader: DCPTensorReader, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``reader`` under ``prefix`` (the name without it), read lazily one layer of one key at a
    time."""
    shapes = {key: tuple(meta.size) for key, meta in reader.tensors.items()}
    for name, (key, layer) in _layers(shapes, prefix):
        yield name, reader.read(key, index=layer)


def _in_layers(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (keyed as ``model/`` stores them) under per-layer megatron names."""
    shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
    for name, (key, layer) in _layers(shapes, ""):
        yield name, tensors[key] if layer is None else tensors[key][layer]


def _layers(
    shapes: Mapping[str, tuple[int, ...]], prefix: str
) -> Iterator[tuple[str, tuple[str, int | None]]]:
    """``(per-layer megatron name, (checkpoint key, layer index or None))`` for every tensor of ``shapes`` whose
    key starts with ``prefix`` (the name without it)."""
    for key, shape in shapes.items():
        if key.endswith("_extra_state") or not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name.startswith(_STACKED_PREFIX) and not name.split(".")[2].isdigit():
            parameter = name.removeprefix(_STACKED_PREFIX)
            for layer in range(shape[0]):
                yield f"{_STACKED_PREFIX}{layer}.{parameter}", (key, layer)
        else:
            yield name, (key, None)


def _common_step(common: Any) -> int:
    """The AdamW step megatron keeps in ``common.pt`` (``state.common_step``, nested per chained optimizer)."""
    if isinstance(common, dict):
        if "common_step" in common:
            return int(common["common_step"])
        for value in common.values():
            step = _common_step(value)
            if step:
                return step
    return 0


__all__ = ["MegatronCheckpointMerger"]
