"""Micro-batches under a token budget counted in padded length: rows x longest sequence of the micro-batch.

A padded layout (``pad_micro_batch``: right-padded rows) computes on every padding position, so its memory
follows ``rows x longest``, not the real token count that the no-padding budget caps (verl's padded layout
sizes micro-batches this way). Sorting units (sequences, or groups sharing a ``uid``) by their longest
sequence and cutting them into consecutive runs puts sequences of like lengths together, which is what keeps
the padding, and so the count, small: a run of units sorted longest first costs ``rows x`` its first unit's
length, and a part split further (another rank needed more micro-batches) never costs more than the part.
"""

from __future__ import annotations

import torch
from torch import Tensor


def padded_costs(rows: Tensor, longest: Tensor) -> Tensor:
    """What each unit alone costs in padded length: its rows times its longest sequence."""
    return rows * longest


def plan_padded(rows: Tensor, longest: Tensor, max_tokens: int) -> list[list[int]]:
    """Units (indices into ``rows``/``longest``) in parts whose ``rows x longest`` stays within ``max_tokens``.

    Every unit must fit alone (checked by the caller, which names the unit that does not).
    """
    order = torch.argsort(longest, descending=True, stable=True).tolist()
    parts: list[list[int]] = []
    used_rows, width = 0, 0
    for unit in order:
        unit_rows, unit_width = int(rows[unit]), int(longest[unit])
        if parts and (used_rows + unit_rows) * max(width, unit_width) <= max_tokens:
            parts[-1].append(unit)
            used_rows += unit_rows
            width = max(width, unit_width)
            continue
        parts.append([unit])
        used_rows, width = unit_rows, unit_width
    return parts


__all__ = ["padded_costs", "plan_padded"]
