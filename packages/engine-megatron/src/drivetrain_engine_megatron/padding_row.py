"""Hugging Face parity for the padding token's embedding row.

Hugging Face decoders build ``nn.Embedding(vocab, hidden, padding_idx=pad_token_id)``, whose backward never
writes the *lookups* of the pad token into its row; megatron's ``VocabParallelEmbedding`` has no such notion.
Whenever the pad token occurs in a batch (it is often also the end-of-text token), the two would train
differently, so the embedding outputs at pad positions are cut from the graph here (values unchanged).

NOTE: not a hook zeroing the row of the weight's gradient: when the output layer is tied to the embedding,
that row also receives the output projection's gradient (the pad token's logit), which Hugging Face keeps.
"""

from __future__ import annotations

from typing import Any

import torch


def freeze_padding_lookups(chunk: torch.nn.Module, pad_token_id: int | None) -> None:
    """Stop gradients of ``pad_token_id``'s lookups in ``chunk``'s embedding (no-op without an embedding)."""
    embedding = getattr(getattr(chunk, "embedding", None), "word_embeddings", None)
    if pad_token_id is None or embedding is None:
        return

    def _detach_pad_positions(
        module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor
    ) -> torch.Tensor:
        is_pad = _output_layout(module, inputs[0] == pad_token_id)
        return torch.where(is_pad.unsqueeze(-1), output.detach(), output)

    embedding.register_forward_hook(_detach_pad_positions)


def _output_layout(embedding: Any, is_pad: torch.Tensor) -> torch.Tensor:
    """``is_pad`` (``[batch, seq]``, the embedding's input layout) in the layout of its output.

    Without sequence parallelism the output is ``[batch, seq, hidden]``; with it, megatron transposes to
    ``[seq, batch, hidden]`` and reduce-scatters the sequence over the tensor-parallel group, so this rank
    holds the ``tp_rank``-th contiguous slice of the sequence.
    """
    if not getattr(embedding, "reduce_scatter_embeddings", False):
        return is_pad
    group = embedding.tp_group
    return is_pad.transpose(0, 1).chunk(group.size())[group.rank()]
