"""The SFT trainer behind ``drivetrain sft``: its config, trainer, command and warm start (the data, assets,
metrics and final model every command shares are in :mod:`drivetrain_roles.jobs`).

Names are imported lazily so that registering the ``sft`` command (which imports ``sft.command``) stays cheap.
"""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

_EXPORTS = {
    "DataConfig": "config",
    "SFTConfig": "config",
    "TrainerConfig": "config",
    "load_config": "config",
    "SFTResult": "trainer",
    "SFTTrainer": "trainer",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
