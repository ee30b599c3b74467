"""The backend-agnostic ``Engine``: one interface for FSDP2, Megatron-Core or any third-party backend.

Public methods own the checks, the micro-batching, the micro-batch round trip (:mod:`.round_trip`: layout,
labels, outputs back to tokens, the one loss-scaling rule), the LR schedule, the checkpoint layout and the
metrics; backends implement the ``_``-prefixed hooks (template method, as in torchtitan).
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

from . import distributed
from .agreement import agreed_checks
from .checkpoint.orchestration import load_engine_checkpoint, save_engine_checkpoint
from .config import CheckpointConfig, EngineConfig, ModelConfig, OptimizerConfig
from .data.batch import INPUT_IDS, require_tensordict, validate_batch
from .data.jagged import offsets_of
from .data.micro_batch import MicroBatchCountRule, split_micro_batches
from .data.options import ForwardOptions, refuse_batch_options
from .data.tokens import global_counts
from .data.values import TokenLimits, check_batch_values
from .errors import DivergenceError, EngineStateError
from .handoff import DEFAULT_BUCKET_BYTES, LoraMode, WeightBucket
from .handoff.engine_buckets import engine_weight_buckets
from .lr_schedule import LRSchedule
from .outputs import ForwardBackwardOutput, LossContext, LossFn, MicroBatchResult, host_floats
from .round_trip import InputLayout, MicroBatch, RoundTrip, SequenceSplit
from .throughput import StepClock, TransformerShape, peak_tflops, speed_metrics
from .usage import ResourceUsage, measure_usage

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
        # Wall time and this rank's peak memory of initialize() (None before it).
        self.init_usage: ResourceUsage | None = None
        self._shape: TransformerShape | None = None
        self._step_work = (0.0, 0.0)  # global (tokens, FLOPs) of the last forward_backward_batch

    # ------------------------------------------------------------------ lifecycle

    def initialize(self) -> None:
        """Build model, optimizer and LR schedule, then offload what the config asks to offload.

        Its wall time and this rank's peak host (and CUDA) memory are logged and kept in ``init_usage``.
        """
        if self._initialized:
            raise EngineStateError(f"{type(self).__name__}.initialize() was already called; call it once.")
        distributed.init_distributed(self.engine_config.device, self.engine_config.dist_timeout_s)
        with measure_usage(self.engine_config.device) as meter:
            self._initialize()
            self._check_data_parallel_size()
            value_head = self.model_config.model_type == "value_model"
            self._shape = TransformerShape.from_hf_config(self._hf_config(), value_head=value_head)
            if self.optimizer_config is not None:
                self._lr_schedule = LRSchedule(self.optimizer_config, self._optimizer_param_groups)
            self._initialized = True
            self._offload(self.engine_config.param_offload, self.engine_config.optimizer_offload)
        self.init_usage = meter.usage
        if meter.usage is not None:
            metrics = meter.usage.as_metrics("initialize")
            logger.info("%s.initialize() on rank %d: %s", type(self).__name__, distributed.rank(), metrics)

    def _check_data_parallel_size(self) -> None:
        """The layout the backend built is the one its config predicts (trainers check batch sizes with the
        prediction before any engine exists)."""
        world = distributed.world_size()
        predicted = self.engine_config.data_parallel_size(world)
        if self.data_parallel_size != predicted:
            raise EngineStateError(
                f"{type(self).__name__} built {self.data_parallel_size} data-parallel ranks on {world} ranks, but "
                f"{type(self.engine_config).__name__}.data_parallel_size({world}) predicts {predicted}; the backend's "
                "config must override EngineConfig.data_parallel_size to describe the layout it builds."
            )

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
        elif mode == "train" and "train" not in self._mode_stack:
            # NOTE: an eval block loaded the parameters only: a train block inside it needs the optimizer state
            # too (it stayed on the host, and the step failed on mixed devices).
            self._load(params=False, optimizer=True)
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
        self,
        batch: TensorDict,
        loss_fn: LossFn | None = None,
        forward_only: bool = False,
        *,
        options: ForwardOptions | None = None,
    ) -> ForwardBackwardOutput:
        """Run forward (and backward) over ``batch`` in micro-batches.

        Args:
            batch: a no-padding batch (ARCHITECTURE §4), tensors only.
            loss_fn: ``loss_fn(model_output, micro_batch, context) -> (loss, metrics)``; required for backward.
            forward_only: skip backward (no gradients are kept).
            options: temperature and entropy of the forward (defaults: 1.0, no entropy).

        Returns:
            Outputs in the caller's sample order, the global loss and per-micro-batch metrics.

        Raises:
            EngineStateError: not initialised, outside a mode context, or backward outside ``train_mode``.
            BatchError: the batch is malformed (not a TensorDict, bad offsets, token ids outside the vocabulary,
                sequences longer than the model's positions, non-finite float fields) or carries non-tensor
                entries. Raised on every rank when any rank's batch is.
        """
        clock = StepClock(self.engine_config.device)
        with agreed_checks():  # a bad batch on one rank fails every rank, none waits for it
            self._check_compute_allowed(loss_fn, forward_only)
            require_tensordict(batch)
            refuse_batch_options(batch)
            validate_batch(batch, required=self._required_fields(loss_fn is not None))
            check_batch_values(batch, self._token_limits())
        split = split_micro_batches(
            batch, self.engine_config.micro_batch, self.data_parallel_group, self.micro_batch_count_rule
        )
        tokens, sequences = global_counts(batch, self.data_parallel_group, count_tokens=loss_fn is not None)
        round_trip = RoundTrip(
            loss_fn=loss_fn,
            options=options or ForwardOptions(),
            context=LossContext(
                global_token_count=tokens,
                global_sequence_count=sequences,
                num_micro_batches=split.count,
            ),
            gradient_divisor=self.gradient_divisor,
            keep_outputs=self.is_output_rank,
        )
        sequence_split = self._sequence_split()
        fillers = [split.filler()] * split.fillers
        micro_batches = [
            MicroBatch.build(
                micro_batch,
                index,
                device=self.engine_config.device,
                layout=self.input_layout,
                round_trip=round_trip,
                sequence_split=sequence_split,
                filler=index >= len(split.batches),
            )
            for index, micro_batch in enumerate([*split.batches, *fillers])
        ]
        with torch.no_grad() if forward_only else torch.enable_grad():
            results = self._forward_backward_micro_batches(micro_batches, forward_only)
        real = results[: len(split.batches)]  # a filler's result is empty
        output = self._assemble(real, split, loss_fn is not None, self._local_work(batch, forward_only))
        output.metrics.update(self._speed_metrics(clock))
        return output

    def train_batch(
        self, batch: TensorDict, loss_fn: LossFn, *, options: ForwardOptions | None = None
    ) -> ForwardBackwardOutput:
        """Zero grads, forward/backward over ``batch``, one optimizer step; adds ``grad_norm`` and ``lr``.

        Its ``perf/*`` metrics time the whole step, optimizer included.
        """
        self._check_compute_allowed(loss_fn, forward_only=False)
        clock = StepClock(self.engine_config.device)
        self.optimizer_zero_grad()
        output = self.forward_backward_batch(batch, loss_fn, options=options)
        output.metrics["grad_norm"] = self.optimizer_step()
        output.metrics["lr"] = self.current_lr
        output.metrics.update(self._speed_metrics(clock))
        return output

    def infer_batch(
        self, batch: TensorDict, loss_fn: LossFn | None = None, *, options: ForwardOptions | None = None
    ) -> ForwardBackwardOutput:
        """Forward only (no gradients), optionally evaluating ``loss_fn``."""
        return self.forward_backward_batch(batch, loss_fn, forward_only=True, options=options)

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
        """Move parameters, optimizer state and/or gradients to ``device`` (``"cpu"`` or the engine device).

        Gradients live on their parameters' device, so they move with the model: ``grad=True`` without
        ``model`` is refused (assigning a host gradient to a GPU parameter failed inside torch).
        """
        self._require_initialized("to()")
        allowed = {"cpu", self.engine_config.device}
        if device not in allowed:
            raise ValueError(f"engine.to({device!r}): the device must be one of {sorted(allowed)}.")
        if grad and not model:
            raise ValueError(
                f"engine.to({device!r}, model=False, grad=True): a gradient lives on its parameter's device, so "
                "gradients move with the model; pass model=True, or grad=False to move the optimizer state alone."
            )
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
        yield from engine_weight_buckets(
            model_config=self.model_config,
            export_weights=self._export_weights,
            export_adapter_weights=self._export_adapter_weights,
            version=version,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            lora=lora,
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
        return save_engine_checkpoint(self, Path(path), global_step, max_ckpt_to_keep, extra_state)

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
        return load_engine_checkpoint(self, path, load_optimizer=load_optimizer, verify=verify)

    @contextmanager
    def _loaded(self) -> Iterator[None]:
        """Hold offloaded state on the device for the duration of the block (loading a checkpoint); inside an
        eval block as well, which loaded the parameters alone."""
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
        before backward, the one loss-scaling rule (:mod:`drivetrain_engine_core.round_trip`).
        """

    @property
    def input_layout(self) -> InputLayout:
        """The layout of :attr:`MicroBatch.inputs`: a packed row unless ``model.use_remove_padding`` is off."""
        return "packed" if self.model_config.use_remove_padding else "padded"

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
        self, micro_batches: Sequence[MicroBatch], forward_only: bool
    ) -> list[MicroBatchResult]:
        """Run every micro-batch: the model on ``micro_batch.inputs``, the per-position fields to
        ``micro_batch.finish``, and backward of the loss it returns unless ``forward_only``.

        Gradients accumulate across micro-batches; gradient synchronisation may be deferred to the last one.
        """

    def _sequence_split(self) -> SequenceSplit | None:
        """How packed rows are split over sequence-parallel ranks (``None``: not split)."""
        return None

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

    def _hf_config(self) -> Any | None:
        """The model's transformers config, from which core counts FLOPs (``None``: no FLOP metrics)."""
        return None

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

    def _local_work(self, batch: TensorDict, forward_only: bool) -> tuple[float, float]:
        """This rank's ``(tokens, FLOPs)`` of ``batch``, from its lengths on the host (NaN FLOPs: unknown)."""
        lengths = offsets_of(batch[INPUT_IDS]).diff().tolist()
        if self._shape is None:
            return float(sum(lengths)), math.nan
        return float(sum(lengths)), self._shape.step_flops(lengths, backward=not forward_only)

    def _speed_metrics(self, clock: StepClock) -> dict[str, float]:
        """The ``perf/*`` metrics of the work since ``clock`` started (see :mod:`.throughput`)."""
        seconds, device_peak = clock.stop()
        tokens, flops = self._step_work
        return speed_metrics(
            seconds=seconds,
            tokens=tokens,
            flops=None if math.isnan(flops) else flops,
            devices=distributed.world_size(),
            peak=peak_tflops(
                self.engine_config.device, self.engine_config.peak_tflops, self.engine_config.param_dtype
            ),
            device_peak_bytes=device_peak,
        )

    def _assemble(
        self, results: list[MicroBatchResult], micro_batches: Any, with_loss: bool, work: tuple[float, float]
    ) -> ForwardBackwardOutput:
        """Outputs in sample order and the metrics, with one collective for the loss, tokens and FLOPs."""
        outputs = None
        if self.is_output_rank:
            outputs = micro_batches.restore([r.outputs for r in results])
        losses = [r.loss for r in results if r.loss is not None]
        numbers = iter(host_floats([*losses, *(v for r in results for v in r.metrics.values())]))
        local_loss = sum(next(numbers) for _ in losses)
        metrics: dict[str, list[float] | float] = {}
        for result in results:
            for name in result.metrics:
                metrics.setdefault(name, []).append(next(numbers))  # type: ignore[union-attr]
        total_loss, *step_work = distributed.all_reduce_sums([local_loss, *work], self.data_parallel_group)
        self._step_work = (step_work[0], step_work[1])
        return ForwardBackwardOutput(outputs=outputs, loss=total_loss if with_loss else None, metrics=metrics)
