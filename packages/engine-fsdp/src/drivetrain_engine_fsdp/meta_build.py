"""Build the model on the meta device: its structure, with values only for what the checkpoint does not hold.

Every parameter the checkpoint holds stays on ``meta`` (no memory) until ``materialize.py`` gives each rank its
shard. What the checkpoint does not hold is small and is made here, on CPU, with the same library calls and in
the same order as :func:`~drivetrain_engine_fsdp.model.build_model`, so the values are bit for bit those of the
full path:

- the construction is ``from_pretrained``'s: the config's model under ``torch.device("meta")`` (no weight
  initialisation runs and no random number is drawn);
- weights the checkpoint lacks (a value head on a language-model checkpoint) and buffers (rotary ``inv_freq``)
  are initialised by transformers' own ``initialize_weights``, which skips what is marked loaded
  (``_is_hf_initialized``), exactly as ``from_pretrained`` finishes a load;
- LoRA adapters are drawn by PEFT's own ``update_layer``, layer by layer in module order as ``get_peft_model``
  draws them;
- the checkpoint's names are the module's as ``save_pretrained`` writes them (``conversion.py``): a weight
  transformers stores renamed is read under its checkpoint name, and a fused one (MoE experts) from its pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from drivetrain_engine_core.backend import ModelConfig
from drivetrain_engine_core.kit import CheckpointIndex, read_checkpoint_index
from torch import nn

from .conversion import FusedWeight, base_model, checkpoint_layout, fused_weights
from .export import ADAPTER, hf_name
from .hf_weights import check_checkpoint
from .model import VALUE_HEAD, add_training_wrappers, auto_class, check_model_dir, hf_config


@dataclass(frozen=True)
class MetaModel:
    """A model built on ``meta`` and what is needed to give it values after sharding.

    Attributes:
        module: the module to shard; parameters the checkpoint holds are on ``meta``, the others on CPU.
        initial: full CPU values of the parameters the engine initialises (value head, LoRA adapters), by name.
        buffers: CPU values of the buffers (rotary ``inv_freq``) not read from the checkpoint, by name.
        checkpoint_names: checkpoint name of every parameter or buffer read from the checkpoint as one tensor.
        fused: how to join every parameter the checkpoint holds in pieces (fused MoE experts), by name.
        index: the checkpoint's names and shapes.
        hf_model: the transformers model (inside PEFT's wrapper), whose conversions join the pieces.
    """

    module: Any
    initial: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    checkpoint_names: dict[str, str]
    fused: dict[str, FusedWeight]
    index: CheckpointIndex
    hf_model: Any


def build_meta_model(model_config: ModelConfig, *, attn_implementation: str, seed: int) -> MetaModel:
    """Build the model of ``model_config`` on ``meta`` after checking its checkpoint against its config.

    Args:
        model_config: path, model type, LoRA and activation-checkpointing settings.
        attn_implementation: the transformers attention implementation.
        seed: seeds the value head and LoRA adapters, as in the full path.

    Raises:
        FileNotFoundError: no ``config.json`` or no ``*.safetensors`` in ``model_config.path``.
        CheckpointError: the checkpoint's names or shapes do not fit the config's model.
    """
    index = read_checkpoint_index(check_model_dir(model_config))
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = auto_class(model_config).from_config(
            hf_config(model_config),
            dtype=torch.float32,
            attn_implementation=attn_implementation,
            trust_remote_code=model_config.trust_remote_code,
        )
    persistent = _unique(model.state_dict(keep_vars=True))
    layout = checkpoint_layout(model, persistent)
    expected = {key: shape for pieces in layout.values() for key, shape in pieces.items()}
    fresh = [key for name in persistent if name.startswith(f"{VALUE_HEAD}.") for key in layout[name]]
    fresh += [key for name, _ in model.named_buffers() if name in layout for key in layout[name]]
    loaded = check_checkpoint(index, expected, may_be_fresh=fresh)
    _initialize_missing(model, {id(persistent[name]) for name in persistent if set(layout[name]) <= loaded})
    renamed = {name: next(iter(pieces)) for name, pieces in layout.items() if len(pieces) == 1}
    fused = fused_weights(model, index.shapes)
    # NOTE: the adapter structure is all that is kept from get_peft_model here (its draws are undone and its
    # adapters end up on the meta device of their base layers); the values are drawn again just below.
    with torch.random.fork_rng(devices=[]):
        model = add_training_wrappers(model, model_config)
    if model_config.lora is not None:
        _draw_adapters(model)
    meta_names = _hf_names_on_meta(model)
    return MetaModel(
        module=model,
        initial={name: p.detach() for name, p in model.named_parameters() if not p.is_meta},
        buffers={name: b for name, b in model.named_buffers() if not b.is_meta},
        checkpoint_names={name: renamed.get(hf, hf) for name, hf in meta_names.items() if hf not in fused},
        fused={name: fused[hf] for name, hf in meta_names.items() if hf in fused},
        index=index,
        hf_model=base_model(model),
    )


@torch.no_grad()
def _initialize_missing(model: Any, loaded: set[int]) -> None:
    """Give CPU values to what the checkpoint will not fill, with transformers' own initialisation.

    This is the end of ``from_pretrained`` (``_finalize_model_loading``) without the loading: what is loaded is
    marked initialised, everything else moves from ``meta`` to empty CPU storage, and ``initialize_weights``
    initialises what is not marked (drawing from the seeded generator in the same order).
    """
    for owner, name, tensor in _tensors(model):
        if id(tensor) in loaded:
            tensor._is_hf_initialized = True  # type: ignore[attr-defined]
            continue
        empty = torch.empty_like(tensor, device="cpu")
        setattr(
            owner,
            name,
            nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty,
        )
    model.initialize_weights()


def _unique(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each shared tensor once, under its first name (tied embeddings: the input embedding's)."""
    seen: set[int] = set()
    unique = {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique[name] = tensor
    return unique


def _tensors(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(owning module, attribute name, tensor)`` of every parameter and buffer, each shared one once."""
    seen: set[int] = set()
    found = []
    for owner in model.modules():
        for name, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((owner, name, tensor))
    return found


def _draw_adapters(model: Any) -> None:
    """Draw every LoRA adapter's initial values on CPU, through PEFT, in ``get_peft_model``'s order.

    NOTE: PEFT moves a new adapter to the device of its base layer's weight (``meta`` here, which would drop the
    values it has just drawn). For the call, the base layer is swapped for a module without weights, so PEFT
    finds no device to move to and leaves the adapter where it was made: on CPU.
    """
    from peft.tuners.lora import LoraLayer

    config = model.peft_config[ADAPTER]
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        base_layer = layer.base_layer
        layer.base_layer = nn.Identity()
        try:
            layer.update_layer(ADAPTER, layer.r[ADAPTER], lora_alpha=layer.lora_alpha[ADAPTER], config=config)
        finally:
            layer.base_layer = base_layer


def _hf_names_on_meta(model: nn.Module) -> dict[str, str]:
    """Name -> transformers name of every parameter and buffer still on ``meta`` (to be read from the
    checkpoint)."""
    names = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            checkpoint_name = hf_name(name)
            assert checkpoint_name is not None  # adapters are drawn on CPU above, never left on meta
            names[name] = checkpoint_name
    return names
