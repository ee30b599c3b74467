"""``FSDPEngine``: core's :class:`~drivetrain_engine_core.engine.Engine` on PyTorch FSDP2 and transformers.

This file only wires the hooks of core's template methods to the modules that do the work: ``model.py``
(build), ``wrap.py`` (meshes, ``fully_shard``), ``inputs.py`` / ``outputs.py`` (packing and per-token
outputs), ``ulysses.py`` (sequence parallelism), ``optim.py``, ``offload.py``, ``checkpoint.py`` and
``export.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.data.batch import move_batch
from drivetrain_engine_core.data.options import ForwardOptions
from drivetrain_engine_core.data.values import TokenLimits
from drivetrain_engine_core.engine import Engine, Mode
from drivetrain_engine_core.outputs import LossContext, LossFn, MicroBatchResult
from tensordict import TensorDict

from . import checkpoint, offload
from .attention import register_varlen_attention
from .config import FSDPEngineConfig
from .export import export_adapter_weights, export_full_weights
from .inputs import prepare_model_inputs
from .model import build_model, hf_class_name
from .optim import build_optimizer, clip_grad_norm
from .outputs import prepare_model_outputs
from .ulysses import register_ulysses_attention
from .wrap import ParallelLayout, build_layout, shard_model


class FSDPEngine(Engine):
    """A Hugging Face model sharded with FSDP2 (``fully_shard``), optionally with Ulysses and LoRA."""

    backend_name = "fsdp"
    config_class = FSDPEngineConfig
    engine_config: FSDPEngineConfig

    # ------------------------------------------------------------------ build

    def _initialize(self) -> None:
        config = self.engine_config
        self._refuse_fp16_training()
        self._layout: ParallelLayout = build_layout(config)
        model = build_model(self.model_config, attn_implementation=self._attention_name(), seed=config.seed)
        self._hf_class = hf_class_name(model)
        self._limits = TokenLimits.from_hf_config(model.config, self.model_config.path)
        # An FSDPModule over a transformers (or PEFT) model: typed loosely, its methods are added dynamically.
        self.module: Any = shard_model(model, self._layout, config)
        self.optimizer = (
            build_optimizer(self.module, self.optimizer_config) if self.optimizer_config else None
        )
        self._params_on_cpu = False
        self._optimizer_on_cpu = False

    def _refuse_fp16_training(self) -> None:
        """Refuse to train in float16: this backend has no loss scaling, so small gradients flush to zero.

        NOTE: bf16 has float32's exponent range and needs no loss scale; fp16 would need a sharded grad
        scaler (scale the loss, unscale before the norm, an inf check agreed by every rank, the scale in
        checkpoints). Inference in float16 needs none of it and stays allowed.
        """
        if self.engine_config.param_dtype == "float16" and self.optimizer_config is not None:
            raise ConfigError(
                "engine.param_dtype='float16' cannot train with the fsdp backend: it has no loss scaling, so "
                "small fp16 gradients underflow to zero. Set engine.param_dtype='bfloat16' (same memory, "
                "float32's range, no loss scale needed), or use backend 'megatron' (dynamic loss scaling) on "
                "GPUs without bf16. float16 inference engines (optimizer_config=None) are allowed."
            )

    def _token_limits(self) -> TokenLimits:
        return self._limits

    def _attention_name(self) -> str:
        if not self.model_config.use_remove_padding or self.engine_config.attention_backend == "sdpa":
            if self.engine_config.ulysses_sequence_parallel_size > 1:
                raise ConfigError(
                    "Ulysses sequence parallelism needs packed rows with per-sequence attention: set "
                    "model.use_remove_padding=True and engine.attention_backend='varlen'."
                )
            return "sdpa"
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

    # ------------------------------------------------------------------ compute

    def _forward_backward_micro_batches(
        self,
        micro_batches: Sequence[TensorDict],
        loss_fn: LossFn | None,
        forward_only: bool,
        options: ForwardOptions,
        context: LossContext,
    ) -> list[MicroBatchResult]:
        results = []
        last = len(micro_batches) - 1
        for index, micro_batch in enumerate(micro_batches):
            if not forward_only:
                # Reduce-scatter gradients once, after the last micro-batch has accumulated into them.
                self.module.set_requires_gradient_sync(index == last)
            micro_context = dataclasses.replace(context, micro_batch_index=index)
            results.append(self._run_micro_batch(micro_batch, loss_fn, forward_only, options, micro_context))
        return results

    def _run_micro_batch(
        self,
        micro_batch: TensorDict,
        loss_fn: LossFn | None,
        forward_only: bool,
        options: ForwardOptions,
        context: LossContext,
    ) -> MicroBatchResult:
        micro_batch = move_batch(micro_batch, self.engine_config.device)
        layout = self._layout
        inputs = prepare_model_inputs(
            micro_batch,
            use_remove_padding=self.model_config.use_remove_padding,
            sp_group=layout.sp_group,
            sp_rank=layout.sp_rank,
            sp_size=layout.sp_size,
        )
        logits = self.module(**inputs.kwargs).logits
        model_output = prepare_model_outputs(
            logits,
            inputs,
            model_type=self.model_config.model_type,
            options=options,
            chunk_size=self.engine_config.entropy_chunk_size,
        )
        loss: torch.Tensor | None = None
        metrics: dict[str, float] = {}
        if loss_fn is not None:
            to_backward, loss, metrics = self.compute_micro_batch_loss(
                loss_fn, model_output, micro_batch, context
            )
            if not forward_only:
                # FSDP averages gradients over all dp * sp ranks while SP ranks share one loss (see ulysses.py).
                (to_backward * layout.sp_size).backward()
        outputs = model_output.detach() if self.is_output_rank else None
        return MicroBatchResult(outputs=outputs, loss=loss, metrics=metrics)

    def _set_mode(self, mode: Mode) -> None:
        self.module.train(mode == "train")

    # ------------------------------------------------------------------ optimizer

    def _optimizer_param_groups(self) -> Sequence[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    def _optimizer_zero_grad(self) -> None:
        assert self.optimizer is not None  # core calls optimizer hooks only when an optimizer is configured
        self.optimizer.zero_grad(set_to_none=True)

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
        self.optimizer.step()

    # ------------------------------------------------------------------ placement

    @property
    def _home_device(self) -> str:
        """Where parameters and optimizer state live during compute (CPU under FSDP2's CPU offload policy)."""
        return "cpu" if self.engine_config.cpu_offload_policy else self.engine_config.device

    def _load(self, *, params: bool, optimizer: bool) -> None:
        if params and self._params_on_cpu:
            offload.move_parameters(self.module, self._home_device)
            self._params_on_cpu = False
        if optimizer and self._optimizer_on_cpu and self.optimizer is not None:
            offload.move_optimizer_state(self.optimizer, self._home_device)
            self._optimizer_on_cpu = False

    def _offload(self, params: bool, optimizer: bool) -> None:
        if params and not self._params_on_cpu:
            offload.move_parameters(self.module, "cpu")
            self._params_on_cpu = True
        if optimizer and not self._optimizer_on_cpu and self.optimizer is not None:
            offload.move_optimizer_state(self.optimizer, "cpu")
            self._optimizer_on_cpu = True

    def _to(self, device: str, *, model: bool, optimizer: bool, grad: bool) -> None:
        on_cpu = device == "cpu" and self._home_device != "cpu"
        if model:
            offload.move_parameters(self.module, device)
            self._params_on_cpu = on_cpu
        elif grad:
            offload.move_gradients(self.module, device)
        if optimizer and self.optimizer is not None:
            offload.move_optimizer_state(self.optimizer, device)
            self._optimizer_on_cpu = on_cpu

    # ------------------------------------------------------------------ adapters and export

    def _disable_adapter(self) -> Any:
        return self.module.disable_adapter()

    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_full_weights(self.module, self.model_config.lora)

    def _export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_adapter_weights(self.module)

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        checkpoint.save_state(self.module, self.optimizer if save_optimizer else None, step_dir)

    def _load_checkpoint(self, step_dir: Path, *, load_optimizer: bool) -> None:
        checkpoint.load_state(self.module, self.optimizer if load_optimizer else None, step_dir)

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
