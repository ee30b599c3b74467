"""Where a transformers model holds each tensor of its checkpoint layout (a weight stream, an export).

Engines stream weights as ``save_pretrained`` writes them, and transformers 5 builds some modules in another
layout: a Qwen3-MoE, Qwen2-MoE or Mixtral layer keeps its experts fused (``mlp.experts.gate_up_proj``) while
the stream sends one tensor per expert and projection (``mlp.experts.N.gate_proj.weight``), and Mixtral's
checkpoint renames ``mlp`` to ``block_sparse_moe``. transformers' own ``revert_weight_conversion`` says which
module weight each checkpoint tensor comes from; applied to a tensor of position numbers it also says *which
elements*, so a streamed piece is copied into its fused weight, and read back from it, element for element
(both exact, whatever the conversion: stacking, concatenation, renaming). The ``hf`` rollout serves streams
through it, and the jobs load an engine's export into a model (``final_model``, evaluation) through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.core_model_loading import revert_weight_conversion


class CheckpointLayout:
    """The checkpoint names of a served model's weights and where their elements live in the model.

    Args:
        model: the served ``transformers`` model.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self.owner: dict[str, str] = {}
        """Checkpoint name -> the module weight (state-dict name) that holds it."""
        for name, tensor in model.state_dict().items():
            for key in revert_weight_conversion(model, {name: tensor.to("meta")}):
                self.owner[key] = name
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # a fused weight's pieces not yet streamed

    def is_direct(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is a module weight as it is (same name)."""
        return self.owner.get(name) == name

    def copy_piece(self, module_weight: torch.Tensor, name: str, piece: torch.Tensor) -> None:
        """Copy the checkpoint tensor ``name`` into the elements of ``module_weight`` it comes from."""
        indices = self._pending.get(self.owner[name])
        if indices is None or name not in indices:
            indices = self._pending[self.owner[name]] = self._piece_indices(self.owner[name], module_weight)
        index = indices.pop(name)
        if not indices:  # the weight's last piece: drop its position map
            del self._pending[self.owner[name]]
        if tuple(index.shape) != tuple(piece.shape):
            raise ValueError(
                f"{name}: shape {tuple(piece.shape)}, the served model's piece {tuple(index.shape)}"
            )
        module_weight.view(-1).index_copy_(0, index.reshape(-1), piece.reshape(-1).to(module_weight.dtype))

    def load(self, weights: Mapping[str, torch.Tensor], optional: set[str]) -> None:
        """Copy a whole export (checkpoint name -> tensor) into the model.

        Raises:
            ValueError: names the model does not hold, or names it holds missing (but those in ``optional``).
        """
        missing = sorted(set(self.owner) - set(weights) - optional)
        unexpected = sorted(set(weights) - set(self.owner))
        if missing or unexpected:
            raise ValueError(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        state = self._model.state_dict()
        with torch.no_grad():
            for name, tensor in weights.items():
                if self.is_direct(name):
                    state[name].copy_(tensor)
                else:
                    self.copy_piece(state[self.owner[name]], name, tensor)

    def read_piece(self, name: str) -> torch.Tensor | None:
        """The checkpoint tensor ``name`` as the model serves it (``None``: no such name)."""
        owner = self.owner.get(name)
        if owner is None:
            return None
        return revert_weight_conversion(self._model, {owner: self._model.state_dict()[owner]})[name]

    def forget(self) -> None:
        """Drop the position maps of a stream that ended or failed."""
        self._pending = {}

    def _piece_indices(self, owner: str, module_weight: torch.Tensor) -> dict[str, torch.Tensor]:
        positions = torch.arange(module_weight.numel(), device=module_weight.device).view(module_weight.shape)
        return dict(revert_weight_conversion(self._model, {owner: positions}))
