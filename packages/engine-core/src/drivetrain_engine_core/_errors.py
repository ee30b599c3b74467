"""Exception types shared by every drivetrain package, so callers can catch one family per kind of mistake."""

from __future__ import annotations


class DrivetrainError(Exception):
    """Base class of drivetrain's own errors."""


class ConfigError(DrivetrainError, ValueError):
    """A configuration value is invalid; the message names the field and how to fix it.

    Also a ``ValueError``, as it was before it joined the family: callers that catch ``ValueError`` still do.
    """


class EngineStateError(DrivetrainError, RuntimeError):
    """An engine method was called in a state that does not allow it (not initialised, wrong mode, ...)."""


class BatchError(DrivetrainError, ValueError):
    """A batch does not follow the no-padding data format; the message names the field and the fix."""


class CheckpointError(DrivetrainError, RuntimeError):
    """A checkpoint is incomplete, corrupt or incompatible; the message names the file."""


class DivergenceError(DrivetrainError, RuntimeError):
    """The run diverged: too many optimizer updates in a row had a non-finite grad norm, or a job's divergence
    guard saw its loss or grad norm stay far above their running baseline."""


class CollectiveTimeoutError(DrivetrainError, RuntimeError):
    """A collective gave up waiting for other ranks; the message names the ranks that are behind."""


class PluginError(DrivetrainError, LookupError):
    """A plugin, engine, role or merger could not be found or loaded."""


__all__ = [
    "BatchError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DivergenceError",
    "DrivetrainError",
    "EngineStateError",
    "PluginError",
]
