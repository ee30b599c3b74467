"""How fast a step ran: FLOPs of a dense transformer from its config, tokens/s, TFLOP/s, MFU, peak memory.

FLOPs of one forward over sequences of lengths ``L_i`` (``T = sum L_i`` tokens), counting a multiply-add as 2:

- matmuls: ``2 * N * T``, where ``N`` is the number of weights multiplied per token: per layer
  ``H * (n_q + 2 * n_kv) * d`` (q, k, v), ``n_q * d * H`` (o) and ``3 * H * I`` for a gated MLP (``2 * H * I``
  otherwise), plus the output projection ``H * V`` (``V`` the vocabulary; 1 for a value model's head).
  Embedding lookups, norms and elementwise work are not counted (PaLM's and Megatron's convention).
  A mixture-of-experts layer (Qwen3-MoE, Qwen2-MoE, Mixtral naming) multiplies a token by its router
  (``H * E``), by the ``k`` experts it is routed to (``k * 3 * H * I_e``), not all ``E`` of them, and by a
  shared expert and its one-output gate where the model has one (``3 * H * I_s + H``); layers the config keeps
  dense (``mlp_only_layers``, ``decoder_sparse_step``) count their dense MLP. Other MoE layouts (DeepSeek's
  ``n_routed_experts``) have no count.
- attention: ``2 * n_q * d * sum(L_i ** 2)`` per layer: ``Q K^T`` and ``A V`` each cost ``2 * L^2 * n_q * d``
  without a mask, and a causal mask halves both. Per-sequence lengths, not the packed row's: a packed row of
  several sequences does not attend across them.

A training step costs 3x its forward (backward: one matmul for the input gradient, one for the weights),
whatever activation checkpointing recomputes: these are *model* FLOPs, so MFU compares across settings.
MFU is ``FLOPs / (seconds * devices * peak)``, with the peak from ``engine.peak_tflops``, else the
``DRIVETRAIN_PEAK_TFLOPS`` environment variable, else :data:`PEAK_TFLOPS` for the CUDA device's name and the
compute dtype (half of it for float32 matmuls in TF32, none for full float32); where none is known (CPU) there
is no MFU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

PEAK_TFLOPS_VARIABLE = "DRIVETRAIN_PEAK_TFLOPS"

# NOTE: dense bf16/fp16 tensor-core peaks from the vendors' data sheets (no sparsity), matched as substrings of
# torch.cuda.get_device_name() in this order (a variant before its family: "H100 PCIe" before "H100", "H200"
# before "H20"). TF32 tensor cores peak at half of these on every GPU listed; full-precision float32 reaches a
# fraction that varies by GPU, so there the peak must be set (engine.peak_tflops).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H20", 148.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)

TRAIN_FLOPS_PER_FORWARD = 3


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes of a dense decoder-only transformer that its FLOPs depend on."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    output_size: int
    """Width of the output projection: the vocabulary, or 1 for a value model's head."""
    gated_mlp: bool = True
    experts: ExpertLayout | None = None
    """The routed MLP of a mixture-of-experts model; ``None`` for a dense one."""

    @classmethod
    def from_hf_config(cls, config: Any, *, value_head: bool = False) -> TransformerShape | None:
        """The shape of a transformers config (Llama/Qwen/Mistral naming, their MoE variants and Mixtral);
        ``None`` for others.

        ``value_head``: the model ends in a one-output head (critic, reward model) instead of the vocabulary
        projection, which is over a quarter of the matmuls of a 0.5B model with a 152k vocabulary.
        """
        names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if any(getattr(config, name, None) is None for name in names):
            return None
        experts = ExpertLayout.from_hf_config(config)
        if _is_mixture_of_experts(config) and experts is None:
            return None
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            output_size=1 if value_head else config.vocab_size,
            experts=experts,
        )

    @property
    def matmul_weights(self) -> int:
        """Weights multiplied once per token in a forward (``N`` of the module docstring)."""
        hidden, attention = self.hidden_size, self.num_heads * self.head_dim
        qkv = hidden * (attention + 2 * self.num_kv_heads * self.head_dim)
        mlp = (3 if self.gated_mlp else 2) * hidden * self.intermediate_size
        routed = 0 if self.experts is None else len(self.experts.routed_layers)
        mlps = (self.num_layers - routed) * mlp
        if self.experts is not None:
            mlps += routed * self.experts.weights_per_token(hidden)
        return self.num_layers * (qkv + attention * hidden) + mlps + hidden * self.output_size

    def forward_flops(self, lengths: Sequence[int]) -> float:
        """FLOPs of one forward over sequences of ``lengths`` tokens."""
        matmuls = 2.0 * self.matmul_weights * sum(lengths)
        attention = 2.0 * self.num_layers * self.num_heads * self.head_dim * sum(n * n for n in lengths)
        return matmuls + attention

    def step_flops(self, lengths: Sequence[int], *, backward: bool) -> float:
        """FLOPs of a forward (and backward) over ``lengths``."""
        return self.forward_flops(lengths) * (TRAIN_FLOPS_PER_FORWARD if backward else 1)


@dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """The routed MLP of a mixture-of-experts transformer: what one token multiplies in a routed layer."""

    num_experts: int
    experts_per_token: int
    """Top-``k``: a token goes through this many experts, whatever ``num_experts`` is."""
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    """Qwen2-MoE's shared expert, which every token goes through (0: none)."""
    routed_layers: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config: Any) -> ExpertLayout | None:
        """The layout of a Qwen-MoE or Mixtral config (``num_experts``/``num_local_experts``,
        ``num_experts_per_tok``); ``None`` for dense models and other layouts."""
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if not experts or not top_k or getattr(config, "n_routed_experts", None):
            return None
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", None) or 1
        layers = config.num_hidden_layers
        return cls(
            num_experts=experts,
            experts_per_token=top_k,
            expert_intermediate_size=getattr(config, "moe_intermediate_size", None)
            or config.intermediate_size,
            shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", None) or 0,
            routed_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        )

    def weights_per_token(self, hidden: int) -> int:
        """Router, the ``k`` routed gated experts, and the shared expert with its one-output gate if any."""
        shared = 3 * hidden * self.shared_intermediate_size + hidden if self.shared_intermediate_size else 0
        routed = self.experts_per_token * 3 * hidden * self.expert_intermediate_size
        return hidden * self.num_experts + routed + shared


def _is_mixture_of_experts(config: Any) -> bool:
    return any(
        getattr(config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def peak_tflops(device: str, configured: float | None, compute_dtype: str = "bfloat16") -> float | None:
    """Peak dense TFLOP/s of one device: the config's, else the environment's, else the table's for
    ``compute_dtype``, else ``None``.

    The table holds half-precision peaks: float32 matmuls get half of it where torch runs them in TF32
    (``torch.set_float32_matmul_precision("high")``), and none at full precision (the default), where the
    half-precision peak made a float32 run's MFU look several times worse than it is.

    Raises:
        ValueError: ``DRIVETRAIN_PEAK_TFLOPS`` is set but not a positive number.
    """
    if configured is not None:
        return configured
    variable = os.environ.get(PEAK_TFLOPS_VARIABLE)
    if variable:
        try:
            value = float(variable)
        except ValueError as e:
            raise ValueError(
                f"{PEAK_TFLOPS_VARIABLE}={variable!r} is not a number; set it to e.g. 989."
            ) from e
        if value <= 0:
            raise ValueError(f"{PEAK_TFLOPS_VARIABLE}={variable!r} must be > 0 (TFLOP/s of one device).")
        return value
    if device != "cuda" or not torch.cuda.is_available():
        return None
    peak = table_peak_tflops(torch.cuda.get_device_name())
    if compute_dtype != "float32" or peak is None:
        return peak
    return peak / 2 if torch.get_float32_matmul_precision() != "highest" else None


def table_peak_tflops(device_name: str) -> float | None:
    """The :data:`PEAK_TFLOPS` entry of a GPU named as ``torch.cuda.get_device_name()`` names it, if any."""
    return next((peak for key, peak in PEAK_TFLOPS if key in device_name), None)


def speed_metrics(
    *,
    seconds: float,
    tokens: float,
    flops: float | None,
    devices: int,
    peak: float | None,
    device_peak_bytes: int | None,
) -> dict[str, float]:
    """The ``perf/*`` metrics of one step from its global tokens and FLOPs.

    Returns:
        ``perf/step_time_s``, ``perf/tokens``, ``perf/tokens_per_s``; with FLOPs ``perf/tflops_per_device``
        (achieved) and, with a peak, ``perf/mfu`` (a fraction); on CUDA ``perf/device_peak_gib``.
    """
    metrics = {"perf/step_time_s": seconds, "perf/tokens": tokens, "perf/tokens_per_s": tokens / seconds}
    if flops is not None:
        per_device = flops / seconds / devices / 1e12
        metrics["perf/tflops_per_device"] = per_device
        if peak is not None:
            metrics["perf/mfu"] = per_device / peak
    if device_peak_bytes is not None:
        metrics["perf/device_peak_gib"] = device_peak_bytes / float(1 << 30)
    return metrics


class StepClock:
    """Wall time and peak CUDA memory from its creation to :meth:`stop` (one step, or one call)."""

    def __init__(self, device: str) -> None:
        self._cuda = device == "cuda" and torch.cuda.is_available()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def stop(self) -> tuple[float, int | None]:
        """``(seconds, peak CUDA bytes or None)``.

        NOTE: on CUDA it waits for the device first, once at the end of the step, so the time is the work's
        and not only the time it took to queue it.
        """
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - self._start, torch.cuda.max_memory_allocated() if self._cuda else None
