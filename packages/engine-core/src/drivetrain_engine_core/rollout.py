"""The rollout contract: what an inference plugin (vLLM, SGLang, a remote server) subclasses and receives.

Shaped like vLLM's weight-sync client: a rollout generates, and between steps it is handed the trainer's
weights as a numbered stream of buckets it checks and loads.

- generating: subclass :class:`Rollout` (its template methods check inputs and state; a plugin implements the
  ``_``-prefixed hooks), take :class:`SamplingConfig` per call, return :class:`RolloutOutput`, declare
  :class:`RecordsRoutedExperts` where routed experts are recorded, stop on :func:`end_of_sequence_ids`, and
  read the plugin's own settings as :class:`RolloutOptions` (built and checked as users' values would be by
  :func:`build_rollout_options`);
- receiving weights: each :class:`WeightBucket` carries tensors (:class:`TensorSpec`, their bytes via
  :func:`as_bytes`) with digests (:class:`TensorDigest`); check a bucket's tensors with :func:`check_arrived`,
  what is served as :class:`VerifyConfig` asks, and an adapter's binding with :func:`check_adapter_binding`
  (:data:`LoraMode`); refusals are :class:`HandoffError` (a delta on the wrong base: :class:`DeltaBaseError`).

A rollout registers through ``hookimpl`` (:mod:`drivetrain_engine_core.backend`), which also holds the error
family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._face import face

if TYPE_CHECKING:
    from ._handoff import (
        BucketReceiver,
        DeltaBaseError,
        HandoffError,
        LoraMode,
        TensorDigest,
        TensorSpec,
        VerifyConfig,
        WeightBucket,
        check_adapter_binding,
        check_arrived,
        digest_of,
    )
    from ._handoff.bucket import as_bytes
    from ._rollout import RecordsRoutedExperts, Rollout, RolloutOutput, end_of_sequence_ids
    from ._rollout_options import RolloutOptions, build_rollout_options
    from ._sampling import SamplingConfig

__all__, __getattr__ = face(__name__)
