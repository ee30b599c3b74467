"""Per-token log-probs from hidden states through Liger-Kernel's fused linear cross-entropy (CUDA, Triton).

The optional fast path of the hidden-state outputs (:mod:`.head`), selected by ``log_prob_kernel="liger"``.
Liger's kernel computes each chunk's logits, takes its log-softmax in one fused pass and drops it; with
``reduction="none"`` it recomputes the chunk in backward, where the per-token upstream gradient is known, so
the gradients are exact for any loss over the log-probs. It has no entropy output, and no temperature:
calls that ask for entropy, or for a temperature other than 1 in half precision, take the chunked torch path
(core's :func:`drivetrain_engine_core.kit.linear_log_probs`) instead (:func:`liger_applies`).

NOTE: the temperature could be folded into the hidden states (``softmax((h @ W.T) / T) == softmax((h / T) @
W.T)``), but ``h / T`` rounded to bf16 moves the log-probs by up to 2e-2 (measured on an H100: 3,000 tokens, a
32k vocabulary, T = 0.7), while the torch path divides the float32 logits. Float32 hidden states fold exactly enough.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from drivetrain_engine_core.backend import ConfigError, ForwardOptions

LIGER_INSTALL_HINT = 'pip install "drivetrain-engine-fsdp[liger]"'


def check_liger_available(device: str) -> None:
    """Refuse ``log_prob_kernel="liger"`` where it cannot run.

    Raises:
        ConfigError: the device is not CUDA, or ``liger_kernel`` is not installed.
    """
    if device != "cuda":
        raise ConfigError(
            f"engine.log_prob_kernel='liger' runs Triton kernels on CUDA only, but engine.device={device!r}; "
            "set engine.log_prob_kernel='torch' (the exact chunked path) or train on cuda."
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            f"engine.log_prob_kernel='liger' needs Liger-Kernel, which is not installed; run `{LIGER_INSTALL_HINT}` "
            "or set engine.log_prob_kernel='torch'."
        )


def liger_applies(options: ForwardOptions, dtype: torch.dtype) -> bool:
    """Whether Liger's kernel computes this call's outputs: log-probs only, and a temperature it can fold."""
    return not options.compute_entropy and (options.temperature == 1.0 or dtype == torch.float32)


def liger_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float, chunk_size: int
) -> torch.Tensor:
    """Float32 log-probs ``(P,)`` of ``labels`` under ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: ``(P, hidden_size)`` last hidden states.
        weight: ``(vocab, hidden_size)`` output projection, in ``hidden``'s dtype.
        labels: ``(P,)`` next-token ids.
        temperature: divides the logits.
        chunk_size: about how many positions' logits exist at once (Liger sizes its chunks in powers of two
            from a memory budget; :func:`_memory_budget` picks the budget that gives this many rows).
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    scaled = hidden if temperature == 1.0 else hidden / temperature
    nll = liger_fused_linear_cross_entropy(
        scaled,
        weight,
        labels,
        reduction="none",
        chunk_mem_const=_memory_budget(hidden.shape[0], weight.shape[0], hidden.shape[1], chunk_size),
    )
    return -nll.float()


def _memory_budget(positions: int, vocab: int, hidden_size: int, chunk_size: int) -> int:
    """Liger's ``chunk_mem_const`` for chunks of about ``chunk_size`` rows.

    NOTE: Liger splits ``P`` rows into ``ceil(vocab / (c * hidden_size))`` chunks for a budget ``c``; its default
    ``c = 1`` gives 128-row chunks at a 152k vocabulary, too small to keep the GPU busy.
    """
    chunks = max(1, math.ceil(positions / chunk_size))
    return max(1, math.ceil(vocab / (chunks * hidden_size)))
