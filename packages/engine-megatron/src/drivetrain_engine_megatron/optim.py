"""Megatron's optimizer (AdamW, optionally the DistributedOptimizer) driven by drivetrain's step protocol.

Megatron's ``optimizer.step()`` unscales, computes the grad norm, clips and updates in one call; drivetrain's
``Engine.optimizer_step`` wants the norm first (to skip a non-finite update) and then the update. So
:func:`clip_grad_norm` runs megatron's own pieces in order (``prepare_grads``, ``get_grad_norm``,
clip by that norm) and :func:`step` runs ``step_with_ready_grads``. Megatron's clipping is disabled in its
config (``clip_grad=0``): drivetrain clips exactly once, here.
"""

from __future__ import annotations

import math
import warnings

import torch
from drivetrain_engine_core.backend import OptimizerConfig
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from .config import MegatronEngineConfig


def build_optimizer(
    config: OptimizerConfig, engine_config: MegatronEngineConfig, chunks: list[torch.nn.Module]
) -> MegatronOptimizer:
    """AdamW over every parameter of ``chunks`` with weight decay on all of them (like ``torch.optim.AdamW``).

    ``config_overrides={}`` replaces megatron's default of no weight decay on biases and norms, so the
    update equals a plain AdamW on the Hugging Face model (and the FSDP backend).
    """
    mcore_config = McoreOptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.eps,
        clip_grad=0.0,
        bf16=engine_config.param_dtype == "bfloat16",
        fp16=engine_config.param_dtype == "float16",
        initial_loss_scale=engine_config.initial_loss_scale,
        params_dtype=torch.float32,
        use_distributed_optimizer=engine_config.use_distributed_optimizer,
    )
    return get_megatron_optimizer(mcore_config, chunks, config_overrides={})


def zero_grad(optimizer: MegatronOptimizer) -> None:
    """Drop the main parameters' gradients, without torch's warning about megatron's own ``.grad`` read.

    The distributed optimizer's float32 shards are views of the model's parameters (non-leaf tensors), and its
    ``zero_grad`` reads their ``.grad``: torch warns once per engine and rank that a non-leaf ``.grad`` is never
    populated. Nothing is wrong (megatron's gradients live in ``main_grad``), so the warning is silenced
    for this call only.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
        optimizer.zero_grad()


def clip_grad_norm(optimizer: MegatronOptimizer, max_norm: float | None) -> float:
    """Reduce-ready gradients' global norm (over every parallel group), clipped to ``max_norm`` if set."""
    found_inf = optimizer.prepare_grads()
    if found_inf:
        return math.inf
    grad_norm = float(optimizer.get_grad_norm())
    if max_norm is not None and math.isfinite(grad_norm):
        for inner in _inner_optimizers(optimizer):
            parameters = inner.get_parameters()
            if parameters:
                clip_grad_by_total_norm_fp32(parameters, max_norm=max_norm, total_norm=grad_norm)
    return grad_norm


def step(optimizer: MegatronOptimizer) -> None:
    """Apply the update to the main parameters and copy them back into the model."""
    optimizer.step_with_ready_grads()


def _inner_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
