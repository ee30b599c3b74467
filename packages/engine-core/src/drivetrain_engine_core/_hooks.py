"""``BackendHooks``: every hook a backend implements, in one place (pytest's ``hookspec.py`` habit).

:class:`~.engine.Engine` subclasses it and calls these hooks from its public template methods; a backend
subclasses ``Engine`` and implements them. Required hooks are abstract. The hooks of an optional capability
(:mod:`.capabilities`) are implemented exactly when the backend declares it in ``capabilities``; the class is
refused at definition otherwise. The rest have defaults a backend may override. docs/architecture.md §3 has
the table: each hook, when it is called, whether it is collective, whether it is required.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from . import _distributed as distributed
from ._capabilities import BackendCapabilities, check_capability_hooks
from ._config import EngineConfig
from ._data.micro_batch import MicroBatchCountRule
from ._data.values import TokenLimits
from ._errors import EngineStateError
from ._modes import Mode
from ._outputs import MicroBatchResult
from ._round_trip import MicroBatch, SequenceSplit

if TYPE_CHECKING:
    from ._checkpoint.hf_state import HFTrainingState
    from ._handoff.local_shards import ShardedWeight


class BackendHooks(ABC):
    """The backend's side of the Engine contract (see the module docstring)."""

    backend_name: ClassVar[str] = ""
    """Name the backend registers under; written into checkpoint manifests."""

    config_class: ClassVar[type[EngineConfig]] = EngineConfig
    """The engine-config type this backend accepts."""

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()
    """The optional capabilities this backend implements (default: none)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_capability_hooks(cls, BackendHooks)

    # ------------------------------------------------------------------ parallel layout (required)

    @property
    @abstractmethod
    def data_parallel_rank(self) -> int: ...

    @property
    @abstractmethod
    def data_parallel_size(self) -> int: ...

    @property
    @abstractmethod
    def data_parallel_group(self) -> distributed.ProcessGroup | None: ...

    @property
    @abstractmethod
    def is_output_rank(self) -> bool:
        """Whether this rank holds outputs and metrics of its data-parallel shard."""

    @property
    @abstractmethod
    def gradient_divisor(self) -> int:
        """How many ranks the backend's gradient reduction divides the summed gradients by.

        Averaging over N ranks: N; summing (or one process): 1. Core multiplies every micro-batch loss by it
        before backward, the one loss-scaling rule (``drivetrain_engine_core.backend.MicroBatch.finish``).
        """

    @property
    def micro_batch_count_rule(self) -> MicroBatchCountRule:
        """The micro-batch counts this backend's schedule accepts (any count unless a backend says so)."""
        return MicroBatchCountRule()

    # ------------------------------------------------------------------ build and compute (required)

    @abstractmethod
    def _initialize(self) -> None:
        """Build the model (and optimizer when ``optimizer_config`` is set) on the configured device."""

    @abstractmethod
    def _forward_backward_micro_batches(
        self, micro_batches: Sequence[MicroBatch], forward_only: bool
    ) -> list[MicroBatchResult]:
        """Run every micro-batch: the model on ``micro_batch.inputs``, the per-position fields to
        ``micro_batch.finish``, and backward of the loss it returns unless ``forward_only``.

        Gradients accumulate across micro-batches; gradient synchronisation may be deferred to the last one.
        """

    @abstractmethod
    def _set_mode(self, mode: Mode) -> None:
        """Switch dropout and friends (``model.train()`` / ``model.eval()``)."""

    @abstractmethod
    def _optimizer_param_groups(self) -> Sequence[dict[str, Any]]:
        """The optimizer's parameter groups, whose ``lr`` the LR schedule sets."""

    @abstractmethod
    def _optimizer_zero_grad(self) -> None: ...

    @abstractmethod
    def _clip_grad_norm(self, max_norm: float | None) -> float:
        """Global gradient norm before clipping, clipping to ``max_norm`` unless it is ``None``."""

    @abstractmethod
    def _optimizer_step(self) -> None: ...

    @abstractmethod
    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` lazily, adapters merged; gather one tensor (or layer) at a time."""

    @abstractmethod
    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        """Write ``model/`` (and ``optimizer/``) under ``step_dir`` (collective)."""

    @abstractmethod
    def _load_checkpoint(self, step_dir: Path, *, load_optimizer: bool) -> None:
        """Read what ``_save_checkpoint`` wrote (collective)."""

    # ------------------------------------------------------------------ with defaults

    def _token_limits(self) -> TokenLimits:
        """The vocabulary and positions batches are checked against; backends that know them override this
        (the conformance kit requires it)."""
        return TokenLimits()

    def _hf_config(self) -> Any | None:
        """The model's transformers config, from which core counts FLOPs (``None``: no FLOP metrics; the
        conformance kit requires one)."""
        return None

    def _checkpoint_backend_info(self) -> dict[str, Any]:
        """Backend layout details recorded in the manifest (parallel sizes, formats)."""
        return {}

    # ------------------------------------------------------------------ capability "offload"

    def _load_to_device(self, *, params: bool, optimizer: bool) -> None:
        """Bring offloaded parameters / optimizer state to the device (entering a mode)."""
        raise _undeclared(self, "offload", "_load_to_device")

    def _offload_to_host(self, params: bool, optimizer: bool) -> None:
        """Move parameters / optimizer state to CPU where the flags ask for it (initialising, leaving a mode)."""
        raise _undeclared(self, "offload", "_offload_to_host")

    def _to(self, device: str, *, model: bool, optimizer: bool, grad: bool) -> None:
        """Move what is asked to ``device`` (``engine.to``)."""
        raise _undeclared(self, "offload", "_to")

    # ------------------------------------------------------------------ capability "lora"

    def _disable_adapter(self) -> AbstractContextManager[Any]:
        """A context manager under which the model runs without its LoRA adapters."""
        raise _undeclared(self, "lora", "_disable_adapter")

    def _export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(peft_name, full tensor)`` for every LoRA adapter tensor (and ``modules_to_save`` weight),
        named as in a PEFT ``adapter_model.safetensors`` (:func:`.checkpoint.split_peft_name`)."""
        raise _undeclared(self, "lora", "_export_adapter_weights")

    # ------------------------------------------------------------------ capability "sequence_parallel"

    def _sequence_split(self) -> SequenceSplit | None:
        """How packed rows are split over sequence-parallel ranks (``None``: not split)."""
        return None

    # ------------------------------------------------------------------ capability "hf_state_resume"

    def _load_hf_state(self, state: HFTrainingState, *, load_optimizer: bool) -> None:
        """Load another backend's (or layout's) step from its full state under Hugging Face names (collective):
        check ``state.check_fits`` first, then map ``state.tensors("weight")`` onto the parameters and, with
        ``load_optimizer``, each Adam moment onto the optimizer state and ``state.adam_step()`` onto its step,
        with the name and layout transforms the backend uses to load a Hugging Face model."""
        raise _undeclared(self, "hf_state_resume", "_load_hf_state")

    # ------------------------------------------------------------------ capability "sharded_export"

    def _export_weight_shards(self) -> Iterator[ShardedWeight]:
        """Yield what ``_export_weights`` yields as :class:`~.handoff.local_shards.ShardedWeight` groups, in the
        same order: each group's local shards on this rank and the collective that gathers its full tensors
        (adapters merged). Yielding a group gathers nothing; ``weight_buckets`` gathers the changed ones."""
        raise _undeclared(self, "sharded_export", "_export_weight_shards")


def _undeclared(engine: BackendHooks, capability: str, hook: str) -> EngineStateError:
    """The error of a capability hook reached on a backend without it: the public methods refuse such a request
    first, so only a direct call of the hook gets here."""
    return EngineStateError(
        f"{type(engine).__name__}.{hook}() belongs to the {capability!r} capability, which the "
        f"{engine.backend_name or type(engine).__name__} backend does not declare."
    )
