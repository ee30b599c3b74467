"""The ``extra/`` part of a step that core writes for every backend: LR schedule, RNG, caller state.

Rank 0 writes ``extra/state.json`` (LR schedule, skipped optimizer steps, the caller's JSON state such as the
data position); every rank writes its own ``extra/rng_rank<R>.pt`` so that dropout and sampling resume
bit-exactly. RNG files load with ``weights_only=True``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from .. import _distributed as distributed

STATE_FILE = "state.json"


def require_json(name: str, value: Any) -> None:
    """Fail on every rank before any collective, rather than on rank 0 alone while the others wait."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"save_checkpoint: {name} must be JSON-serialisable (numbers, strings, lists, dicts): {e}"
        ) from e


def save_extra_state(extra_dir: Path, state: dict[str, Any]) -> None:
    """Write this rank's RNG state, and ``state`` (rank 0 only) as JSON."""
    extra_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), extra_dir / f"rng_rank{distributed.rank()}.pt")
    if distributed.rank() == 0:
        (extra_dir / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))


def load_extra_state(extra_dir: Path) -> dict[str, Any]:
    """Restore this rank's RNG state (when the step has one for it) and return the JSON state."""
    rng_file = extra_dir / f"rng_rank{distributed.rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return dict(json.loads((extra_dir / STATE_FILE).read_text()))


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, _, gauss = random.getstate()
    random.setstate((version, tuple(state["python"]), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
