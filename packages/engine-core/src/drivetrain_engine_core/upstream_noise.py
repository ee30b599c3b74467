"""Filters for known upstream messages that say nothing actionable to drivetrain users, each one by name.

torch 2.13+ logs "is_fx_tracing will return true for both fx.symbolic_trace and torch.export ..." (logger
``torch.fx._symbolic_trace``) the first time anything asks ``is_fx_tracing()``, which transformers does on
every forward: the advice is for callers of that function, not for users of a training run. Only that one
record is dropped; every other message of that logger, and every warning elsewhere, still shows.
"""

from __future__ import annotations

import logging

_FX_LOGGER = "torch.fx._symbolic_trace"
_FX_MESSAGE = "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"


class _DropMessage(logging.Filter):
    """Drops records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_upstream_noise() -> None:
    """Install the filters (idempotent); importing ``drivetrain_engine_core`` does it."""
    logger = logging.getLogger(_FX_LOGGER)
    if not any(isinstance(f, _DropMessage) and f.prefix == _FX_MESSAGE for f in logger.filters):
        logger.addFilter(_DropMessage(_FX_MESSAGE))


__all__ = ["silence_upstream_noise"]
