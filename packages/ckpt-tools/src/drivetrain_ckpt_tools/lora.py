"""LoRA checkpoints: write a PEFT adapter directory, or fold the adapters into the base weights.

Merging needs no peft: each adapted linear becomes ``W + (alpha / r) * B @ A``. The adapters are small
(rank ``r``), so they are held in memory while the base weights stream past one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from drivetrain_engine_core.backend import CheckpointError, CheckpointMerger
from drivetrain_engine_core.kit import PEFT_PREFIX
from safetensors.torch import save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def write_adapter_dir(merger: CheckpointMerger, directory: Path) -> list[Path]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` does.

    Returns:
        The two files written.
    """
    config_path = directory / ADAPTER_CONFIG
    config_path.write_text(json.dumps(merger.adapter_config(), indent=2, sort_keys=True))
    weights_path = directory / ADAPTER_WEIGHTS
    tensors = {name: tensor.contiguous() for name, tensor in merger.adapter_tensors()}
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    return [config_path, weights_path]


def merged_base_tensors(merger: CheckpointMerger) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the base model's tensors with every LoRA update folded in.

    Raises:
        CheckpointError: an adapter matches no base weight (the checkpoint and its manifest disagree).
    """
    lora = merger.manifest.lora or {}
    scaling = float(lora["alpha"]) / float(lora["rank"])
    pairs = _adapter_pairs(merger)
    for name, tensor in merger.base_tensors():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in pairs:
            lora_a, lora_b = pairs.pop(module)
            delta = (lora_b.to(torch.float32) @ lora_a.to(torch.float32)) * scaling
            tensor = (tensor.to(torch.float32) + delta).to(tensor.dtype)
        yield name, tensor
    if pairs:
        raise CheckpointError(
            f"LoRA adapters of {merger.step_dir} match no base weight: {sorted(pairs)[:5]}; the step is not a "
            "checkpoint of the model in its manifest."
        )


def _adapter_pairs(merger: CheckpointMerger) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module name -> (lora_A, lora_B)`` for every adapted module, by Hugging Face module name."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in merger.adapter_tensors():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                module = name.removeprefix(PEFT_PREFIX).removesuffix(suffix)
                parts.setdefault(module, {})[part] = tensor
    incomplete = [module for module, found in parts.items() if len(found) != 2]
    if incomplete:
        raise CheckpointError(
            f"{merger.step_dir} has LoRA modules without both lora_A and lora_B: {incomplete[:5]}"
        )
    return {module: (found["lora_A"], found["lora_B"]) for module, found in parts.items()}


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "merged_base_tensors", "write_adapter_dir"]
