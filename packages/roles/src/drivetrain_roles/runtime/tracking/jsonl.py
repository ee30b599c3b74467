"""``metrics.jsonl``: one JSON object per record (``{"step": N, ...}``), the default tracker.

On resume, records after the resumed step are dropped first, so the file describes one run; the file is
rewritten through a temporary file and a rename, so a crash or a full disk during the rewrite leaves the old
history whole. A line that is not JSON (an append cut short by a crash or a full disk) is skipped with a
warning when the file is read, rather than blocking the resume. A non-finite value (the loss of a step whose
update was skipped) is written as ``null``: ``NaN`` is not JSON.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from .base import RunInfo, Tracker

METRICS_FILE = "metrics.jsonl"
logger = logging.getLogger(__name__)


class JsonlTracker(Tracker):
    """Appends each record to ``<run>/metrics.jsonl``."""

    def __init__(self, run: RunInfo) -> None:
        self.path = run.run_dir / METRICS_FILE
        kept = (
            []
            if run.resume_step is None
            else [r for r in read_records(self.path) if r["step"] <= run.resume_step]
        )
        # NOTE: imported here: the checkpoint package imports torch, which the trackers do not need until a
        # run opens them.
        from drivetrain_engine_core.job import write_durably

        write_durably(self.path, "".join(dumps(r) + "\n" for r in kept))

    def log(self, step: int, values: dict[str, float]) -> None:
        with self.path.open("a") as handle:
            handle.write(dumps({"step": step, **values}) + "\n")

    def sync(self) -> None:
        """``fsync`` the file (the appends above reach the page cache only)."""
        with self.path.open("a") as handle:
            os.fsync(handle.fileno())


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
    """The records of a ``metrics.jsonl`` file (empty if it does not exist); lines that are not a JSON record
    with a ``step`` are skipped, with a warning."""
    if not path.is_file():
        return []
    records, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        else:
            skipped += 1
    if skipped:
        logger.warning(
            "%s: skipped %d line(s) that are not a metrics record (a write cut short?)", path, skipped
        )
    return records
