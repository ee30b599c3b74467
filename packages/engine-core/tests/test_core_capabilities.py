"""Backend capabilities: declared once on the engine class, enforced by ``create_engine`` (and ``initialize``),
checked against the hooks when the class is defined."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from drivetrain_engine_core._plugins import get_plugin_manager
from drivetrain_engine_core._state_checks import check_move
from drivetrain_engine_core.backend import (
    BackendCapabilities,
    BackendHooks,
    ConfigError,
    EngineStateError,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    hookimpl,
)
from drivetrain_engine_core.job import create_engine
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine


class PlainEngine(TinyTorchEngine):
    """The tiny engine without its optional parts: float32, packed rows, no offload hooks."""

    backend_name = "tiny"
    capabilities = BackendCapabilities(value_model=True)

    # Back to the hooks' defaults: this engine implements no offload.
    _load_to_device = BackendHooks._load_to_device
    _offload_to_host = BackendHooks._offload_to_host
    _to = BackendHooks._to


@hookimpl
def _register(registry: Any) -> None:
    registry.register(
        model_type="language_model",
        backend="tiny",
        devices=["*"],
        engine=f"{__name__}:PlainEngine",
        config=TinyEngineConfig,
    )


_ENTRY_POINT = InMemoryEntryPoint(
    name="tiny", distribution="drivetrain-engine-tiny", plugin=SimpleNamespace(register_engines=_register)
)


@pytest.fixture(scope="module")
def loaded() -> Iterator[Any]:
    yield get_plugin_manager(entry_points=[_ENTRY_POINT], disabled=[])


def build(loaded: Any, *, optimizer: bool = True, lora: LoraConfig | None = None, **engine: Any) -> Any:
    return create_engine(
        model_config=ModelConfig(path="tiny-model", lora=lora, use_remove_padding=engine.pop("packed", True)),
        engine_config=TinyEngineConfig(**engine),
        optimizer_config=OptimizerConfig(lr=0.1) if optimizer else None,
        plugins=loaded,
    )


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ({"param_offload": True}, r"engine\.param_offload / optimizer_offload .* tiny backend .*'offload'"),
        ({"lora": LoraConfig(rank=2, alpha=4.0)}, r"model\.lora .* tiny backend .*'lora' capability"),
        ({"packed": False}, r"model\.use_remove_padding=False .* tiny backend .*'padded_inputs'"),
        ({"param_dtype": "bfloat16"}, r"engine\.param_dtype='bfloat16' .* tiny backend .*'param_dtypes'"),
    ],
)
def test_create_engine_refuses_an_undeclared_capability_naming_backend_capability_and_option(
    loaded: Any, asked: dict[str, Any], expected: str
) -> None:
    assert build(loaded).capabilities.declared() == ["value_model"]  # the same engine without the request
    with pytest.raises(ConfigError, match=expected):
        build(loaded, **asked)


def test_every_missing_capability_is_named_in_one_error(loaded: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        build(loaded, optimizer_offload=True, packed=False)
    assert "'offload'" in str(caught.value) and "'padded_inputs'" in str(caught.value)


def test_a_direct_construction_is_refused_by_initialize() -> None:
    engine = PlainEngine(
        model_config=ModelConfig(path="m"), engine_config=TinyEngineConfig(param_offload=True)
    )
    with pytest.raises(ConfigError, match=r"tiny backend .*'offload'"):
        engine.initialize()


def test_training_dtypes_are_a_separate_declaration() -> None:
    """A backend may compute in float16 without training in it (no loss scaling): inference passes."""

    class HalfInference(PlainEngine):
        capabilities = BackendCapabilities(
            param_dtypes=frozenset({"float32", "float16"}), train_dtypes=frozenset({"float32"})
        )

    config = TinyEngineConfig(param_dtype="float16")
    HalfInference(model_config=ModelConfig(path="m"), engine_config=config).initialize()
    trainer = HalfInference(
        model_config=ModelConfig(path="m"), engine_config=config, optimizer_config=OptimizerConfig(lr=0.1)
    )
    with pytest.raises(
        ConfigError, match=r"param_dtype='float16' cannot train .*set engine\.param_dtype='float32'"
    ):
        trainer.initialize()


def test_to_without_offload_keeps_the_state_and_refuses_the_host() -> None:
    engine = PlainEngine(model_config=ModelConfig(path="m"), engine_config=TinyEngineConfig())
    engine.initialize()
    engine.to("cpu")  # the engine device: nothing to move, no hook called
    assert engine.calls == []
    assert check_move("cuda", "cuda", True, True, offload=False, backend="b") is False
    assert check_move("cpu", "cuda", True, True, offload=True, backend="b") is True
    with pytest.raises(
        EngineStateError, match=r"engine\.to\('cpu'\): the b backend keeps its state on 'cuda'"
    ):
        check_move("cpu", "cuda", True, True, offload=False, backend="b")


def test_a_class_declaring_a_capability_without_its_hooks_is_refused() -> None:
    with pytest.raises(TypeError, match=r"declares the 'lora' capability but does not implement"):

        class _NoAdapters(PlainEngine):
            capabilities = BackendCapabilities(lora=True)


def test_a_class_implementing_hooks_of_an_undeclared_capability_is_refused() -> None:
    """A stub for a missing feature is refused: core never calls it, the declaration says it instead."""
    with pytest.raises(TypeError, match=r"implements \['_disable_adapter'\] .* 'lora' capability"):

        class _Stub(PlainEngine):
            def _disable_adapter(self) -> Any:
                raise NotImplementedError


def test_capabilities_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown dtypes"):
        BackendCapabilities(param_dtypes=frozenset({"float8"}))
    with pytest.raises(ValueError, match="must be among param_dtypes"):
        BackendCapabilities(train_dtypes=frozenset({"bfloat16"}))
    fsdp_like = BackendCapabilities(
        param_dtypes=frozenset({"float32", "bfloat16", "float16"}),
        train_dtypes=frozenset({"float32", "bfloat16"}),
    )
    assert fsdp_like.low_precision_train_dtypes == ("bfloat16",)
