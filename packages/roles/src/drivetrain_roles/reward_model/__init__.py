"""Reward models as rewards: a sequence-classification model on its own engine, named in
``algorithm.reward_functions`` beside reward functions and weighted like them.

Names are imported lazily so that the config checks (which read :mod:`.spec`) stay torch-free.
"""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

_EXPORTS = {
    "RewardModel": "scorer",
    "RewardModelConfig": "config",
    "build_reward_models": "build",
    "check_model_folder": "spec",
    "is_model_spec": "spec",
    "model_name": "spec",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
