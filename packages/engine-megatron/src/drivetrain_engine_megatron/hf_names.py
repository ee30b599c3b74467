"""Checkpoint tensors -> Hugging Face names and tensors, without megatron process groups (for the merger).

A step's ``model/`` (dist_checkpointing ``torch_dist``) holds **full** tensors: TP shards concatenated
(``linear_qkv`` in megatron's per-query-group layout, ``linear_fc1`` as ``[gate; up]``) and the decoder
layers stacked on a leading dimension under ``decoder.layers.<param>`` (a mixture of experts' expert weights
on a second one). This module unstacks the layers (and experts) and
converts each tensor with the same mbridge bridge the engine uses, built here for a world of one, so the
merged weights equal ``MegatronEngine.export_weights()``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from mbridge.core.parallel_states import ParallelStates
from transformers import PretrainedConfig

from .bridge import bridge_class

_LAYERS = "decoder.layers."
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT_LAYER = "output_layer.weight"
_STACKED_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.experts\.(linear_fc[12]\.weight)$")


def unstack_layers(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``decoder.layers.<p>`` of shape ``[layers, ...]`` -> ``decoder.layers.<i>.<p>`` per layer; else as is."""
    if name.startswith(_LAYERS) and not name[len(_LAYERS) :].split(".", 1)[0].isdigit():
        rest = name[len(_LAYERS) :]
        for index in range(tensor.shape[0]):
            yield f"{_LAYERS}{index}.{rest}", tensor[index]
    else:
        yield name, tensor


def unstack_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's ``mlp.experts.experts.linear_fc<N>.weight`` of shape ``[experts, ...]`` (the key the sequential
    expert MLP stores its experts under, stacked on a leading axis) -> mbridge's grouped names
    ``mlp.experts.linear_fc<N>.weight<e>`` per expert; else as is."""
    stacked = _STACKED_EXPERTS.match(name)
    if stacked is None:
        yield name, tensor
        return
    for expert in range(tensor.shape[0]):
        yield f"{stacked[1]}.{stacked[2]}{expert}", tensor[expert]


def checkpoint_tensors_to_hf(
    hf_config: PretrainedConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    value_model: bool,
    vocab_size: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Convert ``(checkpoint key, full tensor)`` pairs of a step's ``model/`` to ``(hf_name, tensor)`` pairs.

    Args:
        hf_config: the config of the model the step was trained from (manifest ``model_path``).
        tensors: the step's model tensors; ``_extra_state`` entries are skipped.
        value_model: manifest ``backend_info["value_head"]``.
        vocab_size: manifest ``backend_info["vocab_size"]``; padded vocabulary rows are dropped.
    """
    bridge = bridge_class(hf_config, value_model=value_model)(
        hf_config, dtype=torch.float32, parallel_states=ParallelStates()
    )
    for key, stacked in tensors:
        if "_extra_state" in key:
            continue
        for name, tensor in (
            expert for layer in unstack_layers(key, stacked) for expert in unstack_experts(*layer)
        ):
            if name == _EMBEDDING or (name == _OUTPUT_LAYER and not value_model):
                tensor = tensor[:vocab_size]
            hf_names, hf_tensors = bridge._weight_to_hf_format(name, tensor)
            yield from zip(hf_names, hf_tensors, strict=True)
