"""The Engine contract: what a backend (ours or a third party's) subclasses, implements and returns.

A backend subclasses :class:`Engine`, sets ``backend_name`` to the backend it registers for (with a
``hookimpl``-decorated ``drivetrain_register_engines``), declares what it offers beyond the required hooks in
``capabilities =`` :class:`BackendCapabilities`, implements the required hooks of :class:`BackendHooks` and
those of its capabilities, and overrides ``_token_limits()`` (:class:`TokenLimits`) and ``_hf_config()``. Its
config subclasses :class:`EngineConfig` (validation raising :class:`ConfigError`). Per micro-batch it runs its
model on :attr:`MicroBatch.inputs` and hands its per-position fields to :meth:`MicroBatch.finish`, which
returns the :class:`MicroBatchResult` (a :class:`RoundTrip` is what core builds them from, one per
batch). It may ship a :class:`CheckpointMerger`::

    from drivetrain_engine_core.backend import Engine, MicroBatch, MicroBatchResult

What backends share by choice (attention, log-probs, router replay, checkpoint readers) is
:mod:`drivetrain_engine_core.kit`; the conformance kit (:mod:`drivetrain_engine_core.testing.conformance`)
checks the result. Names load on first use, so a plugin module importing ``hookimpl`` or an engine-config
module importing ``EngineConfig`` does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._face import face

if TYPE_CHECKING:
    from ._capabilities import BackendCapabilities
    from ._checkpoint import CheckpointMerger
    from ._config import ALL_LINEAR, DTYPES, EngineConfig, LoraConfig, ModelConfig, OptimizerConfig
    from ._data.micro_batch import MicroBatchCountRule
    from ._data.options import ForwardOptions
    from ._data.packing import PackedRow, PaddedRows, pad_packed_row
    from ._data.values import TokenLimits
    from ._engine import Engine
    from ._errors import (
        BatchError,
        CheckpointError,
        ConfigError,
        DrivetrainError,
        EngineStateError,
        PluginError,
    )
    from ._handoff.local_shards import ShardedWeight
    from ._hooks import BackendHooks
    from ._hookspecs import hookimpl
    from ._modes import Mode
    from ._outputs import MicroBatchResult, host_floats
    from ._round_trip import InputLayout, MicroBatch, RoundTrip, RowPadding, SequenceSplit

__all__, __getattr__ = face(__name__)
