"""Load another backend's (or layout's) step from its full state under Hugging Face names (``hf_state_resume``).

The weights go through the same mbridge ``load_weights`` that builds the model from a Hugging Face directory
(names, fused QKV and gate/up joined, vocabulary padded, tied output layer, TP slices, pipeline stages), fed
from the step's tensors instead of safetensors files. Each Adam moment takes the same road: it is loaded into
the model's parameters, which then hold it in this layout's shape, and copied from there into the optimizer
state (a distributed optimizer keeps this rank's range of each flattened parameter). The weights are loaded
last and the optimizer's main parameters refreshed from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.kit import ADAM_MOMENTS, WEIGHT, HFTrainingState, read_checkpoint_index
from megatron.core.optimizer import MegatronOptimizer

from .model import BuiltModel

_EMBEDDING = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


def load_hf_state(
    model: BuiltModel, optimizer: MegatronOptimizer | None, state: HFTrainingState, *, model_path: str
) -> None:
    """Fill ``model`` (and ``optimizer``) from ``state`` (collective over the model-parallel groups)."""
    hf_config = model.bridge.hf_config
    tied = {_LM_HEAD: _EMBEDDING} if getattr(hf_config, "tie_word_embeddings", False) else {}
    state.check_fits(read_checkpoint_index(Path(model_path)).shapes, tied=tied)
    if optimizer is not None:
        from .checkpoint import allocate_adam_state

        allocate_adam_state(optimizer)
        for moment in ADAM_MOMENTS:
            _load_into_parameters(model, state.tensors(moment))
            state.release(moment)
            _copy_parameters_to_optimizer(model, optimizer, moment)
        _set_adam_step(optimizer, state.adam_step())
    _load_into_parameters(model, state.tensors(WEIGHT))
    state.release(WEIGHT)
    if optimizer is not None:
        optimizer.reload_model_params()


class _TensorSource:
    """The part of mbridge's safetensors reader that ``Bridge.load_weights`` calls, serving given tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def load_one_hf_weight(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def load_some_hf_weight(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {name: self._tensors[name] for name in names}


def _load_into_parameters(model: BuiltModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """mbridge's own Hugging Face import, reading ``tensors`` instead of a directory's files."""
    bridge: Any = model.bridge
    # NOTE: an instance attribute shadows the class's reader factory for this one call; removing it restores it.
    bridge._get_safetensor_io = lambda path: _TensorSource(tensors)
    try:
        with torch.no_grad():
            bridge.load_weights(model.unwrapped, "<checkpoint state>", memory_efficient=True)
    finally:
        del bridge._get_safetensor_io


def _copy_parameters_to_optimizer(model: BuiltModel, optimizer: MegatronOptimizer, moment: str) -> None:
    """Copy every parameter's current value into its ``moment`` state (this rank's range of it)."""
    for chunk in model.unwrapped:
        for parameter in chunk.parameters():
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                target = _moment_view(inner, parameter, moment)
                if target is not None:
                    target[1].copy_(parameter.detach().reshape(-1)[target[0]].view_as(target[1]))


def _moment_view(inner: Any, parameter: torch.nn.Parameter, moment: str) -> tuple[slice, torch.Tensor] | None:
    """The flat range of ``parameter`` this optimizer holds and the state tensor holding it, or ``None``."""
    owned = getattr(inner, "model_param_group_index_map", None)
    if owned is not None:  # the distributed optimizer: a range of the flattened parameter
        if parameter not in owned:
            return None
        span = inner._get_model_param_range_map(parameter)["param"]
        return slice(span.start, span.end), inner._get_main_param_and_optimizer_states(parameter)[moment]
    torch_state = inner.optimizer.state
    if parameter not in torch_state:
        return None
    return slice(None), torch_state[parameter][moment]


def _set_adam_step(optimizer: MegatronOptimizer, step: int) -> None:
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            if "step" in group:
                group["step"] = step
            for parameter in group["params"]:
                inner.optimizer.state[parameter]["step"] = torch.tensor(float(step), dtype=torch.float32)
