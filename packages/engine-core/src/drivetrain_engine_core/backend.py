"""Everything a backend author needs, in one public module: the only core module a backend imports.

A backend (ours or a third party's) subclasses :class:`Engine`, sets ``backend_name`` to the backend it
registers for, declares what it offers beyond the required hooks in ``capabilities =``
:class:`BackendCapabilities` (offload, LoRA, a value head, padded rows, sequence parallelism, compute dtypes),
implements the required hooks of :class:`BackendHooks` and those of its capabilities, and overrides
``_token_limits()`` and ``_hf_config()`` (they default to no batch-value checks and no FLOP metrics; the
conformance kit requires both). Per micro-batch it runs its model on :attr:`MicroBatch.inputs` and hands its
per-position fields to :meth:`MicroBatch.finish` (see :mod:`drivetrain_engine_core.round_trip` for the round
trip and the one loss-scaling rule, :attr:`Engine.gradient_divisor`). It may ship a
:class:`CheckpointMerger`. Import from here rather than from core's inner modules, which may move::

    from drivetrain_engine_core.backend import Engine, MicroBatch, MicroBatchResult

Names load lazily (PEP 562): the two modules a plugin loads before any engine exists, its plugin module
(``hookimpl``) and its engine-config module (``EngineConfig``, ``ConfigError``, ``DTYPES``), import them from
here without importing torch; ``Engine`` and the rest import torch on first use. The conformance kit
(:mod:`drivetrain_engine_core.testing.conformance`) checks the result.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    # torch-free: what plugin and engine-config modules import
    "ALL_LINEAR": "config",
    "DTYPES": "config",
    "CheckpointConfig": "config",
    "ConfigError": "config",
    "EngineConfig": "config",
    "LoraConfig": "config",
    "MicroBatchConfig": "config",
    "ModelConfig": "config",
    "OptimizerConfig": "config",
    "BackendCapabilities": "capabilities",
    "BatchError": "errors",
    "CheckpointError": "errors",
    "DrivetrainError": "errors",
    "EngineStateError": "errors",
    "hookimpl": "hookspecs",
    # the engine and what its hooks take and return
    "BackendHooks": "hooks",
    "ShardedWeight": "handoff.local_shards",
    "Engine": "engine",
    "Mode": "modes",
    "ForwardOptions": "data.options",
    "MicroBatchCountRule": "data.micro_batch",
    "PackedRow": "data.packing",
    "PaddedRows": "data.packing",
    "pad_packed_row": "data.packing",
    "TokenLimits": "data.values",
    "move_batch": "data.batch",
    "ForwardBackwardOutput": "outputs",
    "LossContext": "outputs",
    "LossFn": "outputs",
    "MicroBatchResult": "outputs",
    "host_floats": "outputs",
    "InputLayout": "round_trip",
    "MicroBatch": "round_trip",
    "RoundTrip": "round_trip",
    "RowPadding": "round_trip",
    "SequenceSplit": "round_trip",
    "ROUTER_AUX_METRIC": "router_balance",
    "RouterLoss": "router_balance",
    "router_loss_of": "router_balance",
    "NOT_RECORDED": "router_replay",
    "ROUTED_EXPERTS": "router_replay",
    "check_routes_shape": "router_replay",
    "hf_routers": "router_replay",
    "micro_batch_routes": "router_replay",
    "refuse_routes": "router_replay",
    "replaying_routes": "router_replay",
    # building models, kernels, checkpoints
    "disable_dropout_in_config": "dropout",
    "disable_dropout_modules": "dropout",
    "flash_kernel_applies": "packed_attention",
    "flash_kernel_missing": "packed_attention",
    "packed_causal_attention": "packed_attention",
    "SequenceLengths": "packed_attention",
    "linear_log_probs": "linear_log_probs",
    "CheckpointIndex": "hf_checkpoint",
    "read_checkpoint_index": "hf_checkpoint",
    "MODEL_DIR": "checkpoint",
    "OPTIMIZER_DIR": "checkpoint",
    "PEFT_PREFIX": "checkpoint",
    "CheckpointMerger": "checkpoint",
    "DCPTensorReader": "checkpoint",
    "check_saved_shapes": "checkpoint",
    "ADAM_MOMENTS": "checkpoint.hf_state",
    "WEIGHT": "checkpoint.hf_state",
    "HFTrainingState": "checkpoint.hf_state",
    "peft_target_modules": "checkpoint.peft",
    "read_manifest": "checkpoint",
    "split_peft_name": "checkpoint",
}

if TYPE_CHECKING:
    from . import distributed
    from .capabilities import BackendCapabilities
    from .checkpoint import (
        MODEL_DIR,
        OPTIMIZER_DIR,
        PEFT_PREFIX,
        CheckpointMerger,
        DCPTensorReader,
        check_saved_shapes,
        read_manifest,
        split_peft_name,
    )
    from .checkpoint.hf_state import ADAM_MOMENTS, WEIGHT, HFTrainingState
    from .checkpoint.peft import peft_target_modules
    from .config import (
        ALL_LINEAR,
        DTYPES,
        CheckpointConfig,
        ConfigError,
        EngineConfig,
        LoraConfig,
        MicroBatchConfig,
        ModelConfig,
        OptimizerConfig,
    )
    from .data.batch import move_batch
    from .data.micro_batch import MicroBatchCountRule
    from .data.options import ForwardOptions
    from .data.packing import PackedRow, PaddedRows, pad_packed_row
    from .data.values import TokenLimits
    from .dropout import disable_dropout_in_config, disable_dropout_modules
    from .engine import Engine
    from .errors import BatchError, CheckpointError, DrivetrainError, EngineStateError
    from .handoff.local_shards import ShardedWeight
    from .hf_checkpoint import CheckpointIndex, read_checkpoint_index
    from .hooks import BackendHooks
    from .hookspecs import hookimpl
    from .linear_log_probs import linear_log_probs
    from .modes import Mode
    from .outputs import ForwardBackwardOutput, LossContext, LossFn, MicroBatchResult, host_floats
    from .packed_attention import (
        SequenceLengths,
        flash_kernel_applies,
        flash_kernel_missing,
        packed_causal_attention,
    )
    from .round_trip import InputLayout, MicroBatch, RoundTrip, RowPadding, SequenceSplit
    from .router_balance import ROUTER_AUX_METRIC, RouterLoss, router_loss_of
    from .router_replay import (
        NOT_RECORDED,
        ROUTED_EXPERTS,
        check_routes_shape,
        hf_routers,
        micro_batch_routes,
        refuse_routes,
        replaying_routes,
    )

__all__ = [
    "ADAM_MOMENTS",
    "ALL_LINEAR",
    "DTYPES",
    "MODEL_DIR",
    "NOT_RECORDED",
    "OPTIMIZER_DIR",
    "PEFT_PREFIX",
    "ROUTED_EXPERTS",
    "ROUTER_AUX_METRIC",
    "WEIGHT",
    "BackendCapabilities",
    "BackendHooks",
    "BatchError",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointMerger",
    "ConfigError",
    "DCPTensorReader",
    "DrivetrainError",
    "Engine",
    "EngineConfig",
    "EngineStateError",
    "ForwardBackwardOutput",
    "ForwardOptions",
    "HFTrainingState",
    "InputLayout",
    "LoraConfig",
    "LossContext",
    "LossFn",
    "MicroBatch",
    "MicroBatchConfig",
    "MicroBatchCountRule",
    "MicroBatchResult",
    "Mode",
    "ModelConfig",
    "OptimizerConfig",
    "PackedRow",
    "PaddedRows",
    "RoundTrip",
    "RouterLoss",
    "RowPadding",
    "SequenceLengths",
    "SequenceSplit",
    "ShardedWeight",
    "TokenLimits",
    "check_routes_shape",
    "check_saved_shapes",
    "disable_dropout_in_config",
    "disable_dropout_modules",
    "distributed",
    "flash_kernel_applies",
    "flash_kernel_missing",
    "hf_routers",
    "hookimpl",
    "host_floats",
    "linear_log_probs",
    "micro_batch_routes",
    "move_batch",
    "packed_causal_attention",
    "pad_packed_row",
    "peft_target_modules",
    "read_checkpoint_index",
    "read_manifest",
    "refuse_routes",
    "replaying_routes",
    "router_loss_of",
    "split_peft_name",
]


def __getattr__(name: str) -> Any:
    """A name of ``_EXPORTS`` (or the ``distributed`` module), imported from its core module on first use."""
    if name == "distributed":
        return importlib.import_module(f"{__package__}.distributed")
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; it exports {__all__}")
    return getattr(importlib.import_module(f"{__package__}.{_EXPORTS[name]}"), name)
