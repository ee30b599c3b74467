"""Per-sequence attention over a packed row, registered through transformers' ``AttentionInterface``.

A packed row ``(1, T)`` holds several sequences back to back. transformers' SDPA path turns restarting
``position_ids`` into a ``T x T`` block mask, which costs what the *row* costs. This function hands the
layer's query/key/value to core's :func:`~drivetrain_engine_core.kit.packed_causal_attention`
(torch's variable-length flash kernel on CUDA in half precision, SDPA per sequence elsewhere), so attention
costs what the sequences cost.

The model is told to use it with ``attn_implementation=VARLEN_ATTENTION`` and receives the boundaries through
the ``cu_seq_lens_q`` (device), ``max_length_q`` and ``sequence_lengths`` (host) forward keywords, which
transformers passes down to every attention call. Nothing here reads the device.
"""

from __future__ import annotations

import logging

import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.kit import (
    SequenceLengths,
    distributed,
    flash_kernel_applies,
    flash_kernel_missing,
    packed_causal_attention,
)
from transformers import AttentionInterface, PretrainedConfig

VARLEN_ATTENTION = "drivetrain_varlen"

logger = logging.getLogger(__name__)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    sequence_lengths: SequenceLengths | tuple[int, ...] | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention per packed sequence.

    Args:
        module: the attention module (unused: grouped heads are read from the shapes).
        query, key, value: ``(1, heads, T, head_dim)`` (key and value may have fewer heads).
        attention_mask: must be ``None`` (a packed row has no padding mask).
        dropout: attention dropout probability.
        scaling: softmax scale.
        cu_seq_lens_q: int32 cumulative sequence lengths ``(num_sequences + 1,)`` of the row, on its device.
        max_length_q: the longest sequence (host integer).
        sequence_lengths: the lengths ``cu_seq_lens_q`` describes (host integers), for the SDPA path. Not
            checked here: testing a tuple under ``torch.compile`` guards the compiled layer on its length, so
            every new number of sequences per micro-batch recompiled it (eager after eight).
        sliding_window: the layer's window (Mistral, Qwen2 with ``use_sliding_window``, Gemma's local layers):
            each token attends to itself and the ``sliding_window - 1`` tokens before it.

    Returns:
        ``(output (1, T, heads, head_dim), None)`` as transformers' attention functions return.

    Raises:
        ValueError: called without ``cu_seq_lens_q`` or with a padding mask or a batch of several rows.
    """
    if cu_seq_lens_q is None or max_length_q is None or attention_mask is not None or query.shape[0] != 1:
        raise ValueError(
            f"{VARLEN_ATTENTION} attention needs one packed row (batch 1), no attention_mask, cu_seq_lens_q "
            f"and max_length_q; got batch {query.shape[0]}, mask {'set' if attention_mask is not None else 'None'}, "
            f"cu_seq_lens_q {'set' if cu_seq_lens_q is not None else 'None'}, max_length_q {max_length_q}. "
            "Pass inputs from drivetrain_engine_fsdp.inputs."
        )
    heads_first = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, head_dim) views
    output = packed_causal_attention(
        *heads_first,
        cu_seqlens=cu_seq_lens_q,
        max_seqlen=max_length_q,
        lengths=sequence_lengths,
        scale=scaling,
        dropout=dropout,
        window=sliding_window,
    )
    return output.unsqueeze(0), None


def check_soft_capping(hf_config: PretrainedConfig, attention_backend: str) -> None:
    """Refuse a model that soft-caps attention logits (Gemma 2) unless transformers' eager attention runs it.

    Raises:
        ConfigError: ``attn_logit_softcapping`` is set and ``attention_backend`` is not ``eager``: packed
            attention and SDPA would silently attend without the cap.
    """
    cap = getattr(hf_config, "attn_logit_softcapping", None)
    if cap is not None and attention_backend != "eager":
        raise ConfigError(
            f"{hf_config.model_type} soft-caps its attention logits (attn_logit_softcapping={cap}), which "
            f"engine.attention_backend={attention_backend!r} does not apply; set "
            "engine.attention_backend='eager' (transformers' own attention, the only one that applies it)."
        )


def register_varlen_attention() -> str:
    """Register :func:`varlen_attention_forward` (idempotent) and return its ``attn_implementation`` name."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION


def check_flash_support(device: str, param_dtype: str) -> None:
    """Refuse packed attention in half precision on a GPU older than Ampere, where it would take torch's flash
    kernel and fail inside the first forward.

    Raises:
        ConfigError: ``device`` is CUDA, ``param_dtype`` half precision, and the GPU predates compute
            capability 8.0.
    """
    if flash_kernel_missing(device, param_dtype):
        raise ConfigError(
            f"packed attention in {param_dtype} takes torch's flash kernel, which needs compute capability 8.0 "
            f"(Ampere) or newer; this GPU ({torch.cuda.get_device_name()}) has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}. Set engine.attention_backend='sdpa', or "
            "engine.param_dtype='float32'."
        )


def warn_compiled_per_sequence_attention(compile_layers: bool, device: str, param_dtype: str) -> None:
    """Warn (rank 0) when compiled layers will run packed attention per sequence (off CUDA, or in float32).

    That path loops over a row's sequences, so a compiled layer is specialised on their number: every new count
    recompiles it, and past dynamo's recompile limit (8) the layers run uncompiled. The flash path (CUDA,
    bfloat16/float16) is one graph for every micro-batch.
    """
    if compile_layers and not flash_kernel_applies(device, param_dtype) and distributed.rank() == 0:
        logger.warning(
            "engine.compile_layers=True with packed attention per sequence (device %s, param_dtype %s): each new "
            "number of sequences in a micro-batch recompiles the layers, and past torch's recompile limit they "
            "run uncompiled. Compiled layers pay off on CUDA in bfloat16 (one graph for every micro-batch); "
            "elsewhere set engine.compile_layers=False.",
            device,
            param_dtype,
        )
