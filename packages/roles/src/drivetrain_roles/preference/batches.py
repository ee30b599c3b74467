"""Preference pairs as no-padding batches: two sequences per pair sharing a ``uid``, the chosen one first.

Core keeps a pair in one micro-batch and on one data-parallel rank (group-aware batching), which the pairwise
losses need. A DPO sequence is prompt + response with the loss mask on the response. A reward-model sequence
is prompt + response (without the eos) + one readout token with the loss mask on the readout only: the value
at a position is the head read at the hidden state of the token before it (ARCHITECTURE §7.1), so the readout
position holds the score of the last response token, which is what a Hugging Face
``*ForSequenceClassification`` model returns for ``tokenizer(prompt + response)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from drivetrain_engine_core.data.batch import make_batch
from drivetrain_engine_core.data.groups import UID
from tensordict import TensorDict

from ..losses.preference import CHOSEN, REF_LOGP
from ..sft.batches import response_mask
from ..sft.data import Example
from .data import PairExample


def make_pair_batch(
    pairs: Sequence[PairExample],
    uids: Sequence[int],
    *,
    ref_logps: torch.Tensor | None = None,
    readout_token: int | None = None,
    eos_token_id: int | None = None,
) -> TensorDict:
    """The batch of ``pairs`` (chosen, rejected, chosen, ...), pair ``i`` under ``uids[i]``.

    Args:
        pairs: the pairs.
        uids: one id per pair (its index in the data set, so ids are unique over ranks).
        ref_logps: ``(2 * len(pairs),)`` reference log-probs of the sequences in batch order (DPO).
        readout_token: build reward-model sequences ending with this token id; ``None`` builds DPO sequences.
        eos_token_id: the tokenizer's eos, dropped from the end of reward-model responses.
    """
    sequences = [side for pair in pairs for side in (pair.chosen, pair.rejected)]
    if readout_token is None:
        ids = [s.prompt_ids + s.response_ids for s in sequences]
        masks = [response_mask(s) for s in sequences]
    else:
        ids = [[*scored_ids(s, eos_token_id), readout_token] for s in sequences]
        masks = [[False] * (len(i) - 1) + [True] for i in ids]
    fields: dict[str, torch.Tensor] = {
        UID: torch.tensor([uid for uid in uids for _ in range(2)], dtype=torch.int64),
        CHOSEN: torch.tensor([True, False] * len(pairs)),
    }
    if ref_logps is not None:
        fields[REF_LOGP] = ref_logps.float()
    return make_batch(
        [torch.tensor(i, dtype=torch.long) for i in ids],
        loss_mask=[torch.tensor(m, dtype=torch.bool) for m in masks],
        **fields,  # type: ignore[arg-type]  # dense per-sequence fields
    )


def scored_ids(example: Example, eos_token_id: int | None = None) -> list[int]:
    """The tokens a reward model scores: prompt + response, without the response's trailing eos."""
    response = example.response_ids
    if eos_token_id is not None and response and response[-1] == eos_token_id:
        response = response[:-1]
    return example.prompt_ids + response
