"""Everything a backend author needs, in one public module.

A backend (ours or a third party's) subclasses :class:`Engine`, sets ``backend_name`` to the backend it
registers for, implements its abstract ``_`` hooks and overrides ``_token_limits()`` and ``_hf_config()`` (they
default to no batch-value checks and no FLOP metrics; the conformance kit requires both), and per
micro-batch runs its model on :attr:`MicroBatch.inputs` and hands its per-position fields to
:meth:`MicroBatch.finish` (see :mod:`drivetrain_engine_core.round_trip` for the round trip and the one
loss-scaling rule, :attr:`Engine.gradient_divisor`). It may ship a :class:`CheckpointMerger`. Import from
here rather than from core's inner modules, which may move::

    from drivetrain_engine_core.backend import Engine, MicroBatch, MicroBatchResult

This module imports torch. The two modules a plugin loads before any engine exists stay torch-free and
import their own cheap public modules: the plugin module (``hookimpl`` from
:mod:`drivetrain_engine_core.hookspecs`) and the engine-config module (``EngineConfig``, ``ConfigError``,
``DTYPES`` from :mod:`drivetrain_engine_core.config`, also re-exported here).

The conformance kit (:mod:`drivetrain_engine_core.testing.conformance`) checks the result.
"""

from __future__ import annotations

from . import distributed
from .checkpoint import MODEL_DIR, OPTIMIZER_DIR, PEFT_PREFIX, CheckpointMerger, DCPTensorReader
from .config import (
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
from .engine import Engine, Mode
from .errors import BatchError, CheckpointError, DrivetrainError, EngineStateError
from .hf_checkpoint import CheckpointIndex, read_checkpoint_index
from .linear_log_probs import linear_log_probs
from .outputs import ForwardBackwardOutput, LossContext, LossFn, MicroBatchResult, host_floats
from .packed_attention import flash_kernel_applies, flash_kernel_missing, packed_causal_attention
from .round_trip import InputLayout, MicroBatch, RoundTrip, RowPadding, SequenceSplit

__all__ = [
    "DTYPES",
    "MODEL_DIR",
    "OPTIMIZER_DIR",
    "PEFT_PREFIX",
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
    "RowPadding",
    "SequenceSplit",
    "TokenLimits",
    "disable_dropout_in_config",
    "disable_dropout_modules",
    "distributed",
    "flash_kernel_applies",
    "flash_kernel_missing",
    "host_floats",
    "linear_log_probs",
    "move_batch",
    "packed_causal_attention",
    "pad_packed_row",
    "read_checkpoint_index",
]
