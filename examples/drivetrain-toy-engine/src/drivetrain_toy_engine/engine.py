"""``ToyEngine``: the smallest correct drivetrain engine, a plain Hugging Face causal LM in one process.

It shows what a backend must provide: the core ``Engine`` owns the checks, micro-batching, the micro-batch
round trip (layout, labels, outputs back to tokens, loss scaling), LR schedule and checkpoint layout; the
backend implements only the required ``_`` hooks below and imports only ``drivetrain_engine_core.backend``.
Its one optional capability is padded rows; it declares no offload, LoRA, value head or low-precision compute,
so core refuses those options before it builds anything, and it has no hooks for them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import (
    BackendCapabilities,
    ConfigError,
    Engine,
    MicroBatch,
    MicroBatchResult,
    Mode,
    PaddedRows,
    TokenLimits,
)
from drivetrain_engine_core.kit import disable_dropout_in_config, disable_dropout_modules, distributed
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from .config import ToyEngineConfig

MODEL_FILE = "model/model.safetensors"
OPTIMIZER_FILE = "optimizer/optimizer.pt"


class ToyEngine(Engine):
    """A single-process engine over ``AutoModelForCausalLM`` (see the module docstring)."""

    backend_name = "toy"
    config_class = ToyEngineConfig
    capabilities = BackendCapabilities(padded_inputs=True)  # float32 only, no offload, LoRA or value head

    # ------------------------------------------------------------------ parallel layout: one process
    data_parallel_rank = 0
    data_parallel_size = 1
    data_parallel_group = None
    is_output_rank = True
    gradient_divisor = 1  # one process: nothing averages the gradients

    # ------------------------------------------------------------------ build
    def _token_limits(self) -> TokenLimits:
        return self._limits

    def _hf_config(self) -> Any:
        """The transformers config core counts FLOPs from (the ``perf/*`` step metrics)."""
        return self.model.config

    def _initialize(self) -> None:
        if distributed.world_size() > 1:
            raise ConfigError("the toy backend runs one process; use the fsdp backend for more.")
        torch.manual_seed(self.engine_config.seed)
        hf_config = AutoConfig.from_pretrained(self.model_config.path)
        if self.model_config.disable_dropout:
            disable_dropout_in_config(hf_config)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_config.path, config=hf_config, dtype=torch.float32
        )
        if self.model_config.disable_dropout:
            disable_dropout_modules(self.model)
        self.model.to(self.engine_config.device)
        self._limits = TokenLimits.from_hf_config(self.model.config, self.model_config.path)
        if self.model_config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.optimizer = None
        if self.optimizer_config is not None:
            config = self.optimizer_config
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=config.lr,
                betas=config.betas,
                eps=config.eps,
                weight_decay=config.weight_decay,
            )

    # ------------------------------------------------------------------ compute
    def _forward_backward_micro_batches(
        self, micro_batches: Sequence[MicroBatch], forward_only: bool
    ) -> list[MicroBatchResult]:
        results = []
        for micro_batch in micro_batches:
            loss, result = micro_batch.finish(self._token_fields(micro_batch))
            if not forward_only:
                loss.backward()
            results.append(result)
        return results

    def _token_fields(self, micro_batch: MicroBatch) -> dict[str, torch.Tensor]:
        """Per-position log-probs (and entropy) of core's layout: one packed row, or right-padded rows."""
        inputs = micro_batch.inputs
        mask = {"attention_mask": inputs.valid.long()} if isinstance(inputs, PaddedRows) else {}
        # use_cache=False: with a cache transformers does not detect the packed sequences.
        logits = self.model(
            input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False, **mask
        ).logits
        options = micro_batch.options
        log_softmax = torch.log_softmax(micro_batch.rows(logits).float() / options.temperature, dim=-1)
        fields = {"log_probs": log_softmax.gather(-1, micro_batch.labels[:, None]).squeeze(-1)}
        if options.compute_entropy:
            fields["entropy"] = -(log_softmax.exp() * log_softmax).sum(-1)
        return fields

    def _set_mode(self, mode: Mode) -> None:
        self.model.train(mode == "train")

    # ------------------------------------------------------------------ optimizer
    def _optimizer_param_groups(self) -> Sequence[dict[str, Any]]:
        return self.optimizer.param_groups

    def _optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _clip_grad_norm(self, max_norm: float | None) -> float:
        limit = float("inf") if max_norm is None else max_norm
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit))

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    # ------------------------------------------------------------------ weights and checkpoints
    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().cpu().clone()

    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        (step_dir / MODEL_FILE).parent.mkdir(parents=True, exist_ok=True)
        save_file(dict(self._export_weights()), step_dir / MODEL_FILE)
        if save_optimizer and self.optimizer is not None:
            (step_dir / OPTIMIZER_FILE).parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.optimizer.state_dict(), step_dir / OPTIMIZER_FILE)

    def _load_checkpoint(self, step_dir: Path, *, load_optimizer: bool) -> None:
        self.model.load_state_dict(load_file(step_dir / MODEL_FILE, device=self.engine_config.device))
        if load_optimizer:
            state = torch.load(
                step_dir / OPTIMIZER_FILE, weights_only=True, map_location=self.engine_config.device
            )
            self.optimizer.load_state_dict(state)
