"""The output projection, run by the engine instead of the model so that logits never exist in full.

A causal LM ends ``logits = lm_head(hidden)``. When the head is a plain bias-free ``nn.Linear`` (tied to the
embeddings or not) and the model applies nothing after it (no logit soft-capping or scale), the engine skips
it in the model's forward (:func:`hidden_states_out`) and computes the token fields from the hidden states
and ``lm_head.weight`` in chunks (core's :func:`drivetrain_engine_core.kit.linear_log_probs`). Other heads (LoRA
on the head, value heads, soft-capped logits) keep the full-logits path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

# NOTE: config attributes with which transformers' causal LMs change the logits after lm_head (Gemma 2's
# soft-capping, Cohere's logit scale); the hidden-state path would leave that out.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def projection_head(model: Any, model_type: str) -> nn.Linear | None:
    """The ``lm_head`` the token fields can be computed from, or ``None`` where the logits path is needed."""
    if model_type != "language_model":
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    if any(getattr(base.config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head


@contextmanager
def hidden_states_out(head: nn.Linear | None) -> Iterator[None]:
    """Inside the block the model's ``lm_head`` returns its input: ``.logits`` are the last hidden states.

    NOTE: an instance attribute shadows ``Linear.forward`` only for this call; parameters, hooks and state
    dict names are untouched, so FSDP still gathers the head's (possibly tied) weight in the root's forward.
    """
    if head is None:
        yield
        return
    head.forward = _passthrough  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del head.forward


def _passthrough(hidden: Tensor) -> Tensor:
    """The head's input, as a tensor of its own rather than a view.

    NOTE: the model hands the head ``hidden_states[:, slice_indices, :]``, a view even when it keeps every
    position; returned as the root's output, FSDP2 (torch >= 2.15) warns at every first step that in-place ops
    on a view output would skip its pre-backward hook. A view spanning its whole base is that base (no copy,
    same autograd graph minus the slice); a partial one (never asked for by the engine) is copied.
    """
    base = hidden._base
    if base is None:
        return hidden
    if (hidden.shape, hidden.stride(), hidden.storage_offset()) == (
        base.shape,
        base.stride(),
        base.storage_offset(),
    ):
        return base
    return hidden.clone()
