"""Metrics trackers chosen by name (a ``report_to`` list): ``jsonl`` (default), ``tensorboard``, ``wandb``, ``mlflow``.

Each tracker lives in its own module and imports its library only when opened, so naming a tracker costs
nothing until a run starts; :func:`check_report_to` refuses unknown names and trackers whose library is not
installed when the config is read, before any process starts.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from collections.abc import Sequence

from drivetrain_engine_core.backend import ConfigError

from .base import RunInfo, Tracker
from .jsonl import METRICS_FILE, read_records

TRACKERS: dict[str, tuple[str, str | None]] = {
    "jsonl": ("jsonl:JsonlTracker", None),
    "tensorboard": ("tensorboard:TensorBoardTracker", "tensorboard"),
    "wandb": ("wandb:WandbTracker", "wandb"),
    "mlflow": ("mlflow:MlflowTracker", "mlflow"),
}
"""Tracker name -> (``module:class`` in this package, the library it needs, which is also its pip name)."""


def check_report_to(names: Sequence[str], field: str = "trainer.report_to") -> None:
    """Every name is a known tracker whose library is installed.

    Raises:
        ConfigError: naming the field, the unknown name (with the close match) or the install command.
    """
    for name in names:
        if name not in TRACKERS:
            close = difflib.get_close_matches(name, list(TRACKERS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{field} names {name!r}; known trackers are {list(TRACKERS)}.{hint}")
        library = TRACKERS[name][1]
        if library is not None and importlib.util.find_spec(library) is None:
            raise ConfigError(
                f"{field} names {name!r}, but the {library!r} package is not installed; pip install {library}, "
                f"or remove {name!r} from {field}."
            )


def open_trackers(names: Sequence[str], run: RunInfo) -> list[Tracker]:
    """Open the named trackers (checked with :func:`check_report_to`) for ``run``."""
    check_report_to(names)
    trackers = []
    for name in dict.fromkeys(names):
        module, _, cls = TRACKERS[name][0].partition(":")
        trackers.append(getattr(importlib.import_module(f"{__name__}.{module}"), cls)(run))
    return trackers


__all__ = [
    "METRICS_FILE",
    "TRACKERS",
    "RunInfo",
    "Tracker",
    "check_report_to",
    "open_trackers",
    "read_records",
]
