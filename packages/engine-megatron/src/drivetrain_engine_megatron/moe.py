"""Mixture-of-experts models on megatron-core without grouped GEMM kernels: the sequential expert MLP.

mbridge's MoE bridges (Qwen2-MoE, Qwen3-MoE, Mixtral) ask for ``moe_grouped_gemm=True``, whose ``GroupedMLP``
needs the ``grouped_gemm`` CUDA package ("Grouped GEMM is not available") and whose ``TEGroupedMLP`` needs
Transformer Engine. drivetrain builds ``SequentialMLP`` instead (one plain MLP per local expert, any device),
which needs three things here:

- the token dispatcher ``alltoall``: it exchanges each rank's routed tokens with the expert-parallel ranks
  whatever their count (``allgather`` gathers equal-sized blocks only, and data-parallel ranks hold packed
  rows of different lengths); on CPU it needs two shims (:mod:`.cpu_compat`: an inert CUDA event, host split
  sizes as NumPy arrays);
- names: mbridge maps only the grouped names (``mlp.experts.linear_fc1.weight<N>``); ``SequentialMLP``'s
  ``mlp.experts.local_experts.<N>.linear_fc1.weight`` is translated to them (:func:`grouped_expert_name`);
- megatron-core 0.16's router GEMM reads ``te_general_gemm``, which its module defines only when Transformer
  Engine imports (a ``NameError`` otherwise): :func:`define_router_gemm_fallback` sets it to ``None``, the
  value the code tests for, so the router uses ``torch.matmul``.

Expert parallelism (``engine.expert_model_parallel_size``, EP) splits the experts over data-parallel ranks:
mbridge's expert import and export (each expert from or to the Hugging Face checkpoint by its global index, the
export all-gathered over the expert ranks) run through the same grouped names, a local expert named by its
global index when loading (:func:`grouped_expert_name`'s ``expert_offset``).
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
        ConfigError: a model type outside :data:`VERIFIED_MOE_TYPES`, a layout not verified for it (pipeline
            parallelism, or expert parallelism with tensor parallelism), an expert count that the expert ranks
            do not divide, or expert parallelism for a dense model.
    """
    if not is_mixture_of_experts(hf_config):
        if config.expert_model_parallel_size > 1:
            raise ConfigError(
                f"engine.expert_model_parallel_size={config.expert_model_parallel_size} splits the experts of a "
                f"mixture-of-experts model, and {hf_config.model_type} has none; set expert_model_parallel_size=1."
            )
        return {}
    if hf_config.model_type not in VERIFIED_MOE_TYPES:
        raise ConfigError(
            f"{hf_config.model_type} is a mixture-of-experts model that the megatron backend does not build "
            f"correctly yet (verified: {list(VERIFIED_MOE_TYPES)}); use the fsdp backend for this model."
        )
    _refuse_unverified_layout(hf_config, config)
    define_router_gemm_fallback()
    return {
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "alltoall",
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_shared_expert_overlap": False,
    }


def _refuse_unverified_layout(hf_config: Any, config: MegatronEngineConfig) -> None:
    """Refuse the parallel layouts of a mixture-of-experts model that are not tested against transformers."""
    model = f"{hf_config.model_type} is a mixture-of-experts model"
    if config.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"{model}, which the megatron backend does not run with pipeline parallelism yet (untested, and the "
            "per-sequence router balance loss needs every routed layer on one stage; pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size}). Set engine.pipeline_model_parallel_size=1 (split the experts "
            "with expert_model_parallel_size instead), or use the fsdp backend."
        )
    ep = config.expert_model_parallel_size
    if ep > 1 and config.tensor_model_parallel_size > 1:
        raise ConfigError(
            f"{model}: engine.expert_model_parallel_size={ep} with tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size} is not supported yet (mbridge's import of sequential experts "
            "splits them over tensor ranks); set one of them to 1."
        )
    experts = int(hf_config.num_experts)
    if experts % ep:
        raise ConfigError(
            f"{model} with {experts} experts, which engine.expert_model_parallel_size={ep} ranks cannot share "
            f"equally; choose an expert_model_parallel_size that divides {experts}."
        )


def grouped_expert_name(name: str, expert_offset: int = 0) -> str:
    """``SequentialMLP``'s name of an expert weight as mbridge names the grouped one; others unchanged.

    Args:
        name: a parameter name.
        expert_offset: added to the expert index: the global index of this rank's first local expert, to
            name an expert-parallel rank's local expert by its place in the Hugging Face checkpoint.
    """
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return name
    index = int(match.group(1)) + expert_offset
    return f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{index}"


def define_router_gemm_fallback() -> None:
    """Give megatron-core's ``moe_utils.te_general_gemm`` the ``None`` it tests for when Transformer Engine is
    absent (megatron-core 0.16 leaves it undefined, and the router's gating GEMM fails with a NameError)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
