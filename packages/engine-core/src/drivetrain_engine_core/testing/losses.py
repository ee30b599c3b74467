"""Loss functions for tests, normalised by the global token count as every drivetrain loss is (docs §7.4)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from drivetrain_engine_core._outputs import LossContext


def _masked(values: torch.Tensor, batch: TensorDict) -> torch.Tensor:
    # Flat values: the model output and the micro-batch may hold different offsets objects.
    return values.values() * batch["loss_mask"].values()


def token_mean_nll(
    model_output: TensorDict, batch: TensorDict, context: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean negative log-likelihood over the loss-mask tokens of the whole (global) mini-batch.

    The metric stays a device tensor, read with the step's other metrics: a ``float()`` here waited for the
    device after every micro-batch, a cost the GPU benchmark charged to the engine alone.
    """
    total = -_masked(model_output["log_probs"], batch).sum()
    return total / max(context.global_token_count, 1), {"nll_sum": total.detach()}


def value_mse(
    model_output: TensorDict, batch: TensorDict, context: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Half squared error of ``values`` to the batch's ``returns``, averaged over global loss-mask tokens."""
    error = model_output["values"].values() - batch["returns"].values()
    total = 0.5 * (error.square() * batch["loss_mask"].values()).sum()
    return total / max(context.global_token_count, 1), {"squared_error_sum": total.detach()}
