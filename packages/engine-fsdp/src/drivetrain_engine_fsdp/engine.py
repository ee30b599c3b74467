"""``FSDPEngine``: core's :class:`~drivetrain_engine_core.backend.Engine` on PyTorch FSDP2 and transformers.

This file only wires the hooks of core's template methods to the modules that do the work: ``model.py``,
``meta_build.py``, ``hf_weights.py`` and ``materialize.py`` (build and load), ``wrap.py`` (meshes,
``fully_shard``), ``inputs.py`` / ``outputs.py`` (forward arguments of core's micro-batch layout,
per-position log-probs and values), ``head.py`` (log-probs from hidden states without full logits, with
core's ``linear_log_probs``), ``ulysses.py`` (sequence parallelism), ``optim.py``, ``placement.py`` and
``offload.py`` (offload), ``checkpoint.py`` and ``export.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import (
    DTYPES,
    BackendCapabilities,
    ConfigError,
    Engine,
    MicroBatch,
    MicroBatchResult,
    Mode,
    ShardedWeight,
    TokenLimits,
)
from drivetrain_engine_core.kit import HFTrainingState
from torch.distributed.fsdp import FSDPModule

from . import checkpoint
from .attention import (
    check_flash_support,
    check_soft_capping,
    register_varlen_attention,
    warn_compiled_per_sequence_attention,
)
from .config import FSDPEngineConfig
from .export import export_adapter_weights, export_full_weights, export_weight_shards
from .head import hidden_states_out, projection_head
from .inputs import model_kwargs
from .materialize import materialize
from .meta_build import MetaModel, build_meta_model
from .model import build_model, hf_class_name
from .optim import build_optimizer, clip_grad_norm
from .outputs import token_fields
from .placement import Placement
from .replay import RouterReplay
from .router_loss import router_kwargs, router_settings
from .ulysses import UlyssesSplit, register_ulysses_attention
from .wrap import ParallelLayout, build_layout, shard_model


class FSDPEngine(Engine):
    """A Hugging Face model sharded with FSDP2 (``fully_shard``), optionally with Ulysses and LoRA."""

    backend_name = "fsdp"
    config_class = FSDPEngineConfig
    # NOTE: no float16 training: this backend has no loss scaling, so small fp16 gradients underflow to zero.
    # bf16 has float32's exponent range and needs no loss scale; fp16 would need a sharded grad scaler (scale
    # the loss, unscale before the norm, an inf check agreed by every rank, the scale in checkpoints).
    # Inference in float16 needs none of it and stays allowed.
    capabilities = BackendCapabilities(
        offload=True,
        lora=True,
        value_model=True,
        padded_inputs=True,
        sequence_parallel=True,
        hf_state_resume=True,
        sharded_export=True,
        router_replay=True,
        param_dtypes=frozenset(DTYPES),
        train_dtypes=frozenset({"float32", "bfloat16"}),
    )
    engine_config: FSDPEngineConfig

    # ------------------------------------------------------------------ build

    def _initialize(self) -> None:
        config = self.engine_config
        self._layout: ParallelLayout = build_layout(config)
        model, meta_model = self._build_model()
        check_soft_capping(model.config, config.attention_backend)
        self._hf_class = hf_class_name(model)
        self._hf_model_config = model.config
        self._limits = TokenLimits.from_hf_config(model.config, self.model_config.path)
        self._head = projection_head(model, self.model_config.model_type)
        self._router = router_settings(
            config, model.config, self.model_config.model_type, self._layout.sp_size
        )
        self._replay = RouterReplay(model, self._layout.sp_size)
        # An FSDPModule over a transformers (or PEFT) model: typed loosely, its methods are added dynamically.
        self.module: Any = shard_model(model, self._layout, config)
        if meta_model is not None:
            materialize(self.module, meta_model, self._home_device)
        self.optimizer = (
            build_optimizer(self.module, self.optimizer_config) if self.optimizer_config else None
        )
        self.placement = Placement(self.module, self.optimizer, config.device, self._home_device)

    def _token_limits(self) -> TokenLimits:
        return self._limits

    def _hf_config(self) -> Any:
        return self._hf_model_config

    def _build_model(self) -> tuple[Any, MetaModel | None]:
        """The model to shard, with what fills it after sharding when it was built on ``meta``."""
        config, attention = self.engine_config, self._attention_name()
        if config.meta_init and not self.model_config.from_config_only:
            meta_model = build_meta_model(self.model_config, attn_implementation=attention, seed=config.seed)
            return meta_model.module, meta_model
        # NOTE: fresh weights (from_config_only) take the full path: their seeded values depend on drawing the
        # whole model in order, which only a full CPU copy reproduces.
        return build_model(self.model_config, attn_implementation=attention, seed=config.seed), None

    def _attention_name(self) -> str:
        """The transformers attention implementation the model is built with (see ``attention_backend``)."""
        backend = self.engine_config.attention_backend
        if not self.model_config.use_remove_padding or backend != "varlen":
            if self.engine_config.ulysses_sequence_parallel_size > 1:
                raise ConfigError(
                    "Ulysses sequence parallelism needs packed rows with per-sequence attention: set "
                    "model.use_remove_padding=True and engine.attention_backend='varlen'."
                )
            return "eager" if backend == "eager" else "sdpa"
        config = self.engine_config
        check_flash_support(config.device, config.param_dtype)
        warn_compiled_per_sequence_attention(config.compile_layers, config.device, config.param_dtype)
        if self._layout.sp_group is not None:
            return register_ulysses_attention(self._layout.sp_group)
        return register_varlen_attention()

    # ------------------------------------------------------------------ layout

    @property
    def data_parallel_rank(self) -> int:
        return self._layout.dp_rank

    @property
    def data_parallel_size(self) -> int:
        return self._layout.dp_size

    @property
    def data_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        return self._layout.dp_group

    @property
    def is_output_rank(self) -> bool:
        return self._layout.sp_rank == 0

    @property
    def gradient_divisor(self) -> int:
        """FSDP averages gradients over its whole mesh: every data-parallel and Ulysses rank."""
        return self._layout.dp_size * self._layout.sp_size

    def _sequence_split(self) -> UlyssesSplit | None:
        layout = self._layout
        if layout.sp_group is None:
            return None
        return UlyssesSplit(group=layout.sp_group, rank=layout.sp_rank, size=layout.sp_size)

    # ------------------------------------------------------------------ compute

    def _forward_backward_micro_batches(
        self, micro_batches: Sequence[MicroBatch], forward_only: bool
    ) -> list[MicroBatchResult]:
        results = []
        self.placement.grads_pending = self.placement.grads_pending or not forward_only
        for index, micro_batch in enumerate(micro_batches):
            if not forward_only:
                self._sync_gradients_after(last=index == len(micro_batches) - 1)
            with self._replay.around(micro_batch):  # open through backward: checkpointing reruns routers
                results.append(self._forward_backward_one(micro_batch, forward_only))
        if forward_only:
            self._reshard()
        return results

    def _forward_backward_one(self, micro_batch: MicroBatch, forward_only: bool) -> MicroBatchResult:
        """One micro-batch's forward, its loss with the router balance term, and its backward."""
        router = self._router if self._router is not None and self._router.applies(micro_batch) else None
        with hidden_states_out(self._head):
            model_output = self.module(**model_kwargs(micro_batch), **router_kwargs(router))
        fields = token_fields(
            model_output.logits,
            micro_batch,
            model_type=self.model_config.model_type,
            chunk_size=self.engine_config.entropy_chunk_size,
            # NOTE: read after the forward: FSDP's root has gathered it (and keeps it for backward).
            head_weight=self._head.weight if self._head is not None else None,
            kernel=self.engine_config.log_prob_kernel,
        )
        loss, result = micro_batch.finish(fields)
        if router is not None:
            loss, result = router.add(loss, result, model_output.router_logits, micro_batch)
        if not forward_only:
            loss.backward()
        return result

    def _reshard(self) -> None:
        """Free every gathered parameter after a forward-only pass.

        NOTE: FSDP2 reshards the root (kept gathered for backward, see ``wrap.shard_model``) only in backward: a
        forward-only pass left the embeddings, final norm and head gathered (an inference-only engine held them
        for good), and ``parameters()`` then gave plain tensors, not the sharded DTensors: gradient clipping
        after it missed their gradients and the next step's forward used the weights from before the step.
        """
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _sync_gradients_after(self, *, last: bool) -> None:
        """Whether the next backward reduces its gradients (see ``defer_gradient_sync``).

        By default each micro-batch's backward reduce-scatters, so gradients stay sharded between micro-batches
        (deferring kept a full-size copy on every rank: 28 GB for a 7B model in float32); only the all-reduce
        across hybrid-sharding replicas waits for the last one.
        """
        if self.engine_config.defer_gradient_sync:
            self.module.set_requires_gradient_sync(last)
        elif self._layout.fsdp_mesh.ndim == 2:
            self.module.set_requires_all_reduce(last)

    def _set_mode(self, mode: Mode) -> None:
        self.module.train(mode == "train")

    # ------------------------------------------------------------------ optimizer

    def _optimizer_param_groups(self) -> Sequence[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    def _optimizer_zero_grad(self) -> None:
        assert self.optimizer is not None  # core calls optimizer hooks only when an optimizer is configured
        self.optimizer.zero_grad(set_to_none=True)
        self.placement.grads_pending = False

    def _clip_grad_norm(self, max_norm: float | None) -> float:
        if self.engine_config.cpu_offload_policy and self.engine_config.device == "cuda":
            # NOTE: under CPUOffloadPolicy FSDP2 copies each reduced gradient to pinned host memory with a
            # non-blocking copy on its post-reduce stream. Some torch releases (2.11 among them) record the
            # event the CPU waits on before the optimizer on the reduce-scatter stream instead, so the last
            # copies of a step (a layer's norm weights come last) can still be in flight when the norm is
            # read on the host: the grad norm came out 1.05e-4 low on an H100. Waiting for the device here
            # makes every host gradient complete; the cost is one sync per step, on a path that already
            # moves every gradient to the host.
            torch.cuda.synchronize()
        return clip_grad_norm(self.module, max_norm)

    def _optimizer_step(self) -> None:
        assert self.optimizer is not None  # as in _optimizer_zero_grad
        self.placement.await_optimizer_state()
        self.optimizer.step()
        self.placement.grads_pending = False

    # ------------------------------------------------------------------ placement

    @property
    def _home_device(self) -> str:
        """Where parameters and optimizer state live during compute (CPU under FSDP2's CPU offload policy)."""
        return "cpu" if self.engine_config.cpu_offload_policy else self.engine_config.device

    def _load_to_device(self, *, params: bool, optimizer: bool) -> None:
        self.placement.load(params=params, optimizer=optimizer)

    def _offload_to_host(self, params: bool, optimizer: bool) -> None:
        self.placement.offload(params=params, optimizer=optimizer)

    @property
    def transfer_metrics(self) -> dict[str, float]:
        """Seconds and bytes of the last load (entering a mode) and the last offload (leaving it).

        ``perf/load_s``, ``perf/load_bytes``, ``perf/offload_s``, ``perf/offload_bytes``; zeros before the first
        move. Each time ends with waiting for the compute stream; on CUDA the optimizer state's load runs on a
        side stream during the forward and backward, so ``perf/load_s`` counts only issuing it (its bytes
        count in ``perf/load_bytes``).
        """
        return self.placement.transfer_metrics

    def _to(self, device: str, *, model: bool, optimizer: bool, grad: bool) -> None:
        self.placement.to(device, model=model, optimizer=optimizer, grad=grad)

    # ------------------------------------------------------------------ adapters and export

    def _disable_adapter(self) -> Any:
        return self.module.disable_adapter()

    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_full_weights(self.module, self.model_config.lora)

    def _export_weight_shards(self) -> Iterator[ShardedWeight]:
        return export_weight_shards(self.module, self.model_config.lora)

    def _export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_adapter_weights(self.module)

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        self.placement.await_optimizer_state()
        checkpoint.save_state(self.module, self.optimizer if save_optimizer else None, step_dir)

    def _load_checkpoint(self, step_dir: Path, *, load_optimizer: bool) -> None:
        self.placement.await_optimizer_state()
        checkpoint.load_state(self.module, self.optimizer if load_optimizer else None, step_dir)

    def _load_hf_state(self, state: HFTrainingState, *, load_optimizer: bool) -> None:
        checkpoint.load_hf_state(
            self.module,
            self.optimizer if load_optimizer else None,
            state,
            tie_word_embeddings=bool(getattr(self._hf_model_config, "tie_word_embeddings", False)),
        )

    def _checkpoint_backend_info(self) -> dict[str, Any]:
        world = torch.distributed.get_world_size()
        return {
            "state_dict_format": "dcp",
            "model_keys": "get_model_state_dict",
            "hf_class": self._hf_class,
            "peft": self.model_config.lora is not None,
            "fsdp_size": self.engine_config.resolved_fsdp_size(world),
            "ulysses_sequence_parallel_size": self._layout.sp_size,
            "param_dtype": self.engine_config.param_dtype,
        }
