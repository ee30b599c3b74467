"""Roles accept a no-padding batch or a left-right padded one, and answer in the form they were given.

The padded form is the one rollout engines produce (verl's layout): ``(B, L)`` tensors with the prompts
left-padded and the responses right-padded, ``attention_mask`` at real tokens, ``response_mask`` where the
loss applies, other per-token fields (``old_log_probs``, ``advantages``, ...) of the same ``(B, L)`` width
(verl keeps these response-wide, ``(B, R)``: widen them to the whole row), and per-sequence ``(B,)`` fields
(``uid``, scores) kept as they are. Core converts it exactly
(:func:`drivetrain_engine_core.job.padded_to_nopad`); the roles compute on the no-padding form only
and scatter per-token outputs back to the real-token positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import ATTENTION_MASK, LOSS_MASK, is_jagged, padded_to_nopad
from tensordict import TensorDict

PADDED_KEYS: tuple[str, ...] = ("input_ids", ATTENTION_MASK, "position_ids", "response_mask")


@dataclass(frozen=True)
class RoleBatch:
    """A batch in no-padding form plus what is needed to answer in the caller's form.

    Attributes:
        nopad: the no-padding batch the engine computes on.
        attention_mask: the caller's bool ``(B, L)`` mask when it sent a padded batch, else ``None``.
    """

    nopad: TensorDict
    attention_mask: torch.Tensor | None = None

    @classmethod
    def wrap(cls, batch: TensorDict, *, needs_loss_mask: bool = False) -> RoleBatch:
        """Convert a padded batch (dense 2-D ``input_ids`` with ``attention_mask``); pass no-padding through.

        A padded batch says where the loss applies with ``response_mask``; without it the no-padding batch has
        no ``loss_mask`` (padding conversion marked every real token, so an update trained on the prompts too,
        with no error), which inference does not need and an update (``needs_loss_mask``) refuses.

        Raises:
            BatchError: ``input_ids`` is dense but ``attention_mask`` (or, with ``needs_loss_mask``,
                ``response_mask``) is missing.
        """
        if "input_ids" not in batch or is_jagged(batch.get("input_ids")):
            return cls(nopad=batch)
        needed = [ATTENTION_MASK, *(["response_mask"] if needs_loss_mask else [])]
        missing = [key for key in needed if key not in batch]
        if missing:
            raise BatchError(
                f"a padded batch (dense input_ids) needs {missing} (B, L); it has {sorted(batch.keys())}. Send "
                "attention_mask (non-zero at real tokens) and, to train, response_mask (non-zero where the loss "
                "applies: without it every real token, the prompt included, would be trained on), or a "
                "no-padding batch from make_batch."
            )
        others = {str(key): batch.get(key) for key in list(batch.keys()) if key not in PADDED_KEYS}
        per_sequence = {key: value for key, value in others.items() if value.dim() == 1}
        nopad = padded_to_nopad(
            batch["input_ids"],
            batch[ATTENTION_MASK],
            position_ids=batch.get("position_ids", None),
            response_mask=batch.get("response_mask", None),
            **{key: value for key, value in others.items() if key not in per_sequence},
        )
        nopad.update(per_sequence)
        if "response_mask" not in batch:
            nopad = nopad.exclude(LOSS_MASK)  # a worker's update refuses it as missing, not all-true
        return cls(nopad=nopad, attention_mask=batch[ATTENTION_MASK].bool())

    def restore(self, outputs: TensorDict | None) -> TensorDict | None:
        """Per-token ``outputs`` in the caller's form: jagged as is, or dense ``(B, L)`` with zeros at padding."""
        if outputs is None or self.attention_mask is None:
            return outputs
        dense = {}
        for key in list(outputs.keys()):
            flat = outputs.get(key).values()
            dense[key] = flat.new_zeros((*self.attention_mask.shape, *flat.shape[1:]))
            dense[key][self.attention_mask] = flat
        return TensorDict(dense, batch_size=outputs.batch_size)
