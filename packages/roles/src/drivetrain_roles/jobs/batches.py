"""Which examples each optimizer step trains on, and turning examples into no-padding batches.

The order is a function of ``(seed, step)`` only: epoch ``e`` is a fixed permutation seeded by ``seed + e``,
and step ``s`` takes the next ``batch_size`` indices of it. A resumed run therefore sees exactly the batches
the uninterrupted run would have seen, with nothing but the step number saved; data-parallel rank ``r`` of
``d`` takes every ``d``-th index of the step's global batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
from drivetrain_engine_core.backend import EngineConfig
from drivetrain_engine_core.kit import distributed
from tensordict import TensorDict

from .data import DataError, Example


@dataclass(frozen=True)
class StepSampler:
    """Global-batch schedule over ``num_examples`` examples.

    Attributes:
        num_examples: size of the training set.
        batch_size: sequences per step over every data-parallel rank.
        seed: seed of the permutations.
        setting: the config field ``batch_size`` comes from (what an error tells the user to change).
    """

    num_examples: int
    batch_size: int
    seed: int
    setting: str = "trainer.batch_size"

    def __post_init__(self) -> None:
        if self.batch_size > self.num_examples:
            raise DataError(
                f"{self.setting}={self.batch_size} is larger than the {self.num_examples} training examples; "
                f"lower {self.setting} or add data."
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per pass over the data (the incomplete tail of a permutation is skipped)."""
        return self.num_examples // self.batch_size

    def global_indices(self, step: int) -> torch.Tensor:
        """Example indices of step ``step`` (0-based) over all ranks."""
        epoch, within = divmod(step, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_examples, generator=generator)
        return order[within * self.batch_size : (within + 1) * self.batch_size]

    def local_indices(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """This data-parallel rank's share of step ``step``."""
        return self.global_indices(step)[dp_rank::dp_size].tolist()


def check_batch_size(name: str, batch_size: int, engine_config: EngineConfig) -> None:
    """Every data-parallel rank needs the same number of sequences per step; checked before anything runs
    (a warm start first would be time lost), with the data-parallel size the engine config will give.

    Raises:
        ConfigError: the engine's parallel sizes do not fit the launched world.
        DataError: ``batch_size`` (the field ``name``) is not a multiple of the data-parallel size.
    """
    dp_size = engine_config.data_parallel_size(distributed.world_size())
    if batch_size % dp_size:
        raise DataError(
            f"{name}={batch_size} is not divisible by the data-parallel size {dp_size}; use a multiple of {dp_size}."
        )


def make_sft_batch(examples: Sequence[Example]) -> TensorDict:
    """A no-padding batch whose ``loss_mask`` selects the response tokens."""
    return batch_from_lists([e.token_ids for e in examples], [response_mask(e) for e in examples])


def batch_from_lists(
    token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]], **fields: torch.Tensor
) -> TensorDict:
    """Core's ``make_batch`` of per-sequence token ids and loss masks given as lists (and dense ``fields``).

    NOTE: each field is made as one host tensor and split into per-sequence views; a tensor per sequence cost
    5% of a small model's SFT step (profiled).
    """
    from drivetrain_engine_core.job import make_batch

    lengths = [len(ids) for ids in token_ids]
    flat_ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long)
    flat_mask = torch.tensor(list(chain.from_iterable(loss_masks)), dtype=torch.bool)
    return make_batch(
        flat_ids.split(lengths),
        loss_mask=flat_mask.split(lengths),
        **fields,  # type: ignore[arg-type]  # dense per-sequence fields
    )


def response_mask(example: Example) -> list[bool]:
    """The loss mask of ``example``'s tokens: its response tokens and earlier assistant turns, except a first
    token of the sequence.

    NOTE: a sequence's first token has nothing before it to be predicted from (its log-prob is 0 by
    convention), so it is never a loss token: with an empty prompt and a tokenizer without BOS (Qwen) it counted
    in the token mean without being trained, diluting the loss.
    """
    mask = [False] * len(example.prompt_ids) + [True] * len(example.response_ids)
    for start, end in example.earlier_turn_spans:
        mask[start:end] = [True] * (end - start)
    return [False, *mask[1:]] if mask else mask


def check_held_out_size(count: int, engine_config: EngineConfig, what: str = "examples") -> None:
    """Every data-parallel rank scores a share of the held-out set, so a non-empty one needs an example per rank
    (a rank left without one failed while the others waited in a collective).

    Raises:
        DataError: ``0 < count <`` the data-parallel size.
    """
    dp_size = engine_config.data_parallel_size(distributed.world_size())
    if 0 < count < dp_size:
        raise DataError(
            f"the held-out set has {count} {what}, fewer than the {dp_size} data-parallel ranks that each score a "
            f"share of it; give it at least {dp_size} (data.val_files, or data.generated_val_size for generated "
            "data), or none to skip held-out evaluation."
        )
