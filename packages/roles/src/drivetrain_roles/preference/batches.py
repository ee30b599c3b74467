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
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import UID, MicroBatchConfig
from tensordict import TensorDict

from ..jobs.batches import batch_from_lists, response_mask
from ..jobs.data import DataError, Example
from ..losses.preference import CHOSEN, MARGIN, REF_LOGP
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
        ids = [s.token_ids for s in sequences]
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
    if readout_token is not None:
        fields[MARGIN] = torch.tensor([pair.margin for pair in pairs for _ in range(2)], dtype=torch.float32)
    return batch_from_lists(ids, masks, **fields)


def check_pair_micro_batches(micro_batch: MicroBatchConfig) -> None:
    """A pair's two sequences share one micro-batch, so a fixed micro-batch holds at least two sequences.

    Checked before the SFT warm start (core refused it only at the first pairwise step, after the warm start).

    Raises:
        ConfigError: ``micro_batch_size`` is 1.
    """
    if micro_batch.micro_batch_size is not None and micro_batch.micro_batch_size < 2:
        raise ConfigError(
            f"engine.micro_batch.micro_batch_size={micro_batch.micro_batch_size}, but the chosen and rejected "
            "sides of a pair always share one micro-batch; set it to at least 2 (one pair per micro-batch)."
        )


def check_pair_token_budget(pairs: Sequence[PairExample], micro_batch: MicroBatchConfig) -> None:
    """With dynamic batching both sides of every pair must fit one micro-batch's token budget (a hard cap);
    checked when the pairs are loaded, not at the step that draws the longest one.

    Raises:
        DataError: the longest pair has more tokens than ``max_tokens``.
    """
    if micro_batch.max_tokens is None or not pairs:
        return
    longest = max(pair.chosen.length + pair.rejected.length for pair in pairs)
    if longest > micro_batch.max_tokens:
        raise DataError(
            f"a pair has {longest} tokens (chosen + rejected, which share a micro-batch) but "
            f"engine.micro_batch.max_tokens={micro_batch.max_tokens}; raise it to at least {longest} (twice "
            "data.max_length covers every pair), or lower data.max_length."
        )


def scored_ids(example: Example, eos_token_id: int | None = None) -> list[int]:
    """The tokens a reward model scores: prompt + response, without the response's trailing eos."""
    response = example.response_ids
    if eos_token_id is not None and response and response[-1] == eos_token_id:
        response = response[:-1]
    return example.prompt_ids + response
