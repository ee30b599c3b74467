"""Whether vLLM can serve a model, said before and while vLLM starts, in one error that names the fix."""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core.backend import ConfigError

FIX = "use a model vLLM serves, or the `hf` rollout (rollout.name=hf) for this one"


def check_head_size(model_path: str, config: Any, device: str) -> None:
    """Refuse, before vLLM starts, a model whose attention heads vLLM's CPU kernel has no code for (it fails
    only at the first ``generate``, deep inside the kernel).

    Raises:
        ConfigError: on CPU, the head size is not among vLLM's CPU attention's.
    """
    if device != "cpu":
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: vLLM's own error comes at the first generate
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ConfigError(
            f"rollout 'vllm' cannot serve {model_path}: its attention heads have size {head}, and vLLM's CPU "
            f"attention supports {supported}; {FIX}."
        )


def cannot_serve(model_path: str, config: Any, error: Exception) -> ConfigError:
    """The error for a model vLLM refused to start with (an architecture it does not implement, ...)."""
    architectures = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    return ConfigError(
        f"rollout 'vllm' cannot serve {model_path} (architecture {', '.join(architectures)}): vLLM said "
        f"{_reason(error)!r}; {FIX}."
    )


def _reason(error: Exception) -> str:
    """vLLM's own sentence: a pydantic error's line under its ``N validation error`` header, without the list
    of every architecture vLLM supports that follows it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    reason = next((line for line in lines if line.startswith("Value error, ")), lines[0])
    return reason.removeprefix("Value error, ").split(" Supported architectures:")[0]
