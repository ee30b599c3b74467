"""What a command plugin (a training job, a checkpoint tool, a third party's command) builds on.

A command registers through ``hookimpl`` (:mod:`drivetrain_engine_core.backend`, which also holds the Engine it
drives, the configs and the error family) and runs inside core's CLI (:func:`build_cli`, exit status
:data:`INTERRUPTED` on Ctrl-C). By topic:

- configs: :class:`CheckpointConfig`, :class:`MicroBatchConfig`, :data:`ModelType`, :func:`config_from_dict`
  and the helpers a command's own config sections use (:func:`check_keys`, :func:`exclusive_limits`,
  :func:`field_docs`, :func:`field_types`, :func:`how_to_write`, :func:`nested_dataclass`, :func:`type_name`);
- plugins and engines: :func:`plugins` (:class:`DrivetrainPlugins`), :func:`create_engine`,
  :func:`engine_config_from_dict`, :func:`create_rollout`, :func:`rollout_options` (under :data:`SECTION`),
  :func:`environment_factory` (:class:`Environment`, :data:`Message`, :class:`ModelTurn`,
  :class:`StepResult`);
- the batch an Engine takes: :func:`make_batch`, :func:`jagged`, :func:`is_jagged`, :func:`validate_batch`,
  the fields :data:`LOSS_MASK`, :data:`ATTENTION_MASK` and :data:`UID` (:func:`sequence_groups`), padded
  rows (:func:`padded_to_nopad`, :func:`nopad_to_padded`) and data-parallel shards (:func:`shard_indices`,
  :func:`shard_data`, :func:`unshard_data`);
- losses: :class:`LossFn` over :class:`LossContext`, returning :class:`ForwardBackwardOutput`;
- processes: :func:`init_distributed` (:class:`ProcessGroup`), :func:`agreed_checks`,
  :func:`die_with_parent`, :func:`run_then_exit`; failures :class:`DivergenceError` and
  :class:`CollectiveTimeoutError`;
- checkpoint steps on disk: :func:`complete_steps`, :func:`step_entries` (:class:`StepEntry`),
  :func:`step_dir_name`, :func:`resolve_step_dir`, :func:`read_latest`, :class:`Manifest`
  (:data:`MANIFEST_FILE`), :func:`verify_files`, and durable writes (:func:`write_durably`,
  :func:`fsync_dir`, :func:`fsync_tree`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._face import face

if TYPE_CHECKING:
    from ._agreement import agreed_checks
    from ._checkpoint import (
        MANIFEST_FILE,
        Manifest,
        StepEntry,
        complete_steps,
        read_latest,
        resolve_step_dir,
        step_dir_name,
        step_entries,
        verify_files,
    )
    from ._checkpoint.durable import fsync_dir, fsync_tree, write_durably
    from ._cli import INTERRUPTED, build_cli
    from ._config import CheckpointConfig, MicroBatchConfig, ModelType, config_from_dict
    from ._config_build import build_layers, check_keys, exclusive_limits, leaves, lookup
    from ._config_fields import field_docs, field_types, how_to_write, nested_dataclass, type_name
    from ._data.batch import LOSS_MASK, is_jagged, jagged, make_batch, validate_batch
    from ._data.dp import shard_data, shard_indices, unshard_data
    from ._data.groups import UID, sequence_groups
    from ._data.padding import ATTENTION_MASK, nopad_to_padded, padded_to_nopad
    from ._distributed import ProcessGroup, init_distributed
    from ._environment import Environment, Message, ModelTurn, StepResult, environment_factory
    from ._errors import CollectiveTimeoutError, DivergenceError
    from ._factory import create_engine, engine_config_from_dict
    from ._outputs import ForwardBackwardOutput, LossContext, LossFn
    from ._plugins import DrivetrainPlugins, plugins
    from ._process_exit import run_then_exit
    from ._processes import die_with_parent
    from ._rollout import create_rollout, rollout_options
    from ._rollout_options import SECTION

__all__, __getattr__ = face(__name__)
