"""The value model's head: ``GPTModel``'s output layer replaced by one scalar per token.

It mirrors Hugging Face's ``*ForTokenClassification`` with ``num_labels=1`` (verl's critic convention), whose
``score`` weight (and bias, unless the config sets ``token_classification_bias: false``, as drivetrain's
reward models do) the bridge maps onto ``output_layer.weight`` / ``output_layer.bias``. The head is replicated
on every tensor-parallel rank (one output column cannot be split), so its input, the full hidden state, is the
same on every rank and so are its gradients.

A value model often starts from a language model's checkpoint (a reward model, a critic), which has no
``score`` head: the head then starts as transformers starts a missing ``score`` (normal with the config's
``initializer_range``, zero bias), drawn from a generator seeded by the engine seed, so that every rank starts
from the same head (megatron's DDP does not broadcast parameters).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from transformers import PretrainedConfig

SCORE_PREFIX = "score."
"""The head's parameters in a Hugging Face value-model checkpoint: ``score.weight``, ``score.bias``."""


class ValueHead(torch.nn.Linear):
    """``hidden -> 1`` linear with the call signature of megatron's ``ColumnParallelLinear``.

    Under sequence parallelism each tensor-parallel rank holds a slice of the tokens; the head gathers them
    first (as megatron's output layer does), so every rank scores the whole row. Its backward only splits: the
    head and the loss after it are replicated, so each rank's gradient of the gathered states is already the
    whole gradient (a reduce-scatter would count it once per rank).
    """

    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        *,
        bias: bool,
        sequence_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(hidden_size, 1, bias=bias, dtype=dtype)
        self.sequence_parallel_group = sequence_parallel_group

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output
        if self.sequence_parallel_group is not None:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.sequence_parallel_group
            )
        return super().forward(hidden_states), None


def attach_value_head(
    chunk: torch.nn.Module,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    seed: int,
    *,
    sequence_parallel_group: dist.ProcessGroup | None = None,
) -> None:
    """Replace the output layer of the last-stage chunk ``chunk`` by a :class:`ValueHead` laid out as the
    config's ``score`` head and initialised as transformers initialises one (the same on every rank); under
    sequence parallelism ``sequence_parallel_group`` is the tensor-parallel group it gathers the tokens over."""
    head = ValueHead(
        hf_config.hidden_size,
        dtype,
        bias=getattr(hf_config, "token_classification_bias", True),
        sequence_parallel_group=sequence_parallel_group,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = torch.empty(head.weight.shape, dtype=torch.float32).normal_(
            std=hf_config.initializer_range, generator=generator
        )
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.zero_()
    chunk.output_layer = head


def fresh_head_parameters(chunk: torch.nn.Module, checkpoint_names: Collection[str]) -> list[str]:
    """The head parameters of the last-stage ``chunk`` that the checkpoint lacks: all of them for a language
    model's checkpoint, ``bias`` for a reward model saved without one (a ``*ForSequenceClassification`` head
    has none, while the config may not say ``token_classification_bias: false``)."""
    return [
        name
        for name, _ in chunk.get_submodule("output_layer").named_parameters()
        if SCORE_PREFIX + name not in checkpoint_names
    ]


@contextmanager
def head_parameters_hidden(chunk: torch.nn.Module, names: Collection[str]) -> Iterator[None]:
    """Inside the block the head of ``chunk`` lacks the parameters ``names``: loading the checkpoint skips them
    (mbridge reads a name for every parameter it finds) and they keep their initial values, as transformers
    starts a missing ``score`` weight or bias.

    NOTE: every head parameter used to be read once ``score.weight`` existed, so a reward model without
    ``score.bias`` failed with mbridge's "Weights {'score.bias'} not found".
    """
    if not names:  # a language model, a first stage, or a head the checkpoint holds whole
        yield
        return
    head = chunk.get_submodule("output_layer")
    hidden = {name: head._parameters.pop(name) for name in names}
    try:
        yield
    finally:
        head._parameters.update(hidden)
