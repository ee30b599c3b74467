"""The norms of drivetrain's layer spec: torch's ``RMSNorm``/``LayerNorm``, usable under sequence parallelism.

Megatron's local spec builds its norms through ``WrappedTorchNorm`` (without Apex), which refuses sequence
parallelism, or Apex's ``FusedLayerNorm``, which refuses RMSNorm. A norm is per token, so on a sequence shard
it computes exactly what it computes on the whole row; what sequence parallelism needs in addition is that the
norm's weight gradient, a partial sum over this rank's tokens, is summed over the tensor-parallel ranks.
Megatron's ``finalize_model_grads`` does that for every parameter marked ``sequence_parallel`` (as Transformer
Engine's and Apex's norms mark theirs), so :class:`DrivetrainNorm` marks its parameters.
"""

from __future__ import annotations

from typing import Any

import torch


class DrivetrainNorm:
    """A ``ModuleSpec`` module with megatron's norm signature that builds a plain torch norm (see module doc)."""

    def __new__(  # type: ignore[misc]
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        del persist_layer_norm, zero_centered_gamma, normalization  # megatron's signature; config decides
        kind = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}.get(config.normalization)
        if kind is None:
            raise ValueError(f"normalization {config.normalization!r} is not RMSNorm or LayerNorm.")
        norm = kind(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm
