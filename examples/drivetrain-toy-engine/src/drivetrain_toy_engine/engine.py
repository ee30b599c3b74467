"""``ToyEngine``: the smallest correct drivetrain engine, a plain Hugging Face causal LM in one process.

It shows what a backend must provide: the core ``Engine`` owns the checks, micro-batching, loss scaling, LR
schedule and checkpoint layout; the backend implements only the ``_`` hooks below. No sharding, no offload
(the model stays on the engine device), no LoRA.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core import distributed
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.data.batch import INPUT_IDS
from drivetrain_engine_core.data.options import ForwardOptions
from drivetrain_engine_core.data.packing import (
    next_token_labels,
    pack_micro_batch,
    shift_right_per_sequence,
    unpack_to_jagged,
)
from drivetrain_engine_core.data.padding import nopad_to_padded
from drivetrain_engine_core.data.values import TokenLimits
from drivetrain_engine_core.engine import Engine, Mode
from drivetrain_engine_core.outputs import LossContext, LossFn, MicroBatchResult
from safetensors.torch import load_file, save_file
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from .config import ToyEngineConfig

MODEL_FILE = "model/model.safetensors"
OPTIMIZER_FILE = "optimizer/optimizer.pt"


class ToyEngine(Engine):
    """A single-process engine over ``AutoModelForCausalLM`` (see the module docstring)."""

    backend_name = "toy"
    config_class = ToyEngineConfig

    # ------------------------------------------------------------------ parallel layout: one process
    data_parallel_rank = 0
    data_parallel_size = 1
    data_parallel_group = None
    is_output_rank = True

    # ------------------------------------------------------------------ build
    def _token_limits(self) -> TokenLimits:
        return self._limits

    def _initialize(self) -> None:
        if distributed.world_size() > 1 or self.model_config.lora is not None:
            raise ConfigError("the toy backend runs one process without LoRA; use the fsdp backend for more.")
        torch.manual_seed(self.engine_config.seed)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_config.path, dtype=torch.float32)
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
        self,
        micro_batches: Sequence[TensorDict],
        loss_fn: LossFn | None,
        forward_only: bool,
        options: ForwardOptions,
        context: LossContext,
    ) -> list[MicroBatchResult]:
        results = []
        for index, micro_batch in enumerate(micro_batches):
            micro_batch = micro_batch.to(self.engine_config.device)
            outputs = self._forward(micro_batch, options)
            result = MicroBatchResult(outputs=outputs.detach())
            if loss_fn is not None:
                step_context = dataclasses.replace(context, micro_batch_index=index)
                to_backward, result.loss, result.metrics = self.compute_micro_batch_loss(
                    loss_fn, outputs, micro_batch, step_context
                )
                if not forward_only:
                    to_backward.backward()
            results.append(result)
        return results

    def _forward(self, micro_batch: TensorDict, options: ForwardOptions) -> TensorDict:
        """Per-token log-probs (and entropy) of one micro-batch, aligned as in docs §7.1."""
        offsets = micro_batch[INPUT_IDS].offsets()
        logits = self._flat_logits(micro_batch).float() / options.temperature
        log_softmax = torch.log_softmax(logits, dim=-1)
        labels = next_token_labels(micro_batch[INPUT_IDS].values(), offsets)
        log_probs = log_softmax.gather(-1, labels[:, None]).squeeze(-1)
        fields = {"log_probs": unpack_to_jagged(shift_right_per_sequence(log_probs, offsets), offsets)}
        if options.compute_entropy:
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
            fields["entropy"] = unpack_to_jagged(shift_right_per_sequence(entropy, offsets), offsets)
        return TensorDict(fields, batch_size=micro_batch.batch_size)

    def _flat_logits(self, micro_batch: TensorDict) -> torch.Tensor:
        """Logits ``(total_tokens, vocab)``: from one packed row, or from a right-padded batch."""
        if self.model_config.use_remove_padding:
            row = pack_micro_batch(micro_batch)
            # use_cache=False: with a cache transformers does not detect the packed sequences.
            return self.model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).logits[
                0
            ]
        no_prompts = torch.zeros(len(micro_batch), dtype=torch.int64)
        padded = nopad_to_padded(micro_batch, prompt_lengths=no_prompts)
        mask = padded["attention_mask"]
        logits = self.model(
            input_ids=padded[INPUT_IDS],
            attention_mask=mask,
            position_ids=padded["position_ids"],
            use_cache=False,
        ).logits
        return logits[mask.bool()]

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

    # ------------------------------------------------------------------ placement (nothing is offloaded)
    def _load(self, *, params: bool, optimizer: bool) -> None:
        """Nothing to load: the toy engine never offloads."""

    def _offload(self, params: bool, optimizer: bool) -> None:
        """Offload is not supported; parameters and optimizer state stay on the engine device."""

    def _to(self, device: str, *, model: bool, optimizer: bool, grad: bool) -> None:
        if model or grad:
            self.model.to(device)  # Module.to moves parameters together with their gradients
        if optimizer and self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device)

    def _disable_adapter(self) -> Any:
        return contextlib.nullcontext()  # unreachable: the base class refuses engines without LoRA

    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().cpu().clone()

    # ------------------------------------------------------------------ checkpoints
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
