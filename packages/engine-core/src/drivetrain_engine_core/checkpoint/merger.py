"""The interface a backend implements so that ckpt-tools can turn its checkpoint steps into Hugging Face models.

A merger is built from one complete step (its directory and manifest) and streams full, unsharded tensors
under Hugging Face names, one at a time, so that a merge never holds the whole model in memory. Core knows no
transformers: model classes are named by strings, and ckpt-tools resolves them.
"""

from __future__ import annotations

import json
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import CheckpointError
from .manifest import Manifest

AUTO_CLASSES = {
    "language_model": "AutoModelForCausalLM",
    "value_model": "AutoModelForTokenClassification",
}
"""The transformers auto class that loads a merged model of each model type."""

_HEAD_SUFFIXES = {
    "language_model": "ForCausalLM",
    "value_model": "ForTokenClassification",
}
_PEFT_TASK_TYPES = {"language_model": "CAUSAL_LM", "value_model": "TOKEN_CLS"}
_ARCHITECTURE_HEAD = re.compile(r"For[A-Z]\w*$")

PEFT_PREFIX = "base_model.model."
"""Prefix PEFT puts in front of every name of the wrapped model."""

_ADAPTER_NAME = "default"
_SAVED_MARKER = f".modules_to_save.{_ADAPTER_NAME}."
_ORIGINAL_MARKER = ".original_module."


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
                f"model_path). Restore that directory, or point the merge at a copy of it."
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
            modules_to_save=self._modules_to_save(),
        )

    def _modules_to_save(self) -> list[str]:
        """Modules PEFT trains in full next to the adapters (a value model's ``score`` head)."""
        names = {
            name.split(_SAVED_MARKER)[0].rsplit(".", 1)[-1] for name in self._names() if _SAVED_MARKER in name
        }
        return sorted(names)

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


def peft_adapter_config(
    lora: Mapping[str, Any], *, model_type: str, model_path: str, modules_to_save: Sequence[str] = ()
) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` content for adapters described by a manifest's ``lora`` entry.

    Args:
        lora: ``rank``, ``alpha``, ``target_modules`` and optionally ``dropout`` (a :class:`LoraConfig`'s fields).
        model_type: ``language_model`` or ``value_model`` (PEFT task type ``CAUSAL_LM`` / ``TOKEN_CLS``).
        model_path: the base model (``base_model_name_or_path``).
        modules_to_save: modules trained in full next to the adapters (a value model's head).
    """
    return {
        "peft_type": "LORA",
        "task_type": _PEFT_TASK_TYPES[model_type],
        "base_model_name_or_path": model_path,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora.get("dropout", 0.0),
        "target_modules": sorted(lora["target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": list(modules_to_save) or None,
    }


def split_peft_name(name: str) -> tuple[str, str]:
    """Classify a PEFT model's ``state_dict`` name and rename it for where it is written.

    Returns:
        ``(kind, name)`` where kind is ``"base"`` for a frozen weight of the wrapped model (Hugging Face name,
        ``base_layer.`` removed), ``"adapter"`` for a LoRA weight (named as PEFT saves adapters, adapter name
        removed), ``"saved"`` for a module PEFT trains in full (``modules_to_save``; Hugging Face name), or
        ``"original"`` for the frozen copy such a module replaces (never written).

    Examples:
        ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
        ``("base", "model.layers.0.self_attn.q_proj.weight")``;
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
        ``("adapter", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")``;
        ``base_model.model.score.modules_to_save.default.weight`` -> ``("saved", "score.weight")``.
    """
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{_ADAPTER_NAME}."
        if marker in name:
            return "adapter", name.replace(marker, f".{part}.")
    inner = name.removeprefix(PEFT_PREFIX)
    if _SAVED_MARKER in inner:
        return "saved", inner.replace(_SAVED_MARKER, ".")
    if _ORIGINAL_MARKER in inner:
        return "original", inner.replace(_ORIGINAL_MARKER, ".")
    return "base", inner.replace(".base_layer.", ".")


__all__ = [
    "AUTO_CLASSES",
    "PEFT_PREFIX",
    "CheckpointMerger",
    "DCPTensorReader",
    "peft_adapter_config",
    "split_peft_name",
]
