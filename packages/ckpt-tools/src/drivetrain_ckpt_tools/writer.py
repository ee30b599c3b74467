"""A streaming safetensors writer: tensors arrive one at a time and leave in shards of bounded size.

Only the current shard is held in memory, so a merge peaks near one shard plus the tensor being read, not
the whole model. The layout is the one ``save_pretrained`` writes: a single ``model.safetensors``, or numbered
``model-0000i-of-0000N.safetensors`` shards with a ``model.safetensors.index.json`` weight map once the model
exceeds the shard size.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"``, ``"200MiB"``, ``"1000"`` or an int.

    Raises:
        ValueError: the text is not a number with an optional B/KB/MB/GB/KiB/MiB/GiB unit.
    """
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"shard size {text!r} is not a size; write e.g. '5GB', '500MB' or '200MiB'.")
    return int(float(match.group(1)) * _UNITS[unit])


class ShardedSafetensorsWriter:
    """Collects tensors into shards no larger than ``max_shard_bytes`` (a single larger tensor gets its own).

    Args:
        directory: where the files go (must exist).
        max_shard_bytes: a shard is written once adding the next tensor would exceed this size.
        prefix: file name stem, ``model`` for models, ``adapter_model`` for PEFT adapters.
    """

    def __init__(
        self, directory: Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, prefix: str = "model"
    ):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes the current shard first when the tensor would overflow it.

        Raises:
            ValueError: ``name`` was already written.
        """
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} was given twice to the writer of {self.directory}.")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size
        self._total_bytes += size

    def close(self) -> list[Path]:
        """Write the last shard, give shards their final names and write the index where there are several.

        Returns:
            The files written, index last.
        """
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        if count == 1:
            final = self.directory / f"{self.prefix}.safetensors"
            os.replace(self._shards[0][0], final)
            return [final]
        files, weight_map = [], {}
        for index, (path, names) in enumerate(self._shards, start=1):
            final = self.directory / f"{self.prefix}-{index:05d}-of-{count:05d}.safetensors"
            os.replace(path, final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index_path = self.directory / f"{self.prefix}.safetensors.index.json"
        index_path.write_text(
            json.dumps({"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}, indent=2)
        )
        return [*files, index_path]

    def _flush(self) -> None:
        path = self.directory / f".{self.prefix}-part{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ShardedSafetensorsWriter", "parse_size"]
