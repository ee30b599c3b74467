"""``TinyTorchEngine``: a dependency-free engine (embedding + linear head) for testing core and roles.

It implements every backend hook in a few lines of plain torch, replicates the model on each rank and
averages gradients over the default process group (like DDP), and records the order of its placement and
mode hooks in ``calls``, so tests of the base ``Engine`` can see what the template methods do: it declares
the ``offload`` capability for that, though nothing moves. Its per-token output depends only on the current
token, which is all the base-class tests need (packed or padded rows alike, and a one-column value head).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from drivetrain_engine_core.backend import (
    BackendCapabilities,
    ConfigError,
    Engine,
    EngineConfig,
    EngineStateError,
    MicroBatch,
    MicroBatchResult,
    Mode,
    TokenLimits,
)
from drivetrain_engine_core.kit import distributed

MODEL_FILE = "model/model.pt"
OPTIMIZER_FILE = "optimizer/optimizer.pt"


@dataclass(kw_only=True, frozen=True)
class TinyEngineConfig(EngineConfig):
    """Core settings plus the tiny model's sizes (the model path is recorded but not read).

    Attributes:
        vocab_size: embedding rows and language-model head outputs.
        hidden_size: embedding width.
    """

    backend: str = "tiny"
    vocab_size: int = 64
    hidden_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_size < 2 or self.hidden_size < 1:
            raise ConfigError(
                f"engine.vocab_size must be >= 2 and engine.hidden_size >= 1, got {self.vocab_size}, "
                f"{self.hidden_size}."
            )


class TinyTorchEngine(Engine):
    """Plain torch ``Embedding -> Linear`` engine, data-parallel over the default process group."""

    backend_name = "tiny"
    config_class = TinyEngineConfig
    capabilities = BackendCapabilities(offload=True, value_model=True, padded_inputs=True)
    engine_config: TinyEngineConfig

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, ...]] = []
        self.optimizer: torch.optim.AdamW | None = None

    @property
    def _adamw(self) -> torch.optim.AdamW:
        """The optimizer; the base class calls optimizer hooks only on engines built with one."""
        if self.optimizer is None:
            raise EngineStateError("TinyTorchEngine was built with optimizer_config=None.")
        return self.optimizer

    # ------------------------------------------------------------------ parallel layout
    @property
    def data_parallel_rank(self) -> int:
        return distributed.rank()

    @property
    def data_parallel_size(self) -> int:
        return distributed.world_size()

    @property
    def data_parallel_group(self) -> None:
        return None

    @property
    def is_output_rank(self) -> bool:
        return True

    @property
    def gradient_divisor(self) -> int:
        """Gradients are averaged over every rank (``_clip_grad_norm``), as DDP does."""
        return self.data_parallel_size

    # ------------------------------------------------------------------ build and compute
    def _initialize(self) -> None:
        config = self.engine_config
        torch.manual_seed(config.seed)
        outputs = config.vocab_size if self.model_config.model_type == "language_model" else 1
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(config.vocab_size, config.hidden_size),
            torch.nn.Linear(config.hidden_size, outputs),
        ).to(config.device)
        if self.optimizer_config is not None:
            o = self.optimizer_config
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
            )

    def _forward_backward_micro_batches(
        self, micro_batches: Sequence[MicroBatch], forward_only: bool
    ) -> list[MicroBatchResult]:
        results = []
        for micro_batch in micro_batches:
            loss, result = micro_batch.finish(self._per_position(micro_batch))
            if not forward_only:
                loss.backward()
            results.append(result)
        return results

    def _per_position(self, micro_batch: MicroBatch) -> dict[str, torch.Tensor]:
        """The model's fields at each position (it reads one token at a time, so any layout works)."""
        scores = micro_batch.rows(self.model(micro_batch.inputs.input_ids))
        if self.model_config.model_type == "value_model":
            return {"values": scores[:, 0]}
        log_softmax = torch.log_softmax(scores / micro_batch.options.temperature, dim=-1)
        fields = {"log_probs": log_softmax.gather(-1, micro_batch.labels[:, None]).squeeze(-1)}
        if micro_batch.options.compute_entropy:
            fields["entropy"] = -(log_softmax.exp() * log_softmax).sum(-1)
        return fields

    def _set_mode(self, mode: Mode) -> None:
        self.calls.append(("set_mode", mode))
        self.model.train(mode == "train")

    # ------------------------------------------------------------------ optimizer
    def _optimizer_param_groups(self) -> Sequence[dict[str, Any]]:
        return self._adamw.param_groups

    def _optimizer_zero_grad(self) -> None:
        self._adamw.zero_grad(set_to_none=True)

    def _clip_grad_norm(self, max_norm: float | None) -> float:
        if self.data_parallel_size > 1:
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)
        limit = float("inf") if max_norm is None else max_norm
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit))

    def _optimizer_step(self) -> None:
        self._adamw.step()

    # ------------------------------------------------------------------ placement (recorded, nothing moves)
    def _load_to_device(self, *, params: bool, optimizer: bool) -> None:
        self.calls.append(("load", f"params={params}", f"optimizer={optimizer}"))

    def _offload_to_host(self, params: bool, optimizer: bool) -> None:
        self.calls.append(("offload", f"params={params}", f"optimizer={optimizer}"))

    def _to(self, device: str, *, model: bool, optimizer: bool, grad: bool) -> None:
        self.calls.append(("to", device))

    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().cpu().clone()

    def _token_limits(self) -> TokenLimits:
        return TokenLimits(vocab_size=self.engine_config.vocab_size, model="the tiny engine's model")

    # ------------------------------------------------------------------ checkpoints (replicas: rank 0 writes)
    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        if distributed.rank() != 0:
            return
        (step_dir / MODEL_FILE).parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), step_dir / MODEL_FILE)
        if save_optimizer and self.optimizer is not None:
            (step_dir / OPTIMIZER_FILE).parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.optimizer.state_dict(), step_dir / OPTIMIZER_FILE)

    def _load_checkpoint(self, step_dir: Path, *, load_optimizer: bool) -> None:
        self.model.load_state_dict(torch.load(step_dir / MODEL_FILE, weights_only=True))
        if load_optimizer:
            self._adamw.load_state_dict(torch.load(step_dir / OPTIMIZER_FILE, weights_only=True))
