"""A plugin whose declared core range does not admit the installed core is listed as incompatible, in one line,
and never imported; one whose range admits it loads. Ranges are written relative to the installed core's
version, so the tests hold across core releases."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from drivetrain_engine_core._plugin_compat import declared_core_range
from drivetrain_engine_core._plugins import get_plugin_manager, reset_plugins
from drivetrain_engine_core.backend import PluginError
from drivetrain_engine_core.job import build_cli, plugins
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint
from packaging.specifiers import SpecifierSet
from packaging.version import Version

CORE = Version(importlib.metadata.version("drivetrain-engine-core"))
THIS_MINOR = f">={CORE.major}.{CORE.minor},<{CORE.major}.{CORE.minor + 1}"
NEXT_MINOR = f">={CORE.major}.{CORE.minor + 1},<{CORE.major}.{CORE.minor + 2}"


def _entry_points() -> tuple[InMemoryEntryPoint, InMemoryEntryPoint]:
    """A plugin built for the next core minor (incompatible) and one built for this minor (compatible). The
    first raises if it is imported: it would be listed as failed, not incompatible."""
    newer = InMemoryEntryPoint(
        name="old",
        distribution="drivetrain-engine-old",
        version="0.3.0",
        requires=(f"drivetrain-engine-core[testing]{NEXT_MINOR}", "transformers>=4.56"),
        plugin=ImportError("an incompatible plugin was imported"),
    )
    fits = InMemoryEntryPoint(
        name="fits",
        distribution="drivetrain-engine-fits",
        version="0.3.0",
        requires=(f"drivetrain-engine-core{THIS_MINOR}", "torch>=2.11"),
        plugin=SimpleNamespace(),
    )
    return newer, fits


def test_a_plugin_outside_its_core_range_is_listed_incompatible_and_not_imported():
    newer, fits = _entry_points()
    loaded = get_plugin_manager(entry_points=[newer, fits], disabled=[])
    by_name = {p.name: p for p in loaded.plugins}
    assert (by_name["old"].status, by_name["fits"].status) == ("incompatible", "loaded")
    assert by_name["old"].traceback is None
    assert loaded.engines.backends() == []
    (line,) = loaded.problems()
    declared = SpecifierSet(NEXT_MINOR)
    assert line == (
        f"plugin 'old' (drivetrain-engine-old 0.3.0) is incompatible: requires drivetrain-engine-core{declared} "
        f"but drivetrain-engine-core {CORE} is installed, so it is not loaded. Install a release of it built for "
        f'this core: pip install --upgrade drivetrain-engine-old "drivetrain-engine-core=={CORE}" (or keep this '
        f'one and install the core it was built for: pip install "drivetrain-engine-core{declared}")'
    )
    with pytest.raises(PluginError, match=r"old \(drivetrain-engine-old 0.3.0\): requires"):
        loaded.engines.get("language_model", "old", "cpu")


def test_the_cli_reports_the_incompatible_plugin_in_one_line_and_keeps_working():
    newer, fits = _entry_points()
    reset_plugins()
    plugins(lambda: get_plugin_manager(entry_points=[newer, fits], disabled=[]))
    try:
        result = CliRunner().invoke(build_cli(), ["plugins"])
    finally:
        reset_plugins()
    assert result.exit_code == 0, result.output
    (stderr_line,) = result.stderr.splitlines()
    assert stderr_line.startswith("drivetrain: plugin 'old' (drivetrain-engine-old 0.3.0) is incompatible: ")
    assert "Traceback" not in result.output
    assert "old: drivetrain-engine-old 0.3.0 [incompatible] requires drivetrain-engine-core" in result.stdout
    assert "fits: drivetrain-engine-fits 0.3.0 [loaded]" in result.stdout


@pytest.mark.parametrize(
    ("requires", "expected"),
    [
        (["drivetrain-engine-core>=0.1,<0.2"], ">=0.1,<0.2"),
        (["Drivetrain_Engine_Core (>=0.2)"], ">=0.2"),
        (['drivetrain-engine-core>=0.5; extra == "next"', "drivetrain-engine-core<0.3"], "<0.3"),
        (["torch>=2.11"], None),
        (None, None),
    ],
)
def test_the_declared_range_comes_from_unconditional_requirements(requires, expected):
    found = declared_core_range(SimpleNamespace(requires=requires))
    assert found == (None if expected is None else SpecifierSet(expected))


def test_an_installed_plugin_declares_the_range_core_admits():
    """The real metadata path: each installed first-party plugin's range admits the installed core."""
    names = ("drivetrain-engine-fsdp", "drivetrain-roles", "drivetrain-ckpt-tools")
    for name in names:
        found = declared_core_range(importlib.metadata.distribution(name))
        assert found is not None and found.contains(CORE, prereleases=True), (name, found)
