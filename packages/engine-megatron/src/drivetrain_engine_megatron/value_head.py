"""The value model's head: ``GPTModel``'s output layer replaced by one scalar per token.

It mirrors Hugging Face's ``*ForTokenClassification`` with ``num_labels=1`` (verl's critic convention), whose
``score`` weight and bias the bridge maps onto ``output_layer.weight`` / ``output_layer.bias``. The head is
replicated on every tensor-parallel rank (one output column cannot be split), so its input, the full hidden
state, is the same on every rank and so are its gradients.
"""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Linear):
    """``hidden -> 1`` linear with the call signature of megatron's ``ColumnParallelLinear``."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, 1, bias=True, dtype=dtype)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output
        return super().forward(hidden_states), None


def attach_value_head(chunk: torch.nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
    """Replace the output layer of the last-stage chunk ``chunk`` by a :class:`ValueHead`."""
    chunk.output_layer = ValueHead(hidden_size, dtype)
