"""The backend-agnostic ``Engine``: one interface for FSDP2, Megatron-Core or any third-party backend.

Public methods own the checks (:mod:`.state_checks`), the micro-batching, the micro-batch round trip
(:mod:`.round_trip`), the LR schedule and skip policy (:mod:`.skips`), the checkpoint sequence
(:mod:`.checkpoint.orchestration`), the weight hand-off (:mod:`.handoff.engine_buckets`) and the metrics
(:mod:`.step_results`); backends implement the hooks of :class:`~.hooks.BackendHooks` (template method, as in
torchtitan) and declare their optional capabilities (:mod:`.capabilities`). Roles use only the public methods.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from . import _distributed as distributed
from . import _state_checks as checks
from ._agreement import agreed_checks
from ._capabilities import refuse_missing_capabilities
from ._checkpoint.hf_state import MergerLookup
from ._checkpoint.orchestration import load_engine_checkpoint, save_engine_checkpoint
from ._config import CheckpointConfig, EngineConfig, ModelConfig, OptimizerConfig
from ._data.micro_batch import split_micro_batches
from ._data.options import ForwardOptions
from ._data.tokens import global_counts
from ._data.values import TokenLimits
from ._errors import EngineStateError
from ._handoff import DEFAULT_BUCKET_BYTES, LoraMode, SentShards, WeightBucket
from ._handoff.engine_buckets import engine_weight_buckets
from ._hooks import BackendHooks
from ._lr_schedule import LRSchedule
from ._modes import Mode, ModeStack
from ._outputs import ForwardBackwardOutput, LossContext, LossFn
from ._round_trip import InputLayout, RoundTrip
from ._skips import SkipPolicy
from ._step_results import StepMeter
from ._throughput import StepClock, TransformerShape
from ._usage import ResourceUsage, measure_usage

logger = logging.getLogger(__name__)


class Engine(BackendHooks):
    """A model, its optimizer and its sharding, behind one interface.

    Args:
        model_config: which model to build.
        engine_config: backend settings (a backend's own subclass of :class:`EngineConfig`).
        optimizer_config: AdamW + LR schedule; ``None`` builds an inference-only engine.
        checkpoint_config: checkpoint contents and retention.
        mergers: backend -> its merger class, to load other backends' steps (``create_engine`` passes them).
    """

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        optimizer_config: OptimizerConfig | None = None,
        checkpoint_config: CheckpointConfig | None = None,
        mergers: MergerLookup | None = None,
    ) -> None:
        checks.check_config_class(type(self).__name__, self.config_class, engine_config)
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config or CheckpointConfig()
        self.mergers = mergers
        self._initialized = False
        offload = self.capabilities.offload
        self._modes = ModeStack(
            self._set_mode,
            load=self._load_to_device if offload else None,
            offload=self._offload_configured if offload else None,
        )
        self.lr_schedule: LRSchedule | None = None
        """The LR schedule (``None`` before ``initialize`` and on inference-only engines); checkpoints save it."""
        self.skips = SkipPolicy(optimizer_config.max_consecutive_skips if optimizer_config else None)
        """Skipped optimizer updates (non-finite grad norms) and the divergence limit (:mod:`.skips`)."""
        self.init_usage: ResourceUsage | None = None  # initialize()'s wall time and this rank's peak memory
        self._meter = StepMeter(engine_config)
        self.sent_weights = SentShards()

    # ------------------------------------------------------------------ lifecycle

    def initialize(self) -> None:
        """Build model, optimizer and LR schedule, then offload what the config asks to offload.

        Its wall time and this rank's peak host (and CUDA) memory are logged and kept in ``init_usage``.

        Raises:
            ConfigError: the configs ask for a capability the backend does not declare (as ``create_engine``).
        """
        if self._initialized:
            raise EngineStateError(f"{type(self).__name__}.initialize() was already called; call it once.")
        refuse_missing_capabilities(
            self.backend_name or type(self).__name__,
            self.capabilities,
            self.model_config,
            self.engine_config,
            self.optimizer_config,
        )
        distributed.init_distributed(self.engine_config.device, self.engine_config.dist_timeout_s)
        with measure_usage(self.engine_config.device) as meter:
            self._initialize()
            checks.check_data_parallel_size(type(self).__name__, self.data_parallel_size, self.engine_config)
            value_head = self.model_config.model_type == "value_model"
            self._meter.shape = TransformerShape.from_hf_config(self._hf_config(), value_head=value_head)
            if self.optimizer_config is not None:
                self.lr_schedule = LRSchedule(self.optimizer_config, self._optimizer_param_groups)
            self._initialized = True
            if self.capabilities.offload:
                self._offload_configured()
        self.init_usage = meter.usage
        if meter.usage is not None:
            metrics = meter.usage.as_metrics("initialize")
            logger.info("%s.initialize() on rank %d: %s", type(self).__name__, distributed.rank(), metrics)

    def _require_optimizer(self, what: str) -> None:
        checks.require_optimizer(self._initialized, self.optimizer_config is not None, what)

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def mode(self) -> Mode | None:
        """``"train"`` or ``"eval"`` inside the mode context managers, else ``None``."""
        return self._modes.current

    @contextmanager
    def train_mode(self) -> Iterator[Engine]:
        """Train mode: load offloaded state on entry, offload again on exit. Re-entrant."""
        checks.require_initialized(self._initialized, "train_mode()")
        with self._modes.enter("train"):
            yield self

    @contextmanager
    def eval_mode(self) -> Iterator[Engine]:
        """Eval mode (no dropout): load offloaded parameters on entry, offload on exit. Re-entrant."""
        checks.require_initialized(self._initialized, "eval_mode()")
        with self._modes.enter("eval"):
            yield self

    @contextmanager
    def holding_state(self) -> Iterator[None]:
        """Hold offloaded state on the device for the duration of the block (loading a checkpoint); inside an
        eval block as well, which loaded the parameters alone."""
        with self.train_mode() if self.optimizer_config is not None else self.eval_mode():
            yield

    def _offload_configured(self) -> None:
        """Offload what the config asks to keep on the host outside mode blocks."""
        self._offload_to_host(self.engine_config.param_offload, self.engine_config.optimizer_offload)

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
            checks.check_compute(self._initialized, self.mode, self.optimizer_config, loss_fn, forward_only)
            checks.check_batch(batch, with_loss=loss_fn is not None, limits=self.token_limits)
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
        micro_batches = round_trip.micro_batches(
            split,
            device=self.engine_config.device,
            layout=self.input_layout,
            sequence_split=self._sequence_split(),
        )
        with torch.no_grad() if forward_only else torch.enable_grad():
            results = self._forward_backward_micro_batches(micro_batches, forward_only)
        output = self._meter.assemble(
            results[: len(split.batches)],  # a filler's result is empty
            split,
            with_loss=loss_fn is not None,
            work=self._meter.local_work(batch, forward_only),
            group=self.data_parallel_group,
            keep_outputs=self.is_output_rank,
        )
        output.metrics.update(self._meter.speed_metrics(clock))
        return output

    def train_batch(
        self, batch: TensorDict, loss_fn: LossFn, *, options: ForwardOptions | None = None
    ) -> ForwardBackwardOutput:
        """Zero grads, forward/backward over ``batch``, one optimizer step; adds ``grad_norm`` and ``lr``.

        Its ``perf/*`` metrics time the whole step, optimizer included.
        """
        checks.check_compute(self._initialized, self.mode, self.optimizer_config, loss_fn, False)
        clock = StepClock(self.engine_config.device)
        self.optimizer_zero_grad()
        output = self.forward_backward_batch(batch, loss_fn, options=options)
        output.metrics["grad_norm"] = self.optimizer_step()
        output.metrics["lr"] = self.current_lr
        output.metrics.update(self._meter.speed_metrics(clock))
        return output

    def infer_batch(
        self, batch: TensorDict, loss_fn: LossFn | None = None, *, options: ForwardOptions | None = None
    ) -> ForwardBackwardOutput:
        """Forward only (no gradients), optionally evaluating ``loss_fn``."""
        return self.forward_backward_batch(batch, loss_fn, forward_only=True, options=options)

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
        if self.skips.admit(grad_norm):
            self._optimizer_step()
            return grad_norm
        self._optimizer_zero_grad()
        self.skips.raise_if_diverged(grad_norm)
        return grad_norm

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; returns the new learning rate.

        After a skipped update the schedule stays where it is: the schedule counts updates that happened,
        so warm-up and decay are not consumed by steps that changed nothing (as Megatron-LM does).
        """
        self._require_optimizer("lr_scheduler_step()")
        assert self.lr_schedule is not None
        if self.skips.consecutive_skips:
            return self.lr_schedule.current_lr
        return self.lr_schedule.step()

    @property
    def current_lr(self) -> float:
        self._require_optimizer("current_lr")
        assert self.lr_schedule is not None
        return self.lr_schedule.current_lr

    @property
    def skipped_steps(self) -> int:
        """Optimizer updates skipped for a non-finite grad norm over the run (resumes with a checkpoint)."""
        return self.skips.skipped_steps

    def to(self, device: str, *, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move parameters, optimizer state and/or gradients to ``device`` (``"cpu"`` or the engine device).

        Gradients live on their parameters' device, so they move with the model: ``grad=True`` without
        ``model`` is refused (assigning a host gradient to a GPU parameter failed inside torch). A backend
        without the ``offload`` capability keeps its state on the engine device: moving it elsewhere is refused.
        """
        checks.require_initialized(self._initialized, "to()")
        offload, backend = self.capabilities.offload, self.backend_name or type(self).__name__
        if checks.check_move(
            device, self.engine_config.device, model, grad, offload=offload, backend=backend
        ):
            self._to(device, model=model, optimizer=optimizer, grad=grad)

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Run the frozen base model (LoRA adapters off) inside the block."""
        checks.require_adapters(self._initialized, self.model_config)
        with self._disable_adapter():
            yield

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hugging_face_name, full tensor)`` pairs, adapters merged into the base weights."""
        checks.require_initialized(self._initialized, "export_weights()")
        yield from self._export_weights()

    def weight_buckets(
        self,
        *,
        version: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        lora: LoraMode = "merged",
        base_version: int | None = None,
    ) -> Iterator[WeightBucket]:
        """Stream the weights to a rollout engine in buckets of at most ``bucket_bytes`` (a collective).

        Every rank iterates (backends gather across their shards) and receives the same buckets. Memory stays
        bounded (one bucket and one gathered tensor, :mod:`.handoff.stream`): drop each bucket before the next.

        Args:
            version: the training step of the weights; a receiver refuses a version not newer than its own.
            bucket_bytes: the most bytes one bucket holds; a larger tensor is a bucket of its own.
            dtype: cast floating-point tensors to this dtype (``None`` keeps the training dtype).
            lora: ``merged`` (what ``export_weights`` yields: adapters folded in) or ``adapter`` (the PEFT adapter
                tensors alone, named as in ``adapter_model.safetensors``, the PEFT config in every bucket).
            base_version: the version the receiver serves (``rollout.delta_base``): only tensors whose bytes changed
                since then are sent (a delta stream, §8; gathered too with ``sharded_export``); ``None``: all.

        Raises:
            EngineStateError: not initialised, or ``lora="adapter"`` on an engine without LoRA adapters.
            ValueError: ``lora`` is neither ``merged`` nor ``adapter``; ``bucket_bytes`` is not positive."""
        checks.require_initialized(self._initialized, "weight_buckets()")
        yield from engine_weight_buckets(
            model_config=self.model_config,
            export_weights=self._export_weights,
            export_adapter_weights=self._export_adapter_weights,
            sent=self.sent_weights,
            export_weight_shards=self._export_weight_shards if self.capabilities.sharded_export else None,
            version=version,
            base_version=base_version,
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

        The step is published atomically and old steps pruned, never the one just saved (see
        :mod:`.checkpoint.orchestration`).

        Args:
            path: the checkpoint root.
            global_step: step number of the state.
            max_ckpt_to_keep: keep this many newest steps (overrides the checkpoint config).
            extra_state: JSON-serialisable caller state (data position, ...) returned by ``load_checkpoint``.

        Returns:
            The published step directory.
        """
        checks.require_initialized(self._initialized, "save_checkpoint()")
        write = self._save_checkpoint  # with save_optimizer from the checkpoint config
        return save_engine_checkpoint(self, path, global_step, max_ckpt_to_keep, extra_state, write=write)

    def load_checkpoint(
        self, path: str | Path, *, load_optimizer: bool = True, verify: bool = True
    ) -> dict[str, Any]:
        """Load a step (or a root's ``latest``): this backend's, or with ``hf_state_resume`` another backend's.

        Returns:
            ``{"global_step": N, **extra_state}`` as given to ``save_checkpoint``.

        Raises:
            CheckpointError: incomplete step, missing or corrupt file, or another backend's checkpoint.
        """
        checks.require_initialized(self._initialized, "load_checkpoint()")
        hooks = (self._load_checkpoint, self._load_hf_state if self.capabilities.hf_state_resume else None)
        return load_engine_checkpoint(self, path, *hooks, load_optimizer=load_optimizer, verify=verify)

    @property
    def token_limits(self) -> TokenLimits:
        """The vocabulary and positions every batch is checked against (the backend's ``_token_limits``)."""
        return self._token_limits()

    @property
    def checkpoint_backend_info(self) -> dict[str, Any]:
        """The backend's layout details a checkpoint manifest records (parallel sizes, formats)."""
        return self._checkpoint_backend_info()

    @property
    def input_layout(self) -> InputLayout:
        """The layout of :attr:`MicroBatch.inputs`: a packed row unless ``model.use_remove_padding`` is off."""
        return "packed" if self.model_config.use_remove_padding else "padded"
