"""Typed access to the layout of jagged nested tensors.

torch's type stubs describe nested tensors as plain ``Tensor``, without ``offsets()``, ``lengths()`` or the
ragged dimension; these accessors are the one place that reaches them, so the rest of the data package stays
type-checked.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def offsets_of(value: Any) -> Tensor:
    """Sequence boundaries ``(n + 1,)`` of a jagged tensor."""
    offsets: Tensor = value.offsets()
    return offsets


def ragged_dim_of(value: Any) -> int:
    """Index of the ragged dimension of a jagged tensor (drivetrain requires 1)."""
    return int(value._ragged_idx)


def has_holes(value: Any) -> bool:
    """Whether a jagged tensor is a non-contiguous view (``lengths()`` set), which drivetrain refuses."""
    return value.lengths() is not None
