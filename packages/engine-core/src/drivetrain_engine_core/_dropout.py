"""Dropout off in a Hugging Face config (``model.disable_dropout``): TRL's ``disable_dropout``, for every backend.

Preference and reward losses compare what the model says in train mode with a reference or with itself (the
chosen and the rejected answer); dropout adds noise to both sides of every comparison, and DPO's reference runs
in eval mode while the policy drops units. TRL turns dropout off for DPO and reward training by default
(``disable_dropout=True``, setting every ``nn.Dropout`` to ``p=0``). Zeroing the config's probabilities before
the model is built reaches more: the attention-probability dropout that transformers' attention layers pass to
the kernel (no ``nn.Dropout`` holds it), and Megatron, whose layers take their dropout from the config mbridge
derives from this one. The engines build from a config read for the purpose; exported models keep the
``config.json`` of ``model.path``.
"""

from __future__ import annotations

from typing import Any

import torch

DROPOUT_NAME_ENDINGS: tuple[str, ...] = ("dropout", "pdrop", "dropout_prob", "dropout_rate")
"""Config fields holding a dropout probability: ``attention_dropout``, ``hidden_dropout``,
``classifier_dropout``, GPT-2's ``resid_pdrop``/``embd_pdrop``/``attn_pdrop``, BERT's
``hidden_dropout_prob``, T5's ``dropout_rate``."""


_DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def disable_dropout_in_config(config: Any) -> None:
    """Set every dropout probability of a transformers ``config`` and its sub-configs to 0, in place."""
    for name, value in list(vars(config).items()):
        if _is_sub_config(value):
            disable_dropout_in_config(value)
        elif name.endswith(DROPOUT_NAME_ENDINGS) and _is_probability(value):
            setattr(config, name, 0.0)


def disable_dropout_modules(module: torch.nn.Module) -> None:
    """Set ``p=0`` on every dropout module in ``module`` (dropout a model hard-codes, not from its config)."""
    for child in module.modules():
        if isinstance(child, _DROPOUT_MODULES):
            child.p = 0.0


def _is_sub_config(value: Any) -> bool:
    """A nested transformers config (``text_config`` of a multimodal model), recognised without importing
    transformers: core does not depend on it."""
    return hasattr(value, "to_dict") and hasattr(value, "model_type") and hasattr(value, "__dict__")


def _is_probability(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["DROPOUT_NAME_ENDINGS", "disable_dropout_in_config", "disable_dropout_modules"]
