"""``export_weights``: full Hugging Face tensors, one at a time, with LoRA adapters merged into the base weights.

Sharded parameters are all-gathered one by one (``DTensor.full_tensor``), so peak memory is one full tensor,
not the whole model. For a PEFT model, ``x.base_layer.weight`` is yielded as ``x.weight`` plus
``lora_B @ lora_A * alpha / rank``; PEFT's ``base_model.model.`` prefix and ``modules_to_save`` copies map
back onto the plain names. Weights transformers keeps in another layout than its checkpoints (fused MoE experts)
leave in the checkpoint's layout, as ``save_pretrained`` writes them (``conversion.unfuse``).
``export_weight_shards`` yields the same as groups of local shards with their gathers, so a delta stream gathers
only what changed (core's ``handoff.local_shards``). ``export_adapter_weights`` streams the adapters alone, for a
rollout that applies LoRA itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch
from drivetrain_engine_core.backend import LoraConfig, ShardedWeight
from drivetrain_engine_core.kit import PEFT_PREFIX, split_peft_name
from torch import nn
from torch.distributed.tensor import DTensor

from .conversion import base_model, unfuse
from .shards import local_shard

ADAPTER = "default"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def export_full_weights(module: nn.Module, lora: LoraConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every weight of the model in its checkpoint layout (a collective:
    every rank iterates)."""
    for group in export_weight_shards(module, lora):
        yield from group.gather()


def export_weight_shards(module: nn.Module, lora: LoraConfig | None) -> Iterator[ShardedWeight]:
    """What :func:`export_full_weights` yields, as one group per weight the module holds: this rank's local
    shards of it (and of its LoRA adapters, which the merged weight is computed from) and the gather of its
    checkpoint-layout tensors. Nothing is gathered until a group's ``gather`` is called."""
    model, state = base_model(module), module.state_dict()
    scale = 0.0 if lora is None else lora.alpha / lora.rank
    for name, tensor in state.items():
        plain = name if lora is None else _plain_name(name)
        if plain is None:
            continue
        sources = [tensor]
        if lora is not None and name.endswith(".base_layer.weight"):
            stem = name[: -len(".base_layer.weight")]
            sources += [state[f"{stem}.lora_A.{ADAPTER}.weight"], state[f"{stem}.lora_B.{ADAPTER}.weight"]]
        local = tuple(local_shard(source).detach() for source in sources)
        yield ShardedWeight(key=name, local=local, gather=partial(_gather, model, plain, sources, scale))


def _gather(
    model: nn.Module, name: str, sources: list[torch.Tensor], scale: float
) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint-layout tensors of the weight ``name`` from its full ``sources`` (a base weight and its
    adapters ``lora_A``, ``lora_B``: folded in, ``weight + lora_B @ lora_A * scale``)."""
    weight = _full(sources[0]).detach()
    if len(sources) == 3:
        down, up = (_full(source).detach() for source in sources[1:])
        weight = weight + (up.float() @ down.float()).to(weight.dtype) * scale
    return unfuse(model, name, weight).items()


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
