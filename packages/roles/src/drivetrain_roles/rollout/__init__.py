"""Rollouts shipped with drivetrain-roles: Hugging Face ``generate`` (``hf``), exact on CPU; and multi-turn
episodes in environments over any rollout (:mod:`.multi_turn`, trajectories in :mod:`.trajectory`).

The contract (:class:`drivetrain_engine_core.rollout.Rollout`) lives in core so that inference backends can be
separate plugins; this package registers ``hf`` through ``register_rollouts``.
"""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

_EXPORTS = {
    "HFRollout": "hf",
    "Trajectory": "trajectory",
    "TurnLimits": "turn_limits",
    "run_episodes": "multi_turn",
    "run_episodes_async": "multi_turn",
    "trajectory_batch": "trajectory",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
