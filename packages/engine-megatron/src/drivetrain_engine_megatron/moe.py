"""Mixture-of-experts models on megatron-core without grouped GEMM kernels: the sequential expert MLP.

mbridge's MoE bridges (Qwen2-MoE, Qwen3-MoE, Mixtral) ask for ``moe_grouped_gemm=True``, whose ``GroupedMLP``
needs the ``grouped_gemm`` CUDA package ("Grouped GEMM is not available") and whose ``TEGroupedMLP`` needs
Transformer Engine. drivetrain builds ``SequentialMLP`` instead (one plain MLP per local expert, any device),
which needs three things here:

- the token dispatcher ``allgather``: ``alltoall`` waits on a CUDA event to read the per-expert counts back
  (``d2h_event``, ``None`` on CPU); ``allgather`` does not take variable sequence lengths, which only pipeline
  parallelism needs, so MoE models run without it;
- names: mbridge maps only the grouped names (``mlp.experts.linear_fc1.weight<N>``); ``SequentialMLP``'s
  ``mlp.experts.local_experts.<N>.linear_fc1.weight`` is translated to them (:func:`grouped_expert_name`);
- megatron-core 0.16's router GEMM reads ``te_general_gemm``, which its module defines only when Transformer
  Engine imports (a ``NameError`` otherwise): :func:`define_router_gemm_fallback` sets it to ``None``, the
  value the code tests for, so the router uses ``torch.matmul``.

Expert parallelism is not wired yet (``expert_model_parallel_size`` 1).
"""

from __future__ import annotations

import re
from typing import Any

from drivetrain_engine_core.backend import ConfigError

from .config import MegatronEngineConfig

VERIFIED_MOE_TYPES = ("qwen3_moe",)
"""Mixture-of-experts model types whose megatron build equals transformers (tested). Mixtral's ``head_dim=None``
(transformers 5) breaks mbridge's QKV merge, and with it set the log-probs were 4e-3 off transformers' (the
routing, presumably); Qwen2-MoE's shared expert is untested."""

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def is_mixture_of_experts(hf_config: Any) -> bool:
    """Whether ``hf_config`` routes tokens to experts (Qwen-MoE, Mixtral, DeepSeek naming)."""
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    return any(getattr(hf_config, name, None) for name in names)


def moe_overrides(hf_config: Any, config: MegatronEngineConfig) -> dict[str, Any]:
    """``TransformerConfig`` values of the sequential expert MLP for a mixture-of-experts ``hf_config``.

    Raises:
        ConfigError: a model type outside :data:`VERIFIED_MOE_TYPES`, or pipeline parallelism (the
            ``allgather`` dispatcher takes no variable sequence lengths).
    """
    if not is_mixture_of_experts(hf_config):
        return {}
    if hf_config.model_type not in VERIFIED_MOE_TYPES:
        raise ConfigError(
            f"{hf_config.model_type} is a mixture-of-experts model that the megatron backend does not build "
            f"correctly yet (verified: {list(VERIFIED_MOE_TYPES)}); use the fsdp backend for this model."
        )
    if config.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"{hf_config.model_type} is a mixture-of-experts model, which the megatron backend runs with "
            "megatron's sequential expert MLP and its allgather token dispatcher; that dispatcher takes no "
            f"variable sequence lengths, which pipeline parallelism needs (pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size}). Set engine.pipeline_model_parallel_size=1, or use the "
            "fsdp backend."
        )
    define_router_gemm_fallback()
    return {
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "variable_seq_lengths": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_shared_expert_overlap": False,
    }


def grouped_expert_name(name: str) -> str:
    """``SequentialMLP``'s name of an expert weight as mbridge names the grouped one; others unchanged."""
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return name
    return f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{match.group(1)}"


def define_router_gemm_fallback() -> None:
    """Give megatron-core's ``moe_utils.te_general_gemm`` the ``None`` it tests for when Transformer Engine is
    absent (megatron-core 0.16 leaves it undefined, and the router's gating GEMM fails with a NameError)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
