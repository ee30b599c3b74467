"""drivetrain-roles: engine-agnostic RL roles (actor, critic, reference), their losses and the SFT trainer.

Everything here talks to :class:`drivetrain_engine_core.backend.Engine` only, so it runs unchanged on every
installed backend. Importing this package is cheap; the roles import torch when their modules load.
"""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

_EXPORTS = {
    "Actor": "actor",
    "ActorConfig": "actor",
    "PolicyObjective": "actor",
    "Critic": "critic",
    "CriticConfig": "critic",
    "Reference": "reference",
    "UpdateSchedule": "mini_batches",
    "RoleBatch": "batch_inputs",
    "PolicyLossConfig": "losses",
    "ValueLossConfig": "losses",
    "policy_loss_fn": "losses",
    "sft_loss_fn": "losses",
    "value_loss_fn": "losses",
    "kl_penalty": "losses",
    "compute_gae": "advantages",
    "whiten": "advantages",
    "apply_kl_penalty": "advantages",
    "token_rewards": "advantages",
    "AdaptiveKLController": "advantages",
    "FixedKLController": "advantages",
    "SFTTrainer": "sft.trainer",
    "SFTConfig": "sft.config",
    "load_config": "sft.config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
