"""Filters for known upstream messages that say nothing actionable to drivetrain users, each one by name.

- torch 2.13+ logs "is_fx_tracing will return true for both fx.symbolic_trace and torch.export ..." (logger
  ``torch.fx._symbolic_trace``) the first time anything asks ``is_fx_tracing()``, which transformers does on
  every forward: the advice is for callers of that function, not for users of a training run.
- torch logs "No CUDA runtime is found, using CUDA_HOME=..." (logger ``torch.utils.cpp_extension``) when
  megatron-core imports its extension helpers on a machine with a CUDA toolkit but no GPU: every CPU
  Megatron run printed it; nothing is built from source there.

Only these records are dropped; every other message of those loggers, and every warning elsewhere, still
shows.
"""

from __future__ import annotations

import logging

_DROPPED = {
    "torch.fx._symbolic_trace": "is_fx_tracing will return true for both fx.symbolic_trace and torch.export",
    "torch.utils.cpp_extension": "No CUDA runtime is found, using CUDA_HOME=",
}
"""Logger name -> the start of the one message of it that is dropped."""


class _DropMessage(logging.Filter):
    """Drops records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_upstream_noise() -> None:
    """Install the filters (idempotent); importing ``drivetrain_engine_core`` does it."""
    for name, prefix in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))


__all__ = ["silence_upstream_noise"]
