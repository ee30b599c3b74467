"""What a backend offers beyond the required hooks, declared once on its engine class.

A backend sets ``capabilities = BackendCapabilities(...)`` on its :class:`~.engine.Engine` subclass. Core
reads that one declaration three times: ``create_engine`` (and ``initialize``) refuse a config that asks for
a capability the backend lacks, with one error naming the backend, the capability and the option; the class
itself is refused at definition when it declares a capability without its hooks, or implements the hooks of
one it does not declare (:func:`check_capability_hooks`); the conformance kit runs the checks of what is
declared and skips the rest.

NOTE: a declaration, not a protocol per capability (fsspec's and ``torch.distributed.checkpoint``'s style of
"ask the implementation what it supports"): half the capabilities have no hook at all (a value head, padded
rows, a compute dtype are what the forward does with core's layout), so only a declaration can say them, and
one frozen value is what the factory, the class check and the kit all read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ._config import DTYPES, ConfigError, EngineConfig, ModelConfig, OptimizerConfig

FLOAT32 = frozenset({"float32"})


@dataclass(kw_only=True, frozen=True)
class BackendCapabilities:
    """The optional parts of the Engine contract a backend implements (defaults: none of them).

    Attributes:
        offload: parameters and optimizer state can leave the device: ``engine.param_offload`` /
            ``engine.optimizer_offload`` and ``engine.to("cpu")``. Hooks ``_load_to_device``,
            ``_offload_to_host``, ``_to``.
        lora: LoRA adapters (``model.lora``): ``disable_adapter()`` and ``weight_buckets(lora="adapter")``.
            Hooks ``_disable_adapter``, ``_export_adapter_weights``.
        value_model: a scalar value head (``model.model_type="value_model"``); the forward returns ``values``.
        padded_inputs: right-padded rows (``model.use_remove_padding=False``) besides core's packed row.
        sequence_parallel: packed rows split over sequence-parallel ranks (the backend's own config option
            turns it on). Hook ``_sequence_split``.
        hf_state_resume: loads a checkpoint step of another backend (or a layout its own format cannot
            reshard to) from the step's full state under Hugging Face names (:mod:`.checkpoint.hf_state`):
            weights, Adam moments and step. Hook ``_load_hf_state``.
        sharded_export: the weights can be exported as each rank's local shards with a gather per tensor
            (:mod:`.handoff.local_shards`): a delta stream gathers only the tensors whose shards changed.
            Hook ``_export_weight_shards``.
        router_replay: the forward routes a mixture-of-experts model through the batch's recorded experts
            (``routed_experts``, :mod:`.router_replay`; ``rollout.router_replay=R3``), which roles check
            before a run starts.
        param_dtypes: the compute dtypes (``engine.param_dtype``) the backend runs.
        train_dtypes: those it also trains in (a subset: training in float16 needs loss scaling).
    """

    offload: bool = False
    lora: bool = False
    value_model: bool = False
    padded_inputs: bool = False
    sequence_parallel: bool = False
    hf_state_resume: bool = False
    sharded_export: bool = False
    router_replay: bool = False
    param_dtypes: frozenset[str] = FLOAT32
    train_dtypes: frozenset[str] = FLOAT32

    def __post_init__(self) -> None:
        unknown = sorted((self.param_dtypes | self.train_dtypes) - set(DTYPES))
        if unknown:
            raise ValueError(f"BackendCapabilities: unknown dtypes {unknown}; choose from {list(DTYPES)}.")
        if not self.train_dtypes <= self.param_dtypes:
            raise ValueError(
                f"BackendCapabilities: train_dtypes {sorted(self.train_dtypes)} must be among param_dtypes "
                f"{sorted(self.param_dtypes)} (a backend trains only in dtypes it computes in)."
            )

    @property
    def low_precision_train_dtypes(self) -> tuple[str, ...]:
        """The half-precision dtypes the backend trains in (what the conformance kit's low-precision checks run)."""
        return tuple(dtype for dtype in DTYPES if dtype in self.train_dtypes and dtype != "float32")

    def declared(self) -> list[str]:
        """The names of the boolean capabilities that are on."""
        return [f.name for f in fields(self) if getattr(self, f.name) is True]


CAPABILITY_HOOKS: dict[str, tuple[str, ...]] = {
    "offload": ("_load_to_device", "_offload_to_host", "_to"),
    "lora": ("_disable_adapter", "_export_adapter_weights"),
    "sequence_parallel": ("_sequence_split",),
    "hf_state_resume": ("_load_hf_state",),
    "sharded_export": ("_export_weight_shards",),
}
"""The optional hooks of each capability: implemented exactly when the capability is declared."""


def check_capability_hooks(cls: Any, base: type) -> None:
    """Refuse an engine class whose hooks disagree with its declared capabilities (at class definition).

    Args:
        cls: the engine class being defined (its ``capabilities`` declaration is read).
        base: the class that defines the hooks' defaults (``BackendHooks``).

    Raises:
        TypeError: a declared capability misses a hook, or a hook is implemented for an undeclared one (a stub
            the contract no longer needs: core never calls it).
    """
    declared = cls.capabilities
    for capability, hooks in CAPABILITY_HOOKS.items():
        overridden = [hook for hook in hooks if getattr(cls, hook) is not getattr(base, hook)]
        on = getattr(declared, capability)
        if on and len(overridden) < len(hooks):
            missing = sorted(set(hooks) - set(overridden))
            raise TypeError(
                f"{cls.__qualname__} declares the {capability!r} capability but does not implement {missing}; "
                f"implement them or drop {capability}=True from its BackendCapabilities."
            )
        if not on and overridden:
            raise TypeError(
                f"{cls.__qualname__} implements {overridden} but does not declare the {capability!r} capability, "
                f"so core never calls them; set capabilities = BackendCapabilities({capability}=True, ...) or "
                "remove them."
            )


@dataclass(frozen=True)
class _Request:
    """A config option that needs a boolean capability: whether the config asks for it, and the error's words."""

    capability: str
    asked: Callable[[ModelConfig, EngineConfig], bool]
    what: str
    fix: str


_REQUESTS = (
    _Request(
        "offload",
        lambda model, engine: engine.param_offload or engine.optimizer_offload,
        "engine.param_offload / optimizer_offload are not implemented",
        "set both to false",
    ),
    _Request(
        "lora",
        lambda model, engine: model.lora is not None,
        "model.lora (LoRA adapters) is not implemented",
        "unset model.lora to train the full model",
    ),
    _Request(
        "value_model",
        lambda model, engine: model.model_type == "value_model",
        "model.model_type='value_model' (a value head) is not implemented",
        "use a backend that declares it",
    ),
    _Request(
        "padded_inputs",
        lambda model, engine: not model.use_remove_padding,
        "model.use_remove_padding=False (padded rows) is not implemented",
        "set model.use_remove_padding=True (packed rows give the same results)",
    ),
)


def refuse_missing_capabilities(
    backend: str,
    capabilities: BackendCapabilities,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    optimizer_config: OptimizerConfig | None,
) -> None:
    """Refuse a config that asks for what ``capabilities`` lacks, before any model is built.

    Raises:
        ConfigError: naming the backend, each missing capability and the option that asked for it.
    """
    declared = capabilities.declared() or "none"
    problems = [
        f"{request.what} by the {backend} backend (it does not declare the {request.capability!r} capability; "
        f"it declares {declared}): {request.fix}"
        for request in _REQUESTS
        if request.asked(model_config, engine_config) and not getattr(capabilities, request.capability)
    ]
    dtype = engine_config.param_dtype
    if dtype not in capabilities.param_dtypes:
        problems.append(
            f"engine.param_dtype={dtype!r} is not a compute dtype of the {backend} backend (its 'param_dtypes' "
            f"capability is {sorted(capabilities.param_dtypes)}): set engine.param_dtype to one of them"
        )
    elif optimizer_config is not None and dtype not in capabilities.train_dtypes:
        choices = " or ".join(f"engine.param_dtype={d!r}" for d in sorted(capabilities.train_dtypes))
        problems.append(
            f"engine.param_dtype={dtype!r} cannot train with the {backend} backend (its 'train_dtypes' "
            f"capability is {sorted(capabilities.train_dtypes)}): set {choices}, or build an inference-only "
            "engine (optimizer_config=None)"
        )
    if problems:
        raise ConfigError("; ".join(problems) + ".")
