"""``engine_config_from_dict`` builds a backend's own config, including dataclasses nested in it."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from drivetrain_engine_core._plugins import get_plugin_manager
from drivetrain_engine_core.backend import ConfigError, EngineConfig, LoraConfig, ModelConfig, hookimpl
from drivetrain_engine_core.job import config_from_dict, engine_config_from_dict
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint


@dataclass(kw_only=True, frozen=True)
class MeshConfig:
    size: int = 1


@dataclass(kw_only=True, frozen=True)
class OverlapConfig:
    buckets: int = 4

    def __post_init__(self) -> None:
        if self.buckets < 1:
            raise ConfigError(f"engine.overlap.buckets must be >= 1, got {self.buckets}.")


@dataclass(kw_only=True, frozen=True)
class NestedBackendConfig(EngineConfig):
    mesh: MeshConfig = field(default_factory=MeshConfig)
    overlap: OverlapConfig | None = None
    ranks: tuple[int, ...] = ()


@hookimpl
def _register(registry):
    registry.register(
        model_type="language_model", backend="nested", devices=["*"], engine="m:E", config=NestedBackendConfig
    )


_ENTRY_POINT = InMemoryEntryPoint(
    name="nested", distribution="drivetrain-engine-nested", plugin=SimpleNamespace(register_engines=_register)
)


@pytest.fixture(scope="module")
def loaded():
    return get_plugin_manager(entry_points=[_ENTRY_POINT], disabled=[])


def test_nested_backend_fields(loaded):
    values = {"backend": "nested", "mesh": {"size": 4}, "overlap": {"buckets": 2}, "ranks": [0, 2]}
    config = engine_config_from_dict(values, plugins=loaded)
    assert config == NestedBackendConfig(
        backend="nested", mesh=MeshConfig(size=4), overlap=OverlapConfig(buckets=2), ranks=(0, 2)
    )
    assert engine_config_from_dict({"backend": "nested", "overlap": None}, plugins=loaded).overlap is None


def test_nested_errors_name_the_path(loaded):
    with pytest.raises(ConfigError, match=r"unknown option engine\.overlap\.bucket;.*Did you mean 'buckets'"):
        engine_config_from_dict({"backend": "nested", "overlap": {"bucket": 2}}, plugins=loaded)
    with pytest.raises(ConfigError, match=r"engine\.overlap\.buckets must be >= 1, got 0"):
        engine_config_from_dict({"backend": "nested", "overlap": {"buckets": 0}}, plugins=loaded)


def test_core_nested_configs_still_build():
    model = config_from_dict(ModelConfig, {"path": "/m", "lora": {"rank": 4, "target_modules": ["q_proj"]}})
    assert model.lora == LoraConfig(rank=4, target_modules=("q_proj",))
