"""``MegatronEngine``: the core ``Engine`` on megatron-core's ``GPTModel`` (TP, PP, VPP, DP), built via mbridge.

The engine implements the core's ``_`` hooks only; micro-batching, the micro-batch round trip, the LR schedule
and the checkpoint layout come from the base class. Gradients are **summed** over data-parallel ranks
(megatron DDP with ``calculate_per_token_loss``), so ``gradient_divisor`` is 1 and core does not rescale the
loss: each rank backwards its share of the globally normalised loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from drivetrain_engine_core.backend import (
    DTYPES,
    BackendCapabilities,
    ConfigError,
    Engine,
    EngineStateError,
    MicroBatch,
    MicroBatchCountRule,
    MicroBatchResult,
    Mode,
    RowPadding,
    ShardedWeight,
    TokenLimits,
)
from drivetrain_engine_core.kit import HFTrainingState, RouterLoss, flash_kernel_missing, read_manifest

from . import parallel_state
from .config import MegatronEngineConfig
from .cpu_compat import apply_cpu_compat, cpu_compat_needed, seed_cpu_rng_tracker

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    from .model import BuiltModel
    from .replay import MegatronRouterReplay
    from .router_loss import RouterLogits


class MegatronEngine(Engine):
    """Megatron-Core backend: tensor, pipeline (and virtual pipeline) and data parallelism.

    Args:
        model_config: the Hugging Face model to build (``language_model`` or ``value_model``).
        engine_config: a :class:`MegatronEngineConfig`.
        optimizer_config: AdamW settings; ``None`` builds an inference-only engine (no DDP wrapping).
        checkpoint_config: checkpoint contents and retention.
    """

    backend_name: ClassVar[str] = "megatron"
    config_class: ClassVar[type[MegatronEngineConfig]] = MegatronEngineConfig
    # No offload and no LoRA yet; fp16 trains with megatron's dynamic loss scaling.
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        value_model=True,
        padded_inputs=True,
        sequence_parallel=True,
        hf_state_resume=True,
        sharded_export=True,
        router_replay=True,
        param_dtypes=frozenset(DTYPES),
        train_dtypes=frozenset(DTYPES),
    )

    engine_config: MegatronEngineConfig
    _model: BuiltModel
    _optimizer: MegatronOptimizer | None
    _router: RouterLoss | None
    _router_logits: RouterLogits | None
    _replay: MegatronRouterReplay

    # ------------------------------------------------------------------ lifecycle

    def _initialize(self) -> None:
        self._refuse_unsupported()
        if cpu_compat_needed(self.engine_config.device):
            apply_cpu_compat()
        parallel_state.initialize_model_parallel(self.engine_config)
        self._seed()
        from .model import build_model

        self._model = build_model(
            self.model_config, self.engine_config, trainable=self.optimizer_config is not None
        )
        self._router_logits, self._router = self._router_balance()
        from .replay import MegatronRouterReplay

        self._replay = MegatronRouterReplay(self._model.unwrapped, self.engine_config.sequence_parallel)
        self._optimizer = None
        if self.optimizer_config is not None:
            from .optim import build_optimizer

            self._optimizer = build_optimizer(self.optimizer_config, self.engine_config, self._model.chunks)
            self._install_grad_finalizer()
            # NOTE: as megatron's own training loop does: the schedule multiplies the loss by the optimizer's
            # loss scale before backward (1 for fp32/bf16, the dynamic scale for fp16), and the optimizer
            # divides the gradients by it before the norm. Without it fp16 gradients come out divided by 2^32.
            self._model.transformer_config.grad_scale_func = self._optimizer.scale_loss

    def _router_balance(self) -> tuple[RouterLogits | None, RouterLoss | None]:
        """The routers' logit recorder and the balance loss of a mixture-of-experts language model."""
        from .router_loss import RouterLogits, router_loss_settings

        router = router_loss_settings(
            self.engine_config,
            self._model.bridge.hf_config,
            self.model_config.model_type,
            self.model_config.gradient_checkpointing,
        )
        return (None, None) if router is None else (RouterLogits(self._model.unwrapped), router)

    def _hf_config(self) -> Any:
        return self._model.bridge.hf_config

    def _sequence_split(self) -> RowPadding | None:
        """Under sequence parallelism the whole row, padded to a multiple of the TP size: megatron's embedding
        reduce-scatters it along the tokens (an uneven row fails its divisibility check) and the heads gather
        it back (:func:`.head.hidden_states_out`, :class:`.value_head.ValueHead`)."""
        if not self.engine_config.sequence_parallel:
            return None
        return RowPadding(self.engine_config.tensor_model_parallel_size)

    def _token_limits(self) -> TokenLimits:
        # The tokenizer's vocabulary, not the padded one: ids in the padding rows would train with loss inf.
        limits = TokenLimits.from_hf_config(self._model.bridge.hf_config, self.model_config.path)
        return dataclasses.replace(limits, vocab_size=self._model.vocab_size)

    def _refuse_unsupported(self) -> None:
        """Refuse, before any group or model exists, what this backend cannot run here."""
        config = self.engine_config
        if self.model_config.use_remove_padding and flash_kernel_missing(config.device, config.param_dtype):
            raise ConfigError(
                f"packed rows in {config.param_dtype} attend through torch's flash kernel, which needs compute "
                "capability 8.0 (Ampere) or newer; this GPU is older. Set model.use_remove_padding=False (padded "
                "rows, SDPA with a mask), or engine.param_dtype='float32'."
            )
        if config.sequence_parallel and not self.model_config.use_remove_padding:
            raise ConfigError(
                "engine.sequence_parallel=True splits packed rows along the tokens; set "
                "model.use_remove_padding=True (packed rows), or sequence_parallel=False for padded rows."
            )
        if config.context_parallel_size > 1:
            raise ConfigError(
                f"engine.context_parallel_size={config.context_parallel_size} needs Transformer Engine attention, "
                "which drivetrain's layer spec does not build (its SDPA attention has no context-parallel path); "
                "set context_parallel_size=1 (long sequences: sequence_parallel=True with TP, or FSDP's Ulysses)."
            )

    def _seed(self) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel

        torch.manual_seed(self.engine_config.seed)
        if cpu_compat_needed(self.engine_config.device):
            seed_cpu_rng_tracker(self.engine_config.seed, mpu.get_tensor_model_parallel_rank())
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(self.engine_config.seed)

    def _install_grad_finalizer(self) -> None:
        """Make the schedule sum gradients (DP, tied embeddings) without rescaling them by a token count.

        NOTE: this is what makes ``gradient_divisor`` 1. With ``calculate_per_token_loss`` megatron divides the
        reduced gradients by the ``num_tokens`` the loss steps return; drivetrain's losses are already
        normalised by the global token count, so that division is switched off here.
        """
        from megatron.core.distributed import finalize_model_grads

        config = self._model.transformer_config
        config.finalize_model_grads_func = partial(_finalize_without_token_scaling, finalize_model_grads)
        no_sync = [chunk.no_sync for chunk in self._model.chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    # ------------------------------------------------------------------ parallel layout

    @property
    def data_parallel_rank(self) -> int:
        return parallel_state.data_parallel_rank()

    @property
    def data_parallel_size(self) -> int:
        return parallel_state.data_parallel_size()

    @property
    def data_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        return parallel_state.data_parallel_group()

    @property
    def is_output_rank(self) -> bool:
        return parallel_state.is_output_rank()

    @property
    def gradient_divisor(self) -> int:
        """1: megatron's DDP sums gradients over data-parallel ranks (see ``_install_grad_finalizer``)."""
        return 1

    @property
    def micro_batch_count_rule(self) -> MicroBatchCountRule:
        """The interleaved schedule (VPP) runs whole groups of ``pipeline_model_parallel_size`` micro-batches."""
        if self.engine_config.virtual_pipeline_model_parallel_size is None:
            return MicroBatchCountRule()
        pp = self.engine_config.pipeline_model_parallel_size
        return MicroBatchCountRule(minimum=pp, multiple_of=pp)

    # ------------------------------------------------------------------ compute

    def _forward_backward_micro_batches(
        self, micro_batches: Sequence[MicroBatch], forward_only: bool
    ) -> list[MicroBatchResult]:
        from .schedule import StepSpec, run_schedule

        spec = StepSpec(
            value_model=self.model_config.model_type == "value_model",
            vocab_size=self._model.vocab_size,
            chunk_size=self.engine_config.entropy_chunk_size,
            router=self._router,
            router_logits=self._router_logits,
            replay=self._replay,
        )
        return run_schedule(self._model.chunks, micro_batches, forward_only, spec)

    def _set_mode(self, mode: Mode) -> None:
        for chunk in self._model.chunks:
            chunk.train(mode == "train")

    # ------------------------------------------------------------------ optimizer

    def _optimizer_param_groups(self) -> Sequence[dict[str, Any]]:
        return self._built_optimizer().param_groups

    def _optimizer_zero_grad(self) -> None:
        from .optim import zero_grad

        for chunk in self._ddp_chunks():
            chunk.zero_grad_buffer()
        zero_grad(self._built_optimizer())

    def _clip_grad_norm(self, max_norm: float | None) -> float:
        from .optim import clip_grad_norm

        return clip_grad_norm(self._built_optimizer(), max_norm)

    def _optimizer_step(self) -> None:
        from .optim import step

        step(self._built_optimizer())

    def _built_optimizer(self) -> MegatronOptimizer:
        """The optimizer; the core calls optimizer hooks only on engines built with an ``optimizer_config``."""
        if self._optimizer is None:
            raise EngineStateError(
                "this megatron engine has no optimizer (optimizer_config=None); build it with an "
                "optimizer_config to train."
            )
        return self._optimizer

    def _ddp_chunks(self) -> list[DistributedDataParallel]:
        """The DDP-wrapped chunks, which own the gradient buffers (chunks are wrapped when the engine trains)."""
        from megatron.core.distributed import DistributedDataParallel

        chunks = [chunk for chunk in self._model.chunks if isinstance(chunk, DistributedDataParallel)]
        if len(chunks) != len(self._model.chunks):
            raise EngineStateError(
                "the megatron model chunks are not DDP-wrapped (inference-only engine); build the engine with "
                "an optimizer_config to train."
            )
        return chunks

    # ------------------------------------------------------------------ export

    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from .export import export_hf_weights

        yield from export_hf_weights(self._model.bridge, self._model.unwrapped)

    def _export_weight_shards(self) -> Iterator[ShardedWeight]:
        from .export import export_weight_shards

        yield from export_weight_shards(self._model.bridge, self._model.unwrapped)

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        from .checkpoint import save_model_and_optimizer

        save_model_and_optimizer(step_dir, self._model, self._optimizer if save_optimizer else None)

    def _load_checkpoint(self, step_dir: Path, *, load_optimizer: bool) -> None:
        from .checkpoint import load_model_and_optimizer, optimizer_layout_changed

        if (
            load_optimizer
            and self._optimizer is not None
            and optimizer_layout_changed(step_dir, self.engine_config)
        ):
            # Another TP/PP layout or optimizer kind: the moments move through their Hugging Face names, as
            # another backend's do.
            from .merger import MegatronCheckpointMerger

            state = HFTrainingState(MegatronCheckpointMerger(step_dir, read_manifest(step_dir)))
            self._load_hf_state(state, load_optimizer=True)
            return
        load_model_and_optimizer(step_dir, self._model, self._optimizer, load_optimizer=load_optimizer)

    def _load_hf_state(self, state: HFTrainingState, *, load_optimizer: bool) -> None:
        from .hf_state import load_hf_state

        optimizer = self._optimizer if load_optimizer else None
        load_hf_state(self._model, optimizer, state, model_path=self.model_config.path)
        if optimizer is None and self._optimizer is not None:
            self._optimizer.reload_model_params()

    def _checkpoint_backend_info(self) -> dict[str, Any]:
        from .checkpoint import backend_info

        return backend_info(self._model, self.engine_config)


def _finalize_without_token_scaling(
    finalize: Any, model: list[torch.nn.Module], *args: Any, **kwargs: Any
) -> None:
    """megatron's ``finalize_model_grads`` with ``num_tokens=None``: drivetrain's loss is already normalised."""
    kwargs.pop("num_tokens", None)
    finalize(model, None, *args[1:], **kwargs)
