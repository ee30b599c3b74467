"""``.ci/api_check.py`` on a throwaway git repository with one tiny distribution: a breaking change fails naming
the symbol until the version is bumped (a new minor in 0.x) and the changelog has that version's section; a
release tag becomes the new baseline; a ref the clone lacks is one clear message, not a traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="the API check reads releases from git")

RELEASES = """[tiny-dist]
path = "tiny"
version = "0.1.0"
ref = "{ref}"
api = ["tiny_api"]
hooks = ["tiny_api.hooks.Base"]
"""

HOOKS = """from abc import ABC, abstractmethod


class Base(ABC):
    @abstractmethod
    def _step(self, batch): ...
"""


CLI = """import click


@click.command(name="merge")
@click.argument("src")
@click.option("--json", "as_json", is_flag=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None)
def merge_command(src, as_json, dtype): ...
"""


class Repo:
    """A git repository holding ``.ci`` (the real check) and the distribution ``tiny`` (module ``tiny_api``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / ".ci").mkdir()
        for name in ("api_check.py", "releasing.py", "subclass_contract.py", "cli_contract.py"):
            shutil.copy(ROOT / ".ci" / name, root / ".ci" / name)
        self.git("init", "--quiet")
        self.write(version="0.1.0", source="def greet(name, punctuation='!'):\n    return name\n")
        self.write_releases("HEAD")
        self.commit("0.1.0")
        self.write_releases(self.git("rev-parse", "HEAD"))

    def git(self, *args: str) -> str:
        identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
        done = subprocess.run(
            ["git", *identity, *args], cwd=self.root, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    def write(
        self, *, version: str, source: str, notes: str = "", hooks: str = HOOKS, cli: str = CLI
    ) -> None:
        package = self.root / "tiny" / "src" / "tiny_api"
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(source)
        (package / "hooks.py").write_text(hooks)
        (package / "cli.py").write_text(cli)
        (self.root / "tiny" / "pyproject.toml").write_text(
            f'[project]\nname = "tiny-dist"\nversion = "{version}"\n'
        )
        (self.root / "tiny" / "CHANGELOG.md").write_text(f"# Changelog\n\n## Unreleased\n{notes}")

    def write_releases(self, ref: str) -> None:
        (self.root / ".ci" / "releases.toml").write_text(RELEASES.format(ref=ref))

    def commit(self, message: str) -> None:
        self.git("add", "-A")
        self.git("commit", "--quiet", "-m", message)

    def check(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, ".ci/api_check.py"], cwd=self.root, capture_output=True, text=True, check=False
        )


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo(tmp_path)


def test_a_break_fails_until_a_new_minor_and_its_changelog_section(repo):
    assert repo.check().returncode == 0
    renamed = "def greet(who, punctuation='!'):\n    return who\n"
    repo.write(version="0.1.0", source=renamed)
    failed = repo.check()
    assert failed.returncode == 1
    assert "FAIL tiny-dist 0.1.0: 2 breaking change(s) since 0.1.0" in failed.stdout
    assert "tiny/src/tiny_api/__init__.py:1: greet(name): Parameter was removed" in failed.stdout
    assert "greet(who): Parameter was added as required" in failed.stdout

    repo.write(version="0.1.1", source=renamed, notes="\n## 0.1.1\n\n- greet takes who.\n")
    assert repo.check().returncode == 1, "a patch release may not break"
    repo.write(version="0.2.0", source=renamed)
    assert repo.check().returncode == 1, "a bump without a changelog section is not enough"
    repo.write(version="0.2.0", source=renamed, notes="\n## 0.2.0 — 2026-11-27\n\n- greet takes who.\n")
    passed = repo.check()
    assert passed.returncode == 0, passed.stdout
    assert "ok   tiny-dist 0.2.0: 2 breaking change(s) since 0.1.0, released as 0.2.0" in passed.stdout


def test_a_hook_subclasses_implement_breaks_when_its_parameters_change_or_one_is_added(repo):
    """A keyword with a default is harmless to callers (griffe passes it) but not to an implementer."""
    source = "def greet(name, punctuation='!'):\n    return name\n"
    changed = HOOKS.replace("(self, batch)", "(self, batch, *, scale=1.0)")
    repo.write(
        version="0.1.0", source=source, hooks=changed + "\n    @abstractmethod\n    def _finish(self): ...\n"
    )
    failed = repo.check()
    assert failed.returncode == 1
    assert (
        "tiny_api.hooks.Base._step: hook parameters changed: (self, batch) -> (self, batch, *, scale=1.0)"
        in (failed.stdout)
    )
    assert "tiny_api.hooks.Base._finish: abstract method was added" in failed.stdout


def test_a_command_loses_an_option_a_choice_or_gains_a_required_argument(repo):
    source = "def greet(name, punctuation='!'):\n    return name\n"
    cli = (
        CLI.replace('"--json", ', "")
        .replace(', "bfloat16"', "")
        .replace('("src")', '("src")\n@click.argument("dst")')
    )
    repo.write(version="0.1.0", source=source, cli=cli)
    failed = repo.check()
    assert failed.returncode == 1
    for line in (
        "tiny_api.cli:merge: arguments changed: src -> src dst",
        "tiny_api.cli:merge: option --json was removed",
        "tiny_api.cli:merge: option --dtype lost choices ['bfloat16']",
    ):
        assert line in failed.stdout


def test_a_release_tag_is_the_new_baseline(repo):
    repo.write(version="0.2.0", source="def greet(who):\n    return who\n", notes="\n## 0.2.0\n\n- who.\n")
    repo.commit("0.2.0")
    repo.git("tag", "tiny-dist-v0.2.0")
    repo.write(
        version="0.2.0", source="def greet(who, loud):\n    return who\n", notes="\n## 0.2.0\n\n- who.\n"
    )
    failed = repo.check()
    assert failed.returncode == 1
    assert "since 0.2.0 (tiny-dist-v0.2.0)" in failed.stdout
    assert "greet(loud): Parameter was added as required" in failed.stdout


def test_a_recorded_tag_this_clone_lacks_is_the_commit_that_declared_the_version(repo):
    """``.ci/release`` records the tag it prints, and CI clones without tags: the check failed there until the
    recorded ref was replaced by hand with the release commit."""
    release_commit = repo.git("rev-parse", "HEAD")
    repo.write(version="0.1.0", source="def greet(name, punctuation='!', *, loud=False):\n    return name\n")
    repo.commit("a change after the release")
    repo.write(version="0.1.0", source="def greet(who):\n    return who\n")
    repo.write_releases("tiny-dist-v0.1.0")
    failed = repo.check()
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert "FAIL tiny-dist 0.1.0: 3 breaking change(s) since 0.1.0 (tiny-dist-v0.1.0)" in failed.stdout
    repo.git("tag", "tiny-dist-v0.1.0", release_commit)
    assert repo.check().stdout == failed.stdout


def test_a_missing_tag_or_commit_is_one_message(repo):
    repo.write(version="0.2.0", source="def greet(name, punctuation='!'):\n    return name\n")
    (repo.root / ".ci" / "releases.toml").write_text(
        RELEASES.format(ref="tiny-dist-v0.2.0").replace('version = "0.1.0"', 'version = "0.2.0"')
    )  # recorded by .ci/release.py, neither committed nor tagged yet
    untagged = repo.check()
    assert untagged.returncode == 1 and "Traceback" not in untagged.stderr
    assert untagged.stderr.startswith(
        "api-check: tiny-dist's last release is recorded as tag 'tiny-dist-v0.2.0', which does not exist, and no "
        "commit declares version 0.2.0. Commit the release, then create the tag on that commit "
        "(`git tag tiny-dist-v0.2.0 <commit>`"
    )
    repo.write(version="0.1.0", source="def greet(name, punctuation='!'):\n    return name\n")
    repo.write_releases("0123456789abcdef0123456789abcdef01234567")  # history a shallow clone lacks
    missing = repo.check()
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith("api-check: git ref '0123456789abcdef0123456789abcdef01234567'")
    assert "git fetch --unshallow --tags origin" in missing.stderr


def test_a_function_moved_behind_a_re_export_is_still_compared(repo):
    """Moving ``greet`` into a submodule that ``tiny_api`` re-exports is no break, but a change to it still is:
    griffe alone compared nothing once the released definition had become an alias."""
    moved = "from .greeting import greet\n\n__all__ = ['greet']\n"
    greeting = repo.root / "tiny" / "src" / "tiny_api" / "greeting.py"
    repo.write(version="0.1.0", source=moved)
    greeting.write_text("def greet(name, punctuation='!'):\n    return name\n")
    assert repo.check().returncode == 0
    greeting.write_text("def greet(name, punctuation='?'):\n    return name\n")
    failed = repo.check()
    assert failed.returncode == 1
    changed = "tiny/src/tiny_api/greeting.py:1: greet(punctuation): Parameter default was changed: '!' -> '?'"
    assert changed in failed.stdout
