"""The backend-agnostic ``Engine``: one interface for FSDP2, Megatron-Core or any third-party backend.

Public methods own the checks, the micro-batching, the loss normalisation, the LR schedule, the checkpoint
layout and the metrics; backends implement the ``_``-prefixed hooks (template method, as in torchtitan).
Algorithm code (the roles) uses only the public methods.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from tensordict import TensorDict

from . import distributed as dist_utils
from .agreement import agreed_checks
from .checkpoint import (
    Manifest,
    peft_adapter_config,
    prepare_temporary_step_dir,
    prune_old_steps,
    publish_step,
    read_manifest,
    resolve_step_dir,
    temporary_step_dir,
)
from .checkpoint.extra_state import load_extra_state, require_json, save_extra_state, verify_on_rank_zero
from .config import CheckpointConfig, EngineConfig, ModelConfig, OptimizerConfig
from .data.batch import require_tensordict, validate_batch
from .data.micro_batch import MicroBatchCountRule, split_micro_batches
from .data.options import ForwardOptions, read_forward_options, strip_forward_options
from .data.tokens import global_counts
from .data.values import TokenLimits, check_batch_values
from .errors import CheckpointError, DivergenceError, EngineStateError
from .handoff import DEFAULT_BUCKET_BYTES, LORA_MODES, LoraMode, WeightBucket, bucket_tensors
from .lr_schedule import LRSchedule
from .outputs import ForwardBackwardOutput, LossContext, LossFn, MicroBatchResult

logger = logging.getLogger(__name__)
Mode = Literal["train", "eval"]


class Engine(ABC):
    """A model, its optimizer and its sharding, behind one interface.

    Args:
        model_config: which model to build.
        engine_config: backend settings (a backend's own subclass of :class:`EngineConfig`).
        optimizer_config: AdamW + LR schedule; ``None`` builds an inference-only engine.
        checkpoint_config: checkpoint contents and retention.
    """

    backend_name: ClassVar[str] = ""
    """Name the backend registers under; written into checkpoint manifests."""

    config_class: ClassVar[type[EngineConfig]] = EngineConfig
    """The engine-config type this backend accepts."""

    gradients_averaged_over_data_parallel: ClassVar[bool] = True
    """Whether the backend's gradient reduction averages (rather than sums) over data-parallel ranks."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        optimizer_config: OptimizerConfig | None = None,
        checkpoint_config: CheckpointConfig | None = None,
    ) -> None:
        if not isinstance(engine_config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(engine_config).__name__}; "
                f"build it with {self.config_class.__module__}.{self.config_class.__name__}(...)."
            )
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config or CheckpointConfig()
        self._initialized = False
        self._mode_stack: list[Mode] = []
        self._lr_schedule: LRSchedule | None = None
        self.skipped_steps = 0
        self._consecutive_skips = 0

    # ------------------------------------------------------------------ lifecycle

    def initialize(self) -> None:
        """Build model, optimizer and LR schedule, then offload what the config asks to offload."""
        if self._initialized:
            raise EngineStateError(f"{type(self).__name__}.initialize() was already called; call it once.")
        dist_utils.init_distributed(self.engine_config.device, self.engine_config.dist_timeout_s)
        self._initialize()
        if self.optimizer_config is not None:
            self._lr_schedule = LRSchedule(self.optimizer_config, self._optimizer_param_groups)
        self._initialized = True
        self._offload(self.engine_config.param_offload, self.engine_config.optimizer_offload)

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def mode(self) -> Mode | None:
        """``"train"`` or ``"eval"`` inside the mode context managers, else ``None``."""
        return self._mode_stack[-1] if self._mode_stack else None

    @contextmanager
    def train_mode(self) -> Iterator[Engine]:
        """Train mode: load offloaded state on entry, offload again on exit. Re-entrant."""
        with self._enter(mode="train"):
            yield self

    @contextmanager
    def eval_mode(self) -> Iterator[Engine]:
        """Eval mode (no dropout): load offloaded parameters on entry, offload on exit. Re-entrant."""
        with self._enter(mode="eval"):
            yield self

    @contextmanager
    def _enter(self, mode: Mode) -> Iterator[None]:
        self._require_initialized(f"{mode}_mode()")
        outermost = not self._mode_stack
        if outermost:
            self._load(params=True, optimizer=mode == "train")
        previous = self.mode
        self._mode_stack.append(mode)
        if previous != mode:
            self._set_mode(mode)
        try:
            yield
        finally:
            self._mode_stack.pop()
            if self._mode_stack and self.mode != mode:
                self._set_mode(self._mode_stack[-1])
            if outermost:
                self._offload(self.engine_config.param_offload, self.engine_config.optimizer_offload)

    # ------------------------------------------------------------------ compute

    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None = None, forward_only: bool = False
    ) -> ForwardBackwardOutput:
        """Run forward (and backward) over ``batch`` in micro-batches.

        Args:
            batch: a no-padding batch (ARCHITECTURE §4); options ``temperature`` and ``compute_entropy`` travel
                as non-tensor metadata.
            loss_fn: ``loss_fn(model_output, micro_batch, context) -> (loss, metrics)``; required for backward.
            forward_only: skip backward (no gradients are kept).

        Returns:
            Outputs in the caller's sample order, the global loss and per-micro-batch metrics.

        Raises:
            EngineStateError: not initialised, outside a mode context, or backward outside ``train_mode``.
            BatchError: the batch is malformed: not a TensorDict, bad offsets, token ids outside the vocabulary,
                sequences longer than the model's positions, non-finite float fields. Raised on every rank when
                any rank's batch is.
        """
        with agreed_checks():  # a bad batch on one rank fails every rank, none waits for it
            self._check_compute_allowed(loss_fn, forward_only)
            require_tensordict(batch)
            options = read_forward_options(batch)
            batch = strip_forward_options(batch)
            validate_batch(batch, required=self._required_fields(loss_fn is not None))
            check_batch_values(batch, self._token_limits())
        micro_batches = split_micro_batches(
            batch, self.engine_config.micro_batch, self.data_parallel_group, self.micro_batch_count_rule
        )
        tokens, sequences = global_counts(batch, self.data_parallel_group, count_tokens=loss_fn is not None)
        context = LossContext(
            global_token_count=tokens,
            global_sequence_count=sequences,
            data_parallel_size=self.data_parallel_size,
            num_micro_batches=len(micro_batches.batches),
        )
        grad_context = torch.no_grad() if forward_only else torch.enable_grad()
        with grad_context:
            results = self._forward_backward_micro_batches(
                micro_batches.batches, loss_fn, forward_only, options, context
            )
        return self._assemble(results, micro_batches, loss_fn is not None)

    def train_batch(self, batch: TensorDict, loss_fn: LossFn) -> ForwardBackwardOutput:
        """Zero grads, forward/backward over ``batch``, one optimizer step; adds ``grad_norm`` and ``lr``."""
        self._check_compute_allowed(loss_fn, forward_only=False)
        self.optimizer_zero_grad()
        output = self.forward_backward_batch(batch, loss_fn)
        output.metrics["grad_norm"] = self.optimizer_step()
        output.metrics["lr"] = self.current_lr
        return output

    def infer_batch(self, batch: TensorDict, loss_fn: LossFn | None = None) -> ForwardBackwardOutput:
        """Forward only (no gradients), optionally evaluating ``loss_fn``."""
        return self.forward_backward_batch(batch, loss_fn, forward_only=True)

    def compute_micro_batch_loss(
        self, loss_fn: LossFn, model_output: TensorDict, micro_batch: TensorDict, context: LossContext
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Call ``loss_fn`` for one micro-batch; backends call this from their forward loop.

        Returns:
            ``(loss_to_backward, reported_loss, metrics)``: the first is scaled so that the backend's gradient
            reduction yields the gradient of the global mini-batch loss; the second is the detached, unscaled
            contribution.
        """
        loss, metrics = loss_fn(model_output, micro_batch, context)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn must return (scalar tensor, dict of floats), got loss of type {type(loss).__name__}"
                f"{' with shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else ''}."
            )
        scale = context.data_parallel_size if self.gradients_averaged_over_data_parallel else 1
        return loss.reshape(()) * scale, loss.detach().reshape(()), {k: float(v) for k, v in metrics.items()}

    # ------------------------------------------------------------------ optimizer

    def optimizer_zero_grad(self) -> None:
        self._require_optimizer("optimizer_zero_grad()")
        self._optimizer_zero_grad()

    def optimizer_step(self) -> float:
        """Clip gradients and step the optimizer.

        Returns:
            The global gradient norm before clipping. A non-finite norm skips the update (gradients are
            zeroed, ``skipped_steps`` grows, the next ``lr_scheduler_step`` does not advance) and is logged.

        Raises:
            DivergenceError: ``optimizer.max_consecutive_skips`` updates in a row were skipped (on every rank:
                the norm is global).
        """
        self._require_optimizer("optimizer_step()")
        if self.mode != "train":
            raise EngineStateError("optimizer_step() must be called inside `with engine.train_mode():`.")
        config = self.optimizer_config
        assert config is not None
        grad_norm = float(self._clip_grad_norm(config.clip_grad))
        if math.isfinite(grad_norm):
            self._consecutive_skips = 0
            self._optimizer_step()
            return grad_norm
        self.skipped_steps += 1
        self._consecutive_skips += 1
        logger.warning(
            "grad norm is %s: skipping this optimizer update (%d skipped so far)",
            grad_norm,
            self.skipped_steps,
        )
        self._optimizer_zero_grad()
        limit = config.max_consecutive_skips
        if limit is not None and self._consecutive_skips >= limit:
            raise DivergenceError(
                f"{self._consecutive_skips} optimizer updates in a row had a non-finite grad norm (last: "
                f"{grad_norm}) and were skipped: the run diverged. Lower optimizer.lr, set optimizer.clip_grad, "
                "check the data for broken rows, or raise optimizer.max_consecutive_skips."
            )
        return grad_norm

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; returns the new learning rate.

        After a skipped update the schedule stays where it is: the schedule counts updates that happened,
        so warm-up and decay are not consumed by steps that changed nothing (as Megatron-LM does).
        """
        self._require_optimizer("lr_scheduler_step()")
        assert self._lr_schedule is not None
        if self._consecutive_skips:
            return self._lr_schedule.current_lr
        return self._lr_schedule.step()

    @property
    def current_lr(self) -> float:
        self._require_optimizer("current_lr")
        assert self._lr_schedule is not None
        return self._lr_schedule.current_lr

    # ------------------------------------------------------------------ placement and adapters

    def to(self, device: str, *, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move parameters, optimizer state and/or gradients to ``device`` (``"cpu"`` or the engine device)."""
        self._require_initialized("to()")
        allowed = {"cpu", self.engine_config.device}
        if device not in allowed:
            raise ValueError(f"engine.to({device!r}): the device must be one of {sorted(allowed)}.")
        self._to(device, model=model, optimizer=optimizer, grad=grad)

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Run the frozen base model (LoRA adapters off) inside the block."""
        self._require_initialized("disable_adapter()")
        if self.model_config.lora is None:
            raise EngineStateError(
                "disable_adapter() needs LoRA adapters; set model.lora to train with adapters."
            )
        with self._disable_adapter():
            yield

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hugging_face_name, full tensor)`` pairs, adapters merged into the base weights."""
        self._require_initialized("export_weights()")
        yield from self._export_weights()

    def weight_buckets(
        self,
        *,
        version: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        lora: LoraMode = "merged",
    ) -> Iterator[WeightBucket]:
        """Stream the weights to a rollout engine in buckets of at most ``bucket_bytes`` (a collective).

        Every rank iterates (backends gather across their shards) and every rank receives the same buckets.
        Memory stays bounded: one bucket plus the one full tensor the backend just gathered
        (:mod:`.handoff.stream`); drop each bucket before asking for the next.

        Args:
            version: the training step of the weights; a receiver refuses a version not newer than its own.
            bucket_bytes: the most bytes one bucket holds; a larger tensor is a bucket of its own.
            dtype: cast floating-point tensors to this dtype (``None`` keeps the training dtype).
            lora: ``merged`` (full Hugging Face weights, adapters folded in: what ``export_weights`` yields) or
                ``adapter`` (only the PEFT adapter tensors, named as in ``adapter_model.safetensors``, with the
                PEFT config in every bucket).

        Raises:
            EngineStateError: not initialised, or ``lora="adapter"`` on an engine without LoRA adapters.
            ValueError: ``lora`` is not one of ``merged``/``adapter``, or ``bucket_bytes`` is not positive.
        """
        self._require_initialized("weight_buckets()")
        if lora not in LORA_MODES:
            raise ValueError(f"weight_buckets(lora={lora!r}): choose one of {list(LORA_MODES)}.")
        adapter_config = None
        if lora == "adapter":
            adapter_config = self._adapter_config()
            tensors = self._export_adapter_weights()
        else:
            tensors = self._export_weights()
        yield from bucket_tensors(
            tensors,
            version=version,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            lora=lora,
            adapter_config=adapter_config,
        )

    def _adapter_config(self) -> dict[str, Any]:
        lora = self.model_config.lora
        if lora is None:
            raise EngineStateError(
                "weight_buckets(lora='adapter') needs LoRA adapters, and this engine trains the full model "
                "(model.lora is unset); hand off with lora='merged'."
            )
        value_model = self.model_config.model_type == "value_model"
        return peft_adapter_config(
            {**lora.__dict__, "target_modules": list(lora.target_modules)},
            model_type=self.model_config.model_type,
            model_path=str(Path(self.model_config.path).resolve()),
            modules_to_save=["score"] if value_model else [],
        )

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        path: str | Path,
        global_step: int,
        max_ckpt_to_keep: int | None = None,
        extra_state: dict[str, Any] | None = None,
    ) -> Path:
        """Save ``<path>/global_step_<N>/`` atomically and durably (collective: every rank calls it).

        The step is written under a temporary name, fsynced, completed by its manifest and renamed into place;
        a step that already exists is replaced without a moment when no complete copy exists; pruning keeps
        the step just saved whatever its number (see :mod:`.checkpoint.publish`).

        Args:
            path: the checkpoint root.
            global_step: step number of the state.
            max_ckpt_to_keep: keep this many newest steps (overrides the checkpoint config).
            extra_state: JSON-serialisable caller state (data position, ...) returned by ``load_checkpoint``.

        Returns:
            The published step directory.
        """
        self._require_initialized("save_checkpoint()")
        require_json("extra_state", extra_state)
        root = Path(path)
        temporary = temporary_step_dir(root, global_step)
        is_writer = dist_utils.rank() == 0
        if is_writer:
            prepare_temporary_step_dir(temporary)
        dist_utils.barrier()
        self._save_checkpoint(temporary, save_optimizer=self.checkpoint_config.save_optimizer)
        save_extra_state(temporary / "extra", self._extra_state(extra_state or {}))
        dist_utils.barrier()
        final = root / f"global_step_{global_step}"
        if is_writer:
            final = publish_step(root, temporary, global_step, self._manifest(global_step))
            keep = (
                max_ckpt_to_keep if max_ckpt_to_keep is not None else self.checkpoint_config.max_ckpt_to_keep
            )
            if keep is not None:
                prune_old_steps(root, keep, published=final)
        dist_utils.barrier()
        return final

    def load_checkpoint(
        self, path: str | Path, *, load_optimizer: bool = True, verify: bool = True
    ) -> dict[str, Any]:
        """Load a step (or a root's ``latest``) written by the same backend.

        Returns:
            ``{"global_step": N, **extra_state}`` as given to ``save_checkpoint``.

        Raises:
            CheckpointError: incomplete step, missing or corrupt file, or another backend's checkpoint.
        """
        self._require_initialized("load_checkpoint()")
        step_dir = resolve_step_dir(path)
        manifest = read_manifest(step_dir)
        if manifest.backend != self.backend_name:
            raise CheckpointError(
                f"{step_dir} was written by the {manifest.backend!r} backend; this engine is {self.backend_name!r}. "
                "Merge it to Hugging Face format with `drivetrain ckpt merge` and start from that model."
            )
        if verify:
            verify_on_rank_zero(step_dir, manifest)
        with self._loaded():
            self._load_checkpoint(
                step_dir, load_optimizer=load_optimizer and self.optimizer_config is not None
            )
        state = load_extra_state(step_dir / "extra")
        if self._lr_schedule is not None and "lr_schedule" in state:
            self._lr_schedule.load_state_dict(state["lr_schedule"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        return {"global_step": manifest.global_step, **state["extra_state"]}

    def _manifest(self, global_step: int) -> Manifest:
        lora = self.model_config.lora
        return Manifest(
            backend=self.backend_name,
            global_step=global_step,
            world_size=dist_utils.world_size(),
            model_type=self.model_config.model_type,
            model_path=str(Path(self.model_config.path).resolve()),
            lora=None if lora is None else {**lora.__dict__, "target_modules": list(lora.target_modules)},
            backend_info=self._checkpoint_backend_info(),
        )

    def _extra_state(self, caller_state: dict[str, Any]) -> dict[str, Any]:
        """What core saves beside the backend's state: caller state, skipped steps, LR schedule."""
        state: dict[str, Any] = {"extra_state": caller_state, "skipped_steps": self.skipped_steps}
        if self._lr_schedule is not None:
            state["lr_schedule"] = self._lr_schedule.state_dict()
        return state

    @contextmanager
    def _loaded(self) -> Iterator[None]:
        """Hold offloaded state on the device for the duration of the block (loading a checkpoint)."""
        if self._mode_stack:
            yield
            return
        with self.train_mode() if self.optimizer_config is not None else self.eval_mode():
            yield

    # ------------------------------------------------------------------ parallel layout

    @property
    @abstractmethod
    def data_parallel_rank(self) -> int: ...

    @property
    @abstractmethod
    def data_parallel_size(self) -> int: ...

    @property
    @abstractmethod
    def data_parallel_group(self) -> dist_utils.ProcessGroup | None: ...

    @property
    @abstractmethod
    def is_output_rank(self) -> bool:
        """Whether this rank holds outputs and metrics of its data-parallel shard."""

    @property
    def micro_batch_count_rule(self) -> MicroBatchCountRule:
        """The micro-batch counts this backend's schedule accepts (any count unless a backend says so)."""
        return MicroBatchCountRule()

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    def _initialize(self) -> None:
        """Build the model (and optimizer when ``optimizer_config`` is set) on the configured device."""

    @abstractmethod
    def _forward_backward_micro_batches(
        self,
        micro_batches: Sequence[TensorDict],
        loss_fn: LossFn | None,
        forward_only: bool,
        options: ForwardOptions,
        context: LossContext,
    ) -> list[MicroBatchResult]:
        """Run every micro-batch (forward, ``compute_micro_batch_loss``, backward unless ``forward_only``).

        Gradients accumulate across micro-batches; gradient synchronisation may be deferred to the last one.
        ``context.micro_batch_index`` must be set per micro-batch (``dataclasses.replace``).
        """

    @abstractmethod
    def _set_mode(self, mode: Mode) -> None:
        """Switch dropout and friends (``model.train()`` / ``model.eval()``)."""

    @abstractmethod
    def _load(self, *, params: bool, optimizer: bool) -> None:
        """Bring offloaded parameters / optimizer state to the device (no-op where nothing is offloaded)."""

    @abstractmethod
    def _offload(self, params: bool, optimizer: bool) -> None:
        """Move parameters / optimizer state to CPU where the flags ask for it."""

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
    def _to(self, device: str, *, model: bool, optimizer: bool, grad: bool) -> None: ...

    @abstractmethod
    def _disable_adapter(self) -> Any:
        """A context manager under which the model runs without its LoRA adapters."""

    @abstractmethod
    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` lazily, adapters merged; gather one tensor (or layer) at a time."""

    def _export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(peft_name, full tensor)`` for every LoRA adapter tensor (and ``modules_to_save`` weight).

        Names are those of a PEFT ``adapter_model.safetensors`` (:func:`.checkpoint.split_peft_name`). Only
        backends that train LoRA adapters override this; the default says the backend has none.
        """
        raise EngineStateError(
            f"the {self.backend_name or type(self).__name__} backend cannot hand off LoRA adapters alone; use "
            "weight_buckets(lora='merged')."
        )

    @abstractmethod
    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        """Write ``model/`` (and ``optimizer/``) under ``step_dir`` (collective)."""

    @abstractmethod
    def _load_checkpoint(self, step_dir: Path, *, load_optimizer: bool) -> None:
        """Read what ``_save_checkpoint`` wrote (collective)."""

    def _checkpoint_backend_info(self) -> dict[str, Any]:
        """Backend layout details recorded in the manifest (parallel sizes, formats)."""
        return {}

    def _token_limits(self) -> TokenLimits:
        """The vocabulary and positions batches are checked against; backends that know them override this."""
        return TokenLimits()

    def _required_fields(self, with_loss: bool) -> tuple[str, ...]:
        """Batch fields the engine needs; ``loss_mask`` is needed to normalise losses."""
        return ("input_ids", "position_ids", "loss_mask") if with_loss else ("input_ids", "position_ids")

    # ------------------------------------------------------------------ shared checks

    def _require_initialized(self, what: str) -> None:
        if not self._initialized:
            raise EngineStateError(f"{what} needs an initialised engine; call engine.initialize() first.")

    def _require_optimizer(self, what: str) -> None:
        self._require_initialized(what)
        if self.optimizer_config is None:
            raise EngineStateError(
                f"{what} needs an optimizer; this engine was built with optimizer_config=None."
            )

    def _check_compute_allowed(self, loss_fn: LossFn | None, forward_only: bool) -> None:
        self._require_initialized("forward_backward_batch()")
        if self.mode is None:
            raise EngineStateError(
                "compute needs a mode: wrap the call in `with engine.train_mode():` or `with engine.eval_mode():`."
            )
        if not forward_only:
            if self.mode != "train":
                raise EngineStateError(
                    "backward (train_batch / forward_only=False) must run inside `engine.train_mode()`."
                )
            if loss_fn is None:
                raise EngineStateError(
                    "backward needs a loss function: pass loss_fn=... (or use infer_batch)."
                )
            self._require_optimizer("training")

    def _assemble(
        self, results: list[MicroBatchResult], micro_batches: Any, with_loss: bool
    ) -> ForwardBackwardOutput:
        outputs = None
        if self.is_output_rank:
            outputs = micro_batches.restore([r.outputs for r in results])
        metrics: dict[str, list[float] | float] = {}
        for result in results:
            for name, value in result.metrics.items():
                metrics.setdefault(name, []).append(value)  # type: ignore[union-attr]
        loss = None
        if with_loss:
            local = sum(float(r.loss) for r in results if r.loss is not None)
            loss = dist_utils.all_reduce_sum(local, self.data_parallel_group)
        return ForwardBackwardOutput(outputs=outputs, loss=loss, metrics=metrics)
