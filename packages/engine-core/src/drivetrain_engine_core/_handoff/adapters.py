"""The check that an adapter stream bound an adapter to every module its config targets, and to at least one.

A LoRA adapter whose names match no module of the served model loads without complaint in most stacks and
changes nothing: the rollout samples the base policy while the trainer trains the adapter. So a receiver
matches the adapter config's ``target_modules`` against its own modules the way PEFT does (a list: a module
named so, or ending in ``.<name>``; a string: a regular expression the whole module name matches) and
refuses a stream that left any targeted module without an adapter, or bound none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .receiver import HandoffError


def targeted_modules(adapter_config: Mapping[str, Any], module_names: Iterable[str]) -> set[str]:
    """The modules of ``module_names`` that ``adapter_config["target_modules"]`` selects, as PEFT selects them."""
    targets = adapter_config.get("target_modules") or []
    if isinstance(targets, str):
        return {name for name in module_names if re.fullmatch(targets, name)}
    return {name for name in module_names if any(name == t or name.endswith(f".{t}") for t in targets)}


def check_adapter_binding(
    adapter_config: Mapping[str, Any], module_names: Iterable[str], bound: Iterable[str]
) -> None:
    """Refuse an adapter stream that bound no module, or left a targeted module without an adapter.

    Args:
        adapter_config: the PEFT ``adapter_config.json`` content the stream carries.
        module_names: every module of the served model (Hugging Face names, ``model.layers.0.self_attn.q_proj``).
        bound: the modules the stream brought an adapter for, under the same names.

    Raises:
        HandoffError: zero modules bound, or targeted modules left unbound (the first few named).
    """
    bound = set(bound)
    targets = adapter_config.get("target_modules")
    if not bound:
        raise HandoffError(
            f"the adapter stream bound zero modules of the served model (target_modules={targets!r}): the "
            "rollout would sample the base policy. Send the adapter tensors under their PEFT names."
        )
    unbound = sorted(targeted_modules(adapter_config, module_names) - bound)
    if unbound:
        raise HandoffError(
            f"the adapter stream left {len(unbound)} modules that target_modules={targets!r} selects without an "
            f"adapter ({unbound[:3]}); send every adapter of the trained model."
        )
