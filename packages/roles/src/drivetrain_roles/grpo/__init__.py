"""``drivetrain grpo``: GRPO over any engine backend and rollout, with an embedded arithmetic job.

Names are imported lazily so that registering the ``grpo`` command stays cheap.
"""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

# Modules under ``drivetrain_roles``: GRPO's estimator lives in the RL layer, beside RLOO and REINFORCE++.
_EXPORTS = {
    "ColocatedGRPO": "grpo.controller",
    "GRPOConfig": "grpo.config",
    "GRPOResult": "grpo.trainer",
    "GRPOTrainer": "grpo.trainer",
    "group_advantages": "rl.advantage_estimators",
    "load_config": "grpo.config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr("drivetrain_roles", _EXPORTS)
