"""Random no-padding batches for engine tests: prompts masked out, responses trained on."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from drivetrain_engine_core._data.batch import make_batch


def random_batch(
    *,
    vocab_size: int,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    seed: int,
    with_returns: bool = False,
) -> TensorDict:
    """A no-padding batch of random tokens; ``loss_mask`` is true on response tokens only.

    Args:
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        prompt_lengths: prompt tokens of each sequence.
        response_lengths: response tokens of each sequence (same count as ``prompt_lengths``).
        seed: seed of a private generator, so the global RNG is untouched.
        with_returns: add a per-token float ``returns`` field (value-model targets).

    Raises:
        ValueError: the two length lists differ in size or a sequence would be empty.
    """
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(
            f"random_batch: {len(prompt_lengths)} prompt lengths but {len(response_lengths)} response lengths; "
            "give one of each per sequence."
        )
    if any(p < 0 or r < 0 or p + r == 0 for p, r in zip(prompt_lengths, response_lengths, strict=True)):
        raise ValueError("random_batch: lengths must be >= 0 and every sequence needs at least one token.")
    generator = torch.Generator().manual_seed(seed)
    totals = [p + r for p, r in zip(prompt_lengths, response_lengths, strict=True)]
    input_ids = [torch.randint(0, vocab_size, (n,), generator=generator) for n in totals]
    loss_mask = [
        torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(r, dtype=torch.bool)])
        for p, r in zip(prompt_lengths, response_lengths, strict=True)
    ]
    fields = {}
    if with_returns:
        fields["returns"] = [torch.randn(n, generator=generator) for n in totals]
    return make_batch(input_ids, loss_mask=loss_mask, **fields)
