"""Wall time and peak memory of one stretch of work in this process (``Engine.initialize`` records its own).

Peak host memory is the kernel's resident-set high-water mark (``VmHWM``), reset at the start on Linux by
writing ``5`` to ``/proc/self/clear_refs``, so the figure is the peak of the stretch itself, not of everything
the process did before. Where that reset is not available the figure is the process's lifetime peak
(``getrusage``), and ``ResourceUsage.host_peak_is_lifetime`` says so. Peak device memory is torch's allocator
peak on CUDA (``max_memory_allocated`` after ``reset_peak_memory_stats``).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
_RESET_PEAK_RSS = "5"  # proc(5): "reset the peak resident set size to the current resident set size"


@dataclass(frozen=True)
class ResourceUsage:
    """What one stretch of work cost this process.

    Attributes:
        seconds: wall time.
        host_rss_before_bytes: resident set size when it started.
        host_peak_rss_bytes: peak resident set size while it ran.
        host_peak_is_lifetime: the peak could not be reset, so it is the process's peak since it started.
        device_peak_bytes: peak memory allocated by torch on the CUDA device; ``None`` elsewhere.
    """

    seconds: float
    host_rss_before_bytes: int
    host_peak_rss_bytes: int
    host_peak_is_lifetime: bool
    device_peak_bytes: int | None

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """Flat numbers for a logger or tracker: ``<prefix>/seconds``, ``<prefix>/host_peak_rss_gib``, ..."""
        gib = float(1 << 30)
        metrics = {
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/host_peak_rss_gib": self.host_peak_rss_bytes / gib,
            f"{prefix}/host_rss_before_gib": self.host_rss_before_bytes / gib,
        }
        if self.device_peak_bytes is not None:
            metrics[f"{prefix}/device_peak_gib"] = self.device_peak_bytes / gib
        return metrics


@dataclass
class UsageMeter:
    """Filled in when the ``measure_usage`` block ends; read ``usage`` after it."""

    usage: ResourceUsage | None = field(default=None)


@contextmanager
def measure_usage(device: str) -> Iterator[UsageMeter]:
    """Measure the time and peak memory of the ``with`` block; ``device`` is the engine's device type."""
    cuda = device == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = _status_bytes("VmRSS")
    resettable = _reset_peak_rss()
    meter = UsageMeter()
    start = time.perf_counter()
    yield meter
    meter.usage = ResourceUsage(
        seconds=time.perf_counter() - start,
        host_rss_before_bytes=before,
        host_peak_rss_bytes=_status_bytes("VmHWM") if resettable else _lifetime_peak_rss(),
        host_peak_is_lifetime=not resettable,
        device_peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
    )


def _reset_peak_rss() -> bool:
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
    except OSError:
        return False
    return True


def _status_bytes(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` in bytes; 0 where there is no such file."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


def _lifetime_peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
