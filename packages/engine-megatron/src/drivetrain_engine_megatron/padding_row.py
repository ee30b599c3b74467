"""Hugging Face parity for the padding token's embedding row.

Hugging Face decoders build ``nn.Embedding(vocab, hidden, padding_idx=pad_token_id)``, whose backward never
writes a gradient into the padding row; megatron's ``VocabParallelEmbedding`` has no such notion. Whenever
the pad token occurs in a batch (it is often also the end-of-text token), the two would train differently, so
the row's gradient is zeroed here too, on the tensor-parallel rank that holds it.
"""

from __future__ import annotations

import torch


def freeze_padding_row(chunk: torch.nn.Module, pad_token_id: int | None) -> None:
    """Zero the gradient of ``pad_token_id``'s embedding row in ``chunk`` (no-op without an embedding)."""
    embedding = getattr(getattr(chunk, "embedding", None), "word_embeddings", None)
    if pad_token_id is None or embedding is None:
        return
    local_row = pad_token_id - embedding.vocab_start_index
    if not 0 <= local_row < embedding.weight.shape[0]:
        return

    def _zero_row(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[local_row] = 0
        return grad

    embedding.weight.register_hook(_zero_row)
