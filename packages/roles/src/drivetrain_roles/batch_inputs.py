"""Roles accept a no-padding batch or a left-right padded one, and answer in the form they were given.

The padded form is the one rollout engines produce: ``input_ids``/``attention_mask`` ``(B, P + R)`` with the
prompts left-padded and the responses right-padded, ``response_mask`` ``(B, R)``, and response-aligned
per-token fields (``old_log_probs``, ``advantages``, ...) of shape ``(B, R)``. Core converts it exactly
(:mod:`drivetrain_engine_core.data.padding`); the roles compute on the no-padding form only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drivetrain_engine_core.data.batch import is_jagged
from drivetrain_engine_core.data.response import response_to_padded
from drivetrain_engine_core.errors import BatchError
from tensordict import TensorDict

PADDED_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids", "response_mask")


@dataclass(frozen=True)
class RoleBatch:
    """A batch in no-padding form plus what is needed to answer in the caller's form.

    Attributes:
        nopad: the no-padding batch the engine computes on.
        response_lengths: ``(B,)`` response tokens per sequence when the caller sent a padded batch.
        max_response_len: ``R`` of the caller's padded response tensors.
    """

    nopad: TensorDict
    response_lengths: torch.Tensor | None = None
    max_response_len: int = 0

    @property
    def was_padded(self) -> bool:
        return self.response_lengths is not None

    @classmethod
    def wrap(cls, batch: TensorDict) -> RoleBatch:
        """Convert a padded batch (dense 2-D ``input_ids`` with ``attention_mask``); pass no-padding through.

        Raises:
            BatchError: ``input_ids`` is dense but ``attention_mask`` or ``response_mask`` is missing.
        """
        if "input_ids" not in batch or is_jagged(batch.get("input_ids")):
            return cls(nopad=batch)
        missing = [key for key in ("attention_mask", "response_mask") if key not in batch]
        if missing:
            raise BatchError(
                f"a padded batch (dense input_ids) needs {missing[0]!r}; it has {sorted(batch.keys())}. Send "
                "attention_mask (B, P+R) and response_mask (B, R), or a no-padding batch built with make_batch."
            )
        from drivetrain_engine_core.data.padding import padded_to_nopad

        fields = {key: batch.get(key) for key in list(batch.keys()) if key not in PADDED_KEYS}
        nopad = padded_to_nopad(
            batch["input_ids"],
            batch["attention_mask"],
            position_ids=batch.get("position_ids", None),
            response_mask=batch["response_mask"],
            **fields,
        )
        response_mask = batch["response_mask"]
        return cls(
            nopad=nopad,
            response_lengths=_response_lengths(response_mask),
            max_response_len=response_mask.shape[-1],
        )

    def restore(self, outputs: TensorDict | None) -> TensorDict | None:
        """Per-token ``outputs`` in the caller's form: jagged as is, or response-aligned ``(B, R)`` dense."""
        if outputs is None or not self.was_padded:
            return outputs
        assert self.response_lengths is not None  # was_padded
        dense = {
            key: response_to_padded(outputs[key], self.response_lengths, self.max_response_len)[0]
            for key in list(outputs.keys())
            if is_jagged(outputs.get(key))
        }
        return TensorDict(dense, batch_size=outputs.batch_size)


def _response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """Response positions up to the last masked-in one of each row (holes of multi-turn masks included)."""
    width = response_mask.shape[-1]
    last = width - response_mask.long().flip(-1).argmax(-1)
    return torch.where(response_mask.any(-1), last, torch.zeros_like(last))
