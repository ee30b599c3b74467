"""``drivetrain ppo``: PPO with a critic over any engine backend and rollout, with an embedded arithmetic job.

Names are imported lazily so that registering the ``ppo`` command stays cheap.
"""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

_EXPORTS = {
    "ColocatedPPO": "controller",
    "PPOConfig": "config",
    "PPOTrainer": "trainer",
    "load_config": "config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
