"""``export_weights``: full Hugging Face tensors, one at a time, with LoRA adapters merged into the base weights.

Sharded parameters are all-gathered one by one (``DTensor.full_tensor``), so peak memory is one full tensor,
not the whole model. For a PEFT model, ``x.base_layer.weight`` is yielded as ``x.weight`` plus
``lora_B @ lora_A * alpha / rank``; PEFT's ``base_model.model.`` prefix and ``modules_to_save`` copies map
back onto the plain names. Weights transformers keeps in another layout than its checkpoints (fused MoE experts)
leave in the checkpoint's layout, as ``save_pretrained`` writes them (``conversion.unfuse``).
``export_adapter_weights`` streams the adapters alone, for a rollout that applies
LoRA itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from drivetrain_engine_core.backend import LoraConfig
from drivetrain_engine_core.kit import PEFT_PREFIX, split_peft_name
from torch import nn
from torch.distributed.tensor import DTensor

from .conversion import base_model, unfuse

ADAPTER = "default"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def export_full_weights(module: nn.Module, lora: LoraConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every weight of the model in its checkpoint layout (a collective:
    every rank iterates)."""
    model = base_model(module)
    for name, tensor in _module_layout(module, lora):
        yield from unfuse(model, name, tensor).items()


def _module_layout(module: nn.Module, lora: LoraConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of every weight as the module holds it, LoRA adapters folded in."""
    state = module.state_dict()
    if lora is None:
        for name, tensor in state.items():
            yield name, _full(tensor).detach()
        return
    scale = lora.alpha / lora.rank
    for name, tensor in state.items():
        plain = _plain_name(name)
        if plain is None:
            continue
        weight = _full(tensor).detach()
        if name.endswith(".base_layer.weight"):
            stem = name[: -len(".base_layer.weight")]
            down = _full(state[f"{stem}.lora_A.{ADAPTER}.weight"]).detach()
            up = _full(state[f"{stem}.lora_B.{ADAPTER}.weight"]).detach()
            weight = weight + (up.float() @ down.float()).to(weight.dtype) * scale
        yield plain, weight


def _plain_name(peft_name: str) -> str | None:
    """The Hugging Face name of a PEFT state-dict entry, or ``None`` for adapter-only entries."""
    if ".original_module." in peft_name:
        return None
    return hf_name(peft_name)


def hf_name(peft_name: str) -> str | None:
    """The Hugging Face name a (possibly PEFT) parameter was made from; ``None`` for LoRA adapter weights.

    ``modules_to_save`` keeps two copies of a module (``original_module`` and the trained one): both come from
    the same Hugging Face weight.
    """
    if ".lora_" in peft_name:
        return None
    name = peft_name.removeprefix(PEFT_PREFIX)
    for wrapper in (".base_layer.", f".modules_to_save.{ADAPTER}.", ".original_module."):
        name = name.replace(wrapper, ".")
    return name


def export_adapter_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(peft_name, full tensor)`` for every LoRA adapter and ``modules_to_save`` weight (collective).

    Names are those of a PEFT ``adapter_model.safetensors`` (``...q_proj.lora_A.weight``), as
    :func:`~drivetrain_engine_core.kit.split_peft_name` writes them; base weights are not gathered.
    """
    for name, tensor in module.state_dict().items():
        kind, renamed = split_peft_name(name)
        if kind == "adapter":
            yield renamed, _full(tensor).detach()
        elif kind == "saved":
            yield PEFT_PREFIX + renamed, _full(tensor).detach()
