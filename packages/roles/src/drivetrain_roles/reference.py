"""The reference policy: log-probs from its own frozen engine, or from the actor's engine without adapters."""

from __future__ import annotations

from contextlib import nullcontext

from drivetrain_engine_core.backend import ConfigError, Engine, ForwardOptions
from tensordict import TensorDict

from .batch_inputs import RoleBatch


class Reference:
    """Computes ``ref_log_prob`` for the KL penalty.

    With LoRA the reference is the actor's own base model: pass the actor's engine and
    ``use_actor_base=True`` and the adapters are disabled for the forward pass, so no second copy of the
    weights is needed.

    Args:
        engine: an initialised engine (inference-only is enough), or the actor's engine.
        use_actor_base: run ``engine`` with its LoRA adapters disabled.
        temperature: the rollout's sampling temperature.
    """

    def __init__(self, engine: Engine, *, use_actor_base: bool = False, temperature: float = 1.0) -> None:
        if use_actor_base and engine.model_config.lora is None:
            raise ConfigError(
                "Reference(use_actor_base=True) needs an engine with LoRA adapters (model.lora); without adapters "
                "the actor's weights are the trained policy, so give the reference its own engine."
            )
        self.engine = engine
        self.use_actor_base = use_actor_base
        self.temperature = temperature

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict | None:
        """``ref_log_prob`` per token, in the batch's form (jagged or padded), on the output rank."""
        role_batch = RoleBatch.wrap(batch)
        adapters_off = self.engine.disable_adapter() if self.use_actor_base else nullcontext()
        with self.engine.eval_mode(), adapters_off:
            output = self.engine.infer_batch(
                role_batch.nopad, options=ForwardOptions(temperature=self.temperature)
            )
        restored = role_batch.restore(output.outputs)
        if restored is None:
            return None
        return TensorDict({"ref_log_prob": restored["log_probs"]}, batch_size=restored.batch_size)
