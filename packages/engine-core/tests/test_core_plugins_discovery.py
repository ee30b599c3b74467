"""Plugin discovery on fake plugins: listing, lazy loading, failure isolation, blocking, duplicates, errors."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from drivetrain_engine_core._plugins import get_plugin_manager, reset_plugins
from drivetrain_engine_core.backend import ConfigError, EngineConfig, ModelConfig, PluginError
from drivetrain_engine_core.job import (
    DrivetrainPlugins,
    build_cli,
    create_engine,
    engine_config_from_dict,
    plugins,
)


@dataclass
class FakeEntryPoint:
    """An entry point of group ``drivetrain`` declared by a fake distribution."""

    name: str
    value: str
    dist: Any

    def load(self) -> Any:
        return importlib.metadata.EntryPoint(self.name, self.value, "drivetrain").load()


class FakePlugins:
    """Writes plugin modules with unique names into a directory on ``sys.path``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.suffix = uuid.uuid4().hex[:8]
        self.modules: list[str] = []

    def module(self, stem: str, source: str) -> str:
        name = f"{stem}_{self.suffix}"
        (self.root / f"{name}.py").write_text(textwrap.dedent(source).replace("SUFFIX", self.suffix))
        self.modules.append(name)
        return name

    def entry_point(
        self, name: str, module: str, distribution: str, version: str = "1.2.3"
    ) -> FakeEntryPoint:
        return FakeEntryPoint(name, module, SimpleNamespace(name=distribution, version=version))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("DRIVETRAIN_DISABLE_PLUGINS", raising=False)
    helper = FakePlugins(tmp_path)
    yield helper
    for name in helper.modules:
        sys.modules.pop(name, None)


IMPL = """
    from dataclasses import dataclass
    from drivetrain_engine_core._config import EngineConfig
    from drivetrain_engine_core._engine import Engine

    @dataclass(kw_only=True, frozen=True)
    class FakeConfig(EngineConfig):
        fake_knob: int = 1

    def _stub(self, *args, **kwargs):
        return None

    FakeEngine = type(
        "FakeEngine",
        (Engine,),
        {name: _stub for name in Engine.__abstractmethods__} | {"config_class": FakeConfig, "backend_name": "fake"},
    )
"""

BACKEND_PLUGIN = """
    from drivetrain_engine_core._hookspecs import hookimpl

    @hookimpl
    def register_engines(registry):
        registry.register(model_type="language_model", backend="fake", devices=["cpu", "cuda"],
                          engine="fake_impl_SUFFIX:FakeEngine", config="fake_impl_SUFFIX:FakeConfig")
        registry.register(model_type="value_model", backend="fake", devices=["*"],
                          engine="fake_impl_SUFFIX:FakeEngine", config="fake_impl_SUFFIX:FakeConfig")

    @hookimpl
    def register_checkpoint_mergers(registry):
        registry.register("fake", "fake_impl_SUFFIX:FakeConfig")
"""

ROLES_PLUGIN = """
    from drivetrain_engine_core._hookspecs import hookimpl

    class Actor:
        pass

    @hookimpl
    def register_roles(registry):
        registry.register("actor", Actor)
"""


def _backend(fake: FakePlugins) -> list[FakeEntryPoint]:
    fake.module("fake_impl", IMPL)
    return [fake.entry_point("fake", fake.module("fake_plugin", BACKEND_PLUGIN), "drivetrain-engine-fake")]


def test_listing_and_lazy_loading(fake):
    impl = f"fake_impl_{fake.suffix}"
    roles = fake.entry_point("roles", fake.module("roles_plugin", ROLES_PLUGIN), "drivetrain-roles", "0.1.0")
    loaded = get_plugin_manager(entry_points=[*_backend(fake), roles])
    assert [(p.name, p.distribution, p.version, p.status) for p in loaded.plugins] == [
        ("fake", "drivetrain-engine-fake", "1.2.3", "loaded"),
        ("roles", "drivetrain-roles", "0.1.0", "loaded"),
    ]
    assert loaded.plugins[0].registered == [
        f"engine language_model/fake/cpu -> {impl}:FakeEngine",
        f"engine language_model/fake/cuda -> {impl}:FakeEngine",
        f"engine value_model/fake/* -> {impl}:FakeEngine",
        f"checkpoint merger fake -> {impl}:FakeConfig",
    ]
    assert loaded.plugins[1].registered == [f"role actor -> roles_plugin_{fake.suffix}:Actor"]
    assert [(e.model_type, e.device, e.distribution) for e in loaded.engines.entries()] == [
        ("language_model", "cpu", "drivetrain-engine-fake"),
        ("language_model", "cuda", "drivetrain-engine-fake"),
        ("value_model", "*", "drivetrain-engine-fake"),
    ]
    assert impl not in sys.modules, "listing plugins must not import lazily registered targets"
    engine_cls = loaded.engines.get("language_model", "fake", "cpu")
    assert impl in sys.modules
    assert engine_cls is sys.modules[impl].FakeEngine
    assert loaded.engines.get("value_model", "fake", "tpu") is engine_cls, "'*' serves any device"
    assert loaded.engines.config_class("fake") is sys.modules[impl].FakeConfig
    assert loaded.roles.get("actor").__name__ == "Actor"


WRAPPING_PLUGIN = """
    from drivetrain_engine_core._hookspecs import hookimpl

    SEEN = []

    @hookimpl(wrapper=True, specname="register_roles")
    def wrap_register_roles(registry):
        SEEN.append("before")
        result = yield
        SEEN.append("after")
        return result

    @hookimpl
    def register_roles(registry):
        SEEN.append("impl")
"""


def test_hooks_run_through_pluggy_so_monitoring_and_wrappers_work(fake):
    """Each plugin's hook is called alone, yet through pluggy's hook execution (tracing, wrappers)."""
    module = fake.module("wrapping_plugin", WRAPPING_PLUGIN)
    roles = fake.entry_point("roles", fake.module("roles_plugin", ROLES_PLUGIN), "drivetrain-roles")
    loaded = DrivetrainPlugins()
    monitored: list[tuple[str, list[str]]] = []
    loaded.manager.add_hookcall_monitoring(
        lambda name, impls, kwargs: monitored.append((name, [i.plugin_name for i in impls])),
        lambda outcome, name, impls, kwargs: None,
    )
    loaded.load([fake.entry_point("wrapping", module, "drivetrain-wrapping"), roles], set())
    assert sys.modules[module].SEEN == ["before", "impl", "after"]
    assert ("register_roles", ["wrapping", "wrapping"]) in monitored
    assert ("register_roles", ["roles"]) in monitored


def test_broken_plugins_are_reported_and_others_load(fake):
    broken_import = fake.module("broken_import", "raise RuntimeError('boom at import of broken plugin')\n")
    broken_hook = fake.module(
        "broken_hook",
        """
        from drivetrain_engine_core._hookspecs import hookimpl

        @hookimpl
        def register_engines(registry):
            registry.register(model_type="language_model", backend="half", devices=["cpu"],
                              engine="x:Y", config="x:Z")

        @hookimpl
        def register_roles(registry):
            raise ValueError("roles hook exploded")
        """,
    )
    typo = fake.module(
        "typo",
        """
        from drivetrain_engine_core._hookspecs import hookimpl

        @hookimpl
        def register_engine(registry):
            pass
        """,
    )
    entry_points = [
        *_backend(fake),
        fake.entry_point("a_broken", broken_import, "drivetrain-broken", "0.0.1"),
        fake.entry_point("b_hook", broken_hook, "drivetrain-hook", "0.0.2"),
        fake.entry_point("c_typo", typo, "drivetrain-typo", "0.0.3"),
    ]
    loaded = get_plugin_manager(entry_points=entry_points)
    by_name = {p.name: p for p in loaded.plugins}
    assert by_name["fake"].status == "loaded"
    assert loaded.engines.backends() == ["fake"], "a plugin failing in a later hook contributes nothing"
    broken = by_name["a_broken"]
    assert (broken.status, broken.distribution, broken.version) == ("failed", "drivetrain-broken", "0.0.1")
    assert broken.error == "RuntimeError: boom at import of broken plugin"
    assert "raise RuntimeError" in broken.traceback
    assert by_name["b_hook"].error == "register_roles: ValueError: roles hook exploded"
    assert by_name["b_hook"].registered == []
    assert by_name["c_typo"].status == "failed"
    assert "register_engine" in by_name["c_typo"].error
    with pytest.raises(PluginError) as missing:
        loaded.engines.get("language_model", "half", "cpu")
    assert "b_hook (drivetrain-hook 0.0.2): register_roles: ValueError: roles hook exploded" in str(
        missing.value
    )


def test_blocked_by_environment(fake, monkeypatch):
    blocked_module = fake.module("blocked", "raise RuntimeError('a blocked plugin must not be imported')\n")
    monkeypatch.setenv("DRIVETRAIN_DISABLE_PLUGINS", " blocked , other")
    entry_points = [*_backend(fake), fake.entry_point("blocked", blocked_module, "drivetrain-blocked")]
    loaded = get_plugin_manager(entry_points=entry_points)
    by_name = {p.name: p for p in loaded.plugins}
    assert (by_name["blocked"].status, by_name["blocked"].error) == ("blocked", None)
    assert by_name["fake"].status == "loaded"
    assert blocked_module not in sys.modules
    without_fake = get_plugin_manager(entry_points=entry_points, disabled=["fake"])
    assert without_fake.engines.entries() == []
    with pytest.raises(PluginError) as missing:
        without_fake.engines.get("language_model", "fake", "cpu")
    message = str(missing.value)
    assert (
        "provided by plugin 'fake' (drivetrain-engine-fake 1.2.3), which is installed but blocked" in message
    )
    assert "remove 'fake' from DRIVETRAIN_DISABLE_PLUGINS" in message
    assert "pip install" not in message


HIJACK_PLUGIN = """
    from drivetrain_engine_core._hookspecs import hookimpl

    @hookimpl
    def register_engines(registry):
        registry.register(model_type="language_model", backend="fake", devices=["cpu"],
                          engine="evil_SUFFIX:Engine", config="fake_impl_SUFFIX:FakeConfig")
        registry.register(model_type="language_model", backend="own", devices=["cpu"],
                          engine="evil_SUFFIX:Engine", config="evil_SUFFIX:Config")
"""


def test_a_key_registered_twice_fails_loudly_and_withdraws_nobody(fake):
    # The entry-point name "aaa" sorts before "fake": it loads first and claims the official engine's key.
    hijack = fake.entry_point("aaa", fake.module("hijack", HIJACK_PLUGIN), "drivetrain-hijack", "6.6.6")
    loaded = get_plugin_manager(entry_points=[hijack, *_backend(fake)])
    assert {p.name: p.status for p in loaded.plugins} == {"aaa": "loaded", "fake": "loaded"}
    with pytest.raises(PluginError) as conflict:
        loaded.engines.get("language_model", "fake", "cpu")
    message = str(conflict.value)
    assert "engine language_model/fake/cpu is registered by several plugins" in message
    assert (
        "drivetrain-hijack 6.6.6 (plugin 'aaa'" in message
        and "drivetrain-engine-fake 1.2.3 (plugin 'fake'" in message
    )
    assert "DRIVETRAIN_DISABLE_PLUGINS=<name> (aaa or fake)" in message
    # Every other registration of both plugins stays; nothing was silently replaced or withdrawn.
    assert loaded.engines.get("language_model", "fake", "cuda").__name__ == "FakeEngine"
    assert {(e.backend, e.device, e.plugin) for e in loaded.engines.entries()} >= {
        ("fake", "cuda", "fake"),
        ("fake", "*", "fake"),
        ("own", "cpu", "aaa"),
    }
    assert loaded.mergers.names() == ["fake"]
    assert any("language_model/fake/cpu is registered by several plugins" in p for p in loaded.problems())
    by_name = {p.name: p for p in loaded.plugins}
    conflict_line = f"engine language_model/fake/cpu -> evil_{fake.suffix}:Engine (CONFLICT: also registered by another plugin)"
    assert conflict_line in by_name["aaa"].registered
    settled = get_plugin_manager(entry_points=[hijack, *_backend(fake)], disabled=["aaa"])
    assert settled.engines.get("language_model", "fake", "cpu").__name__ == "FakeEngine"
    same_name = get_plugin_manager(
        entry_points=[
            *_backend(fake),
            fake.entry_point("fake", fake.module("copycat", BACKEND_PLUGIN), "drivetrain-fork"),
        ]
    )
    assert [(p.distribution, p.status) for p in same_name.plugins] == [
        ("drivetrain-engine-fake", "loaded"),
        ("drivetrain-fork", "failed"),
    ]
    assert (
        "declared by both drivetrain-engine-fake 1.2.3 and drivetrain-fork 1.2.3"
        in same_name.plugins[1].error
    )
    assert same_name.plugins[1].registered == []


def test_commands_report_failed_plugins_and_conflicts_on_stderr(fake):
    broken = fake.entry_point(
        "broken", fake.module("broken", "raise RuntimeError('boom')\n"), "drivetrain-broken"
    )
    hijack = fake.entry_point("aaa", fake.module("hijack", HIJACK_PLUGIN), "drivetrain-hijack", "6.6.6")
    reset_plugins()
    try:
        plugins(lambda: get_plugin_manager(entry_points=[hijack, broken, *_backend(fake)]))
        result = CliRunner().invoke(build_cli(), ["engines"])
    finally:
        reset_plugins()
    assert result.exit_code == 0
    assert (
        "drivetrain: plugin 'broken' (drivetrain-broken 1.2.3) failed to load: RuntimeError: boom"
        in result.stderr
    )
    assert "drivetrain: engine language_model/fake/cpu is registered by several plugins" in result.stderr


def test_missing_engine_message(fake):
    loaded = get_plugin_manager(entry_points=_backend(fake))
    with pytest.raises(PluginError) as unknown_backend:
        loaded.engines.get("language_model", "fak", "cpu")
    message = str(unknown_backend.value)
    assert "model_type='language_model', backend='fak', device='cpu'" in message
    assert "language_model/fake/cpu (drivetrain-engine-fake 1.2.3)" in message
    assert "Did you mean backend 'fake'?" in message
    assert "pip install drivetrain-engine-fak" in message
    with pytest.raises(PluginError, match=r"supports devices \['cpu', 'cuda'\] .*Did you mean device 'cuda'"):
        loaded.engines.get("language_model", "fake", "cudaa")
    empty = get_plugin_manager(entry_points=[])
    with pytest.raises(PluginError, match=r"none .no engine plugin is installed"):
        empty.engines.get("language_model", "megatron", "cpu")
    with pytest.raises(PluginError, match=r"no role named 'critic'.*pip install drivetrain-roles"):
        loaded.roles.get("critic")


def test_lazy_target_errors_name_the_distribution(fake):
    bad = fake.module(
        "bad_target",
        """
        from drivetrain_engine_core._hookspecs import hookimpl

        @hookimpl
        def register_engines(registry):
            registry.register(model_type="language_model", backend="ghost", devices=["cpu"],
                              engine="no_such_module_xyz:Engine", config="no_such_module_xyz:Config")
        """,
    )
    loaded = get_plugin_manager(entry_points=[fake.entry_point("ghost", bad, "drivetrain-ghost", "0.3")])
    with pytest.raises(
        PluginError, match=r"registered by drivetrain-ghost 0.3.*No module named 'no_such_module_xyz'"
    ):
        loaded.engines.get("language_model", "ghost", "cpu")
    with pytest.raises(PluginError) as not_a_merger:
        get_plugin_manager(entry_points=_backend(fake)).mergers.get("fake")
    # The base as plugin authors import it, not the private module that defines it.
    assert str(not_a_merger.value).endswith(
        "does not subclass drivetrain_engine_core.backend.CheckpointMerger; subclass it "
        "(from drivetrain_engine_core.backend import CheckpointMerger)."
    )


def test_registration_arguments_are_validated():
    registry = get_plugin_manager(entry_points=[]).engines
    common = {"model_type": "language_model", "backend": "b", "engine": "m:E", "config": "m:C"}
    with pytest.raises(PluginError, match=r"devices must be a non-empty list"):
        registry.register(**common, devices="cpu")
    with pytest.raises(PluginError, match=r"model_type must be one of"):
        registry.register(**{**common, "model_type": "reward"}, devices=["cpu"])
    with pytest.raises(PluginError, match=r"'module:attr' string"):
        registry.register(**{**common, "engine": "no_colon"}, devices=["cpu"])


def test_factory_builds_engine_and_config(fake):
    loaded = get_plugin_manager(entry_points=_backend(fake))
    config = engine_config_from_dict(
        {"backend": "fake", "fake_knob": 3, "micro_batch": {"max_tokens": 64, "micro_batch_size": None}},
        plugins=loaded,
    )
    assert type(config).__name__ == "FakeConfig"
    assert (config.fake_knob, config.micro_batch.max_tokens) == (3, 64)
    engine = create_engine(model_config=ModelConfig(path="/m"), engine_config=config, plugins=loaded)
    assert type(engine).__name__ == "FakeEngine" and engine.engine_config is config
    with pytest.raises(ConfigError, match=r"unknown option engine.fake_knb.*Did you mean 'fake_knob'"):
        engine_config_from_dict({"backend": "fake", "fake_knb": 3}, plugins=loaded)
    with pytest.raises(ConfigError, match=r"backend 'fake' needs a .*FakeConfig"):
        create_engine(
            model_config=ModelConfig(path="/m"), engine_config=EngineConfig(backend="fake"), plugins=loaded
        )
    with pytest.raises(PluginError, match=r"pip install drivetrain-engine-fsdp"):
        engine_config_from_dict({}, plugins=get_plugin_manager(entry_points=[]))


FAILING_ROLES_HOOK = """
        @hookimpl
        def register_roles(registry):
            raise RuntimeError("boom in register_roles")
"""


def _engine_plugin(
    fake: FakePlugins,
    stem: str,
    *,
    model_type: str,
    devices: list[str],
    config: str = "FakeConfig",
    extra: str = "",
) -> str:
    """A plugin module registering the fake engine for ``model_type`` on backend ``fake`` with ``config``."""
    fake.module("fake_impl", IMPL)
    impl = f"fake_impl_{fake.suffix}"
    source = f"""
        from drivetrain_engine_core._hookspecs import hookimpl

        @hookimpl
        def register_engines(registry):
            registry.register(model_type={model_type!r}, backend="fake", devices={devices!r},
                              engine="{impl}:FakeEngine", config="{impl}:{config}")
"""
    return fake.module(stem, source + extra)


def test_a_failed_plugin_leaves_a_shared_backend_config_to_the_plugin_that_agreed_on_it(fake):
    """Two plugins add model types to one backend with the same config class; the first fails later in another hook
    and is withdrawn. It took the config class with it: the second plugin's engine was listed, not buildable."""
    first = _engine_plugin(
        fake, "first_half", model_type="language_model", devices=["*"], extra=FAILING_ROLES_HOOK
    )
    second = _engine_plugin(fake, "second_half", model_type="value_model", devices=["*"])
    loaded = get_plugin_manager(
        entry_points=[fake.entry_point("a", first, "dist-a"), fake.entry_point("b", second, "dist-b")]
    )
    assert [(p.name, p.status) for p in loaded.plugins] == [("a", "failed"), ("b", "loaded")]
    assert loaded.engines.config_class("fake").__name__ == "FakeConfig"
    assert [entry.config for entry in loaded.engines.entries()] == [f"fake_impl_{fake.suffix}:FakeConfig"]
    # A third plugin with another config class conflicts with both that agreed, and the conflict names both.
    other = _engine_plugin(
        fake, "other_config", model_type="language_model", devices=["cuda"], config="FakeEngine"
    )
    three = get_plugin_manager(
        entry_points=[
            fake.entry_point("a", first, "dist-a"),
            fake.entry_point("b", second, "dist-b"),
            fake.entry_point("c", other, "dist-c"),
        ]
    )
    with pytest.raises(PluginError, match=r"dist-b.*dist-c"):
        three.engines.config_class("fake")


def test_a_plugin_registering_a_key_twice_is_told_it_is_its_own_bug(fake):
    """The message read "registered twice: by X (plugin 'p') and by X (plugin 'p'). Uninstall one of them"."""
    twice = _engine_plugin(fake, "twice", model_type="language_model", devices=["cpu", "cpu"])
    (info,) = get_plugin_manager(entry_points=[fake.entry_point("dup", twice, "dist-dup")]).plugins
    assert info.status == "failed"
    assert (
        "plugin 'dup' (dist-dup 1.2.3) registers engine language_model/fake/cpu twice; each key" in info.error
    )
    assert "fix the plugin's hook" in info.error


def test_a_blocked_name_no_plugin_has_is_warned_about(fake, caplog):
    """``DRIVETRAIN_DISABLE_PLUGINS=role`` (for ``roles``) blocked nothing, with no word of it."""
    get_plugin_manager(entry_points=_backend(fake), disabled=["role", "fake"])
    assert "DRIVETRAIN_DISABLE_PLUGINS names ['role'], which no installed plugin is called" in caplog.text
    assert "the plugins are ['fake']" in caplog.text


def test_an_engine_class_must_carry_the_backend_name_it_is_registered_for(fake, monkeypatch):
    """Checkpoints record ``backend_name`` and ``ckpt merge/verify`` look the merger up by it: an engine that left
    it at the default ``""`` trained and saved steps that could not be merged."""
    loaded = get_plugin_manager(entry_points=_backend(fake))
    config = engine_config_from_dict({"backend": "fake"}, plugins=loaded)
    engine_cls = loaded.engines.get("language_model", "fake", "cpu")
    monkeypatch.setattr(engine_cls, "backend_name", "")
    with pytest.raises(
        PluginError, match=r"registered for backend 'fake' but its backend_name is ''.*= 'fake'"
    ):
        create_engine(model_config=ModelConfig(path="/m"), engine_config=config, plugins=loaded)


def test_process_wide_cache_and_reset():
    reset_plugins()
    first = plugins(lambda: get_plugin_manager(entry_points=[]))
    assert plugins() is first
    reset_plugins()
    assert plugins(lambda: get_plugin_manager(entry_points=[])) is not first
    reset_plugins()


def test_hook_calling_plugins_fails_instead_of_hanging(fake):
    greedy = fake.module(
        "greedy",
        """
        from drivetrain_engine_core._hookspecs import hookimpl
        from drivetrain_engine_core._plugins import plugins

        @hookimpl
        def register_roles(registry):
            plugins()
        """,
    )
    entry_points = [*_backend(fake), fake.entry_point("greedy", greedy, "drivetrain-greedy")]
    reset_plugins()
    try:
        loaded = plugins(lambda: get_plugin_manager(entry_points=entry_points))
    finally:
        reset_plugins()
    by_name = {p.name: p for p in loaded.plugins}
    assert by_name["fake"].status == "loaded"
    assert by_name["greedy"].error.startswith(
        "register_roles: drivetrain_engine_core._errors.PluginError: plugins() was"
    )
