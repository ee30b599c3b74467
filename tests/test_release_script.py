"""``.ci/release.py``: the changelog move and the range update as functions, then a whole cut of core's next
minor on a temporary copy of the distributions' pyproject.toml and CHANGELOG.md files."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

from release import add_to_ledger, move_unreleased, update_ranges  # noqa: E402
from releasing import load_releases, project_version  # noqa: E402

CHANGELOG = """# Changelog

## Unreleased

- `make_batch` takes `ids`.

- Faster packing.

## 0.1.0 — 2026-01-02

- First release.
"""


def test_the_unreleased_entries_move_under_the_dated_version():
    moved = move_unreleased(CHANGELOG, Version("0.2.0"), datetime.date(2026, 11, 27))
    assert moved == (
        "# Changelog\n\n## Unreleased\n\n## 0.2.0 — 2026-11-27\n\n- `make_batch` takes `ids`.\n\n"
        "- Faster packing.\n\n## 0.1.0 — 2026-01-02\n\n- First release.\n"
    )


def test_an_empty_unreleased_section_is_refused():
    empty = "# Changelog\n\n## Unreleased\n\n## 0.1.0 — 2026-01-02\n\n- First release.\n"
    with pytest.raises(SystemExit, match="no entries"):
        move_unreleased(empty, Version("0.2.0"), datetime.date(2026, 11, 27))


def test_requirements_that_exclude_the_new_version_get_its_range():
    pyproject = (
        'dependencies = [\n    "drivetrain-engine-core>=0.1,<0.2",\n    "drivetrain-engine-core-extra>=0.1",\n]\n'
        "toy = [\"drivetrain-engine-core[testing]>=0.1,<0.2; python_version >= '3.11'\"]\n"
        'later = ["drivetrain-engine-core>=0.2,<0.3"]\n'
    )
    assert update_ranges(pyproject, "drivetrain-engine-core", Version("0.2.0")) == (
        'dependencies = [\n    "drivetrain-engine-core>=0.2,<0.3",\n    "drivetrain-engine-core-extra>=0.1",\n]\n'
        "toy = [\"drivetrain-engine-core[testing]>=0.2,<0.3; python_version >= '3.11'\"]\n"
        'later = ["drivetrain-engine-core>=0.2,<0.3"]\n'
    )
    admitted = pyproject.partition("later")[0]
    assert update_ranges(admitted, "drivetrain-engine-core", Version("0.1.5")) == admitted


def test_a_cut_is_appended_to_the_ledger_once():
    ledger = '[released]\n"d 0.1.0" = "0123456789ab"\n\n[declared_earlier]\n"d 0.1.0" = "ba9876543210"\n'
    assert add_to_ledger(ledger, "d", Version("0.1.1")) == ledger.replace(
        '"\n\n[declared', '"\n"d 0.1.1" = "d-v0.1.1"\n\n[declared'
    )
    with pytest.raises(SystemExit, match=r"d 0\.1\.0 was already released"):
        add_to_ledger(ledger, "d", Version("0.1.0"))


def _copy_of_the_workspace(tmp_path: Path) -> Path:
    """The files a cut reads and writes, copied under ``tmp_path`` in the repository's layout."""
    shutil.copytree(ROOT / ".ci", tmp_path / ".ci", ignore=shutil.ignore_patterns("__pycache__"))
    for release in load_releases():
        for name in ("pyproject.toml", "CHANGELOG.md"):
            (tmp_path / release.path).mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / release.path / name, tmp_path / release.path / name)
    return tmp_path


def test_cutting_the_next_core_minor_moves_every_plugin_range(tmp_path):
    copy = _copy_of_the_workspace(tmp_path)
    core = project_version((ROOT / "packages/engine-core/pyproject.toml").read_text())
    new = Version(f"{core.major}.{core.minor + 1}.0")
    # Right after a release core's `## Unreleased` is empty, which the script refuses: give the copy an entry.
    changelog = copy / "packages/engine-core/CHANGELOG.md"
    changelog.write_text(
        changelog.read_text().replace("## Unreleased\n", "## Unreleased\n\n- A change.\n", 1)
    )
    done = subprocess.run(
        [sys.executable, ".ci/release.py", "engine-core", str(new), "--date", "2026-11-27"],
        cwd=copy, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"git tag drivetrain-engine-core-v{new}" in done.stdout

    assert project_version((copy / "packages/engine-core/pyproject.toml").read_text()) == new
    notes = (copy / "packages/engine-core/CHANGELOG.md").read_text()
    assert notes.startswith(f"# Changelog\n\n## Unreleased\n\n## {new} — 2026-11-27\n\n")
    releases = tomllib.loads((copy / ".ci/releases.toml").read_text())["drivetrain-engine-core"]
    assert (releases["version"], releases["ref"]) == (str(new), f"drivetrain-engine-core-v{new}")
    ledger = (copy / ".ci/released.toml").read_text()
    assert ledger == (ROOT / ".ci/released.toml").read_text() + (
        f'"drivetrain-engine-core {new}" = "drivetrain-engine-core-v{new}"\n'
    )

    wanted = f">={new.major}.{new.minor},<{new.major}.{new.minor + 1}"
    plugins = [r for r in load_releases() if r.distribution != "drivetrain-engine-core"]
    for plugin in plugins:
        project = tomllib.loads((copy / plugin.path / "pyproject.toml").read_text())["project"]
        (requirement,) = [
            r for r in map(Requirement, project["dependencies"]) if r.name == "drivetrain-engine-core"
        ]
        assert requirement.specifier == SpecifierSet(wanted), plugin.distribution
        sibling_notes = (copy / plugin.path / "CHANGELOG.md").read_text()
        assert f"## Unreleased\n\n- Requires drivetrain-engine-core `{wanted}` ({new}).\n" in sibling_notes
