"""``metrics.jsonl``: one JSON object per record (``{"step": N, ...}``), the default tracker.

On resume, records after the resumed step are dropped first, so the file describes one run. A non-finite
value (the loss of a step whose update was skipped) is written as ``null``: ``NaN`` is not JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .base import RunInfo, Tracker

METRICS_FILE = "metrics.jsonl"


class JsonlTracker(Tracker):
    """Appends each record to ``<run>/metrics.jsonl``."""

    def __init__(self, run: RunInfo) -> None:
        self.path = run.run_dir / METRICS_FILE
        kept = (
            []
            if run.resume_step is None
            else [r for r in read_records(self.path) if r["step"] <= run.resume_step]
        )
        self.path.write_text("".join(dumps(r) + "\n" for r in kept))

    def log(self, step: int, values: dict[str, float]) -> None:
        with self.path.open("a") as handle:
            handle.write(dumps({"step": step, **values}) + "\n")


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON of ``value`` with every non-finite float written as ``null``."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (dicts and lists followed)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (empty if it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
