"""PEFT naming of LoRA checkpoints: how a PEFT model's tensor names split into base, adapter and saved
weights, and the ``adapter_config.json`` that describes the adapters.

A LoRA engine (FSDP with ``model.lora``) checkpoints the PEFT-wrapped model under PEFT's own names;
:class:`~drivetrain_engine_core._checkpoint.merger.CheckpointMerger` uses these helpers to write the base model
under Hugging Face names and the adapters as PEFT saves them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._config import ALL_LINEAR

PEFT_PREFIX = "base_model.model."
"""Prefix PEFT puts in front of every name of the wrapped model."""

_ADAPTER_NAME = "default"
_SAVED_MARKER = f".modules_to_save.{_ADAPTER_NAME}."
_ORIGINAL_MARKER = ".original_module."

_PEFT_TASK_TYPES = {"language_model": "CAUSAL_LM", "value_model": "TOKEN_CLS"}


def split_peft_name(name: str) -> tuple[str, str]:
    """Classify a PEFT model's ``state_dict`` name and rename it for where it is written.

    Returns:
        ``(kind, name)`` where kind is ``"base"`` for a frozen weight of the wrapped model (Hugging Face name,
        ``base_layer.`` removed), ``"adapter"`` for a LoRA weight (named as PEFT saves adapters, adapter name
        removed), ``"saved"`` for a module PEFT trains in full (``modules_to_save``; Hugging Face name), or
        ``"original"`` for the frozen copy such a module replaces (never written).

    Examples:
        ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
        ``("base", "model.layers.0.self_attn.q_proj.weight")``;
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
        ``("adapter", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")``;
        ``base_model.model.score.modules_to_save.default.weight`` -> ``("saved", "score.weight")``.
    """
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{_ADAPTER_NAME}."
        if marker in name:
            return "adapter", name.replace(marker, f".{part}.")
    inner = name.removeprefix(PEFT_PREFIX)
    if _SAVED_MARKER in inner:
        return "saved", inner.replace(_SAVED_MARKER, ".")
    if _ORIGINAL_MARKER in inner:
        return "original", inner.replace(_ORIGINAL_MARKER, ".")
    return "base", inner.replace(".base_layer.", ".")


def modules_to_save(names: Iterable[str]) -> list[str]:
    """Modules PEFT trains in full next to the adapters (a value model's ``score`` head), from tensor names."""
    return sorted(
        {name.split(_SAVED_MARKER)[0].rsplit(".", 1)[-1] for name in names if _SAVED_MARKER in name}
    )


def peft_adapter_config(
    lora: Mapping[str, Any], *, model_type: str, model_path: str, modules_to_save: Sequence[str] = ()
) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` content for adapters described by a :class:`LoraConfig`'s fields.

    Used for a checkpoint's adapters (the manifest's ``lora`` entry) and for adapters handed to a rollout.

    Args:
        lora: ``rank``, ``alpha``, ``target_modules`` and optionally ``dropout``.
        model_type: ``language_model`` or ``value_model`` (PEFT task type ``CAUSAL_LM`` / ``TOKEN_CLS``).
        model_path: the base model (``base_model_name_or_path``).
        modules_to_save: modules trained in full next to the adapters (a value model's head).
    """
    return {
        "peft_type": "LORA",
        "task_type": _PEFT_TASK_TYPES[model_type],
        "base_model_name_or_path": model_path,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora.get("dropout", 0.0),
        "target_modules": peft_target_modules(lora["target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": list(modules_to_save) or None,
    }


def peft_target_modules(target_modules: Sequence[str]) -> str | list[str]:
    """``target_modules`` as PEFT reads it: its ``all-linear`` shorthand is expanded only as a bare string (in a
    list it names a module called ``all-linear``, and loading the adapter fails)."""
    modules = list(target_modules)
    return ALL_LINEAR if modules == [ALL_LINEAR] else sorted(modules)
