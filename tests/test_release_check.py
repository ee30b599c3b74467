"""``.ci/release_check.py`` on a throwaway git repository whose one distribution is cut with the real
``.ci/release.py``: the cut passes with and without its tag; a release re-recorded at a later commit (as
drivetrain-roles 0.3.5 was), a moved tag, a ``releases.toml`` ref that left the ledger, a removed entry and a new
exception each fail with one line naming the release, the commits and the fix."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="the release check reads git history")

RELEASES = """[tiny-dist]
path = "tiny"
version = "0.1.0"
ref = "{ref}"
api = []
"""

OK = "ok   {count} releases in .ci/released.toml: none changed, each at its release commit\n"
NEVER_CHANGES = "A released version never changes: cut a new patch version for what changed."


class Repo:
    """A git repository holding ``.ci`` (the real release tools) and the distribution ``tiny``, with 0.1.0 cut
    at its first commit and 0.1.1 cut by ``.ci/release.py`` after a fix."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / ".ci").mkdir(parents=True)
        for name in ("release.py", "release_check.py", "releasing.py"):
            shutil.copy(ROOT / ".ci" / name, root / ".ci" / name)
        self.git("init", "--quiet")
        self.write_version("0.1.0", "- First.")
        self.commit("release: tiny-dist 0.1.0")
        self.first = self.git("rev-parse", "HEAD")
        (root / ".ci" / "releases.toml").write_text(RELEASES.format(ref=self.first[:12]))
        self.ledger.write_text(f'[released]\n"tiny-dist 0.1.0" = "{self.first[:12]}"\n')
        self.commit("ledger: tiny-dist 0.1.0")
        self.write_version("0.1.0", "- A fix.")
        self.commit("a fix")
        self.run(".ci/release.py", "tiny", "0.1.1", "--date", "2026-11-28")
        self.commit("release: tiny-dist 0.1.1")
        self.cut = self.git("rev-parse", "HEAD")

    @property
    def ledger(self) -> Path:
        return self.root / ".ci" / "released.toml"

    def git(self, *args: str) -> str:
        identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
        done = subprocess.run(
            ["git", *identity, *args], cwd=self.root, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    def write_version(self, version: str, entry: str) -> None:
        (self.root / "tiny").mkdir(exist_ok=True)
        (self.root / "tiny" / "pyproject.toml").write_text(
            f'[project]\nname = "tiny-dist"\nversion = "{version}"\n'
        )
        (self.root / "tiny" / "CHANGELOG.md").write_text(f"# Changelog\n\n## Unreleased\n\n{entry}\n")

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "--quiet", "-m", message)
        return self.git("rev-parse", "HEAD")

    def run(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, *args], cwd=cwd or self.root, capture_output=True, text=True, check=False
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done

    def check(self, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(".ci/release_check.py", cwd=cwd)

    def tagless_clone(self) -> Path:
        clone = self.root.parent / "clone"
        subprocess.run(["git", "clone", "-q", "--no-tags", str(self.root), str(clone)], check=True)
        return clone


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo(tmp_path / "repo")


def test_a_cut_is_recorded_by_its_tag_and_found_with_and_without_it(repo):
    assert repo.ledger.read_text().endswith('"tiny-dist 0.1.1" = "tiny-dist-v0.1.1"\n')
    assert 'ref = "tiny-dist-v0.1.1"' in (repo.root / ".ci" / "releases.toml").read_text()
    passed = repo.check()
    assert passed.returncode == 0, passed.stdout
    assert passed.stdout == "ok   2 releases in .ci/released.toml: none changed, each at its release commit\n"
    repo.git("tag", "tiny-dist-v0.1.1", repo.cut)
    assert repo.check().returncode == 0
    again = repo.run(".ci/release.py", "tiny", "0.1.1")
    assert again.returncode == 1 and "0.1.1 is not after tiny-dist's last release 0.1.1" in again.stderr


def test_a_release_re_recorded_at_a_later_commit_fails_with_and_without_tags(repo):
    """drivetrain-roles 0.3.5 was cut, then a fix was committed and the tag and both records moved onto it."""
    repo.write_version("0.1.1", "- A fix after the cut.")
    fix = repo.commit("a fix after the cut")
    repo.git("tag", "tiny-dist-v0.1.1", fix)
    (repo.root / ".ci" / "releases.toml").write_text(RELEASES.format(ref=fix[:12]).replace("0.1.0", "0.1.1"))
    repo.ledger.write_text(repo.ledger.read_text().replace('"tiny-dist-v0.1.1"', f'"{fix[:12]}"'))
    repo.commit("releases: tiny-dist 0.1.1 re-recorded at its fixed commit")
    expected = [
        f"FAIL tiny-dist 0.1.1: [released] of .ci/released.toml recorded it at tiny-dist-v0.1.1 in "
        f"{repo.cut[:12]}, now at {fix[:12]}: restore it. {NEVER_CHANGES}",
        f"FAIL tiny-dist 0.1.1: recorded at {fix[:12]} in .ci/released.toml, but the first commit declaring it is "
        f"{repo.cut[:12]} in tiny/pyproject.toml (a release is cut from the commit that first declares its "
        f"version): record {repo.cut[:12]}. {NEVER_CHANGES}",
    ]
    failed = repo.check()
    assert (failed.returncode, failed.stdout.splitlines()) == (1, expected)
    tagless = repo.check(cwd=repo.tagless_clone())
    assert (tagless.returncode, tagless.stdout.splitlines()) == (1, expected)


def test_a_moved_tag_fails_where_the_clone_has_it(repo):
    repo.write_version("0.1.1", "- A fix after the cut.")
    fix = repo.commit("a fix after the cut")
    repo.git("tag", "tiny-dist-v0.1.1", fix)
    failed = repo.check()
    assert failed.returncode == 1
    assert failed.stdout == (
        f"FAIL tiny-dist 0.1.1: its tag tiny-dist-v0.1.1 points at {fix[:12]}, but it was cut from "
        f"{repo.cut[:12]} (.ci/released.toml): put the tag back (`git tag -f tiny-dist-v0.1.1 {repo.cut[:12]}`). "
        f"{NEVER_CHANGES}\n"
    )
    assert repo.check(cwd=repo.tagless_clone()).returncode == 0


def test_a_last_release_moved_in_releases_toml_alone_fails(repo):
    fix = repo.git("rev-parse", "HEAD~1")
    releases = repo.root / ".ci" / "releases.toml"
    releases.write_text(RELEASES.format(ref=fix[:12]).replace("0.1.0", "0.1.1"))
    failed = repo.check()
    assert failed.returncode == 1
    assert failed.stdout == (
        f"FAIL tiny-dist 0.1.1: .ci/releases.toml records it at {fix[:12]}, .ci/released.toml at "
        f'{repo.cut[:12]}: set its ref = "tiny-dist-v0.1.1" there. {NEVER_CHANGES}\n'
    )
    releases.write_text(RELEASES.format(ref="tiny-dist-v0.1.2").replace("0.1.0", "0.1.2"))
    assert "FAIL tiny-dist 0.1.2: .ci/releases.toml records it as the last release" in repo.check().stdout


def test_an_entry_removed_or_an_exception_added_later_fails(repo):
    repo.ledger.write_text(
        f'[declared_earlier]\n"tiny-dist 0.1.0" = "{repo.first[:12]}"\n\n'
        f'[released]\n"tiny-dist 0.1.1" = "tiny-dist-v0.1.1"\n'
    )
    failed = repo.check()
    assert failed.returncode == 1
    first_ledger = repo.git("rev-parse", "HEAD~2")
    assert failed.stdout.splitlines() == [
        f"FAIL tiny-dist 0.1.0: [released] of .ci/released.toml recorded it at {repo.first[:12]} in "
        f"{first_ledger[:12]}, now removed: restore it. {NEVER_CHANGES}",
        f"FAIL tiny-dist 0.1.0: [declared_earlier] lists it (first declared at {repo.first[:12]}), but "
        f".ci/released.toml's first version ({first_ledger[:12]}) did not; only releases cut before the ledger "
        f"may be there: remove it. {NEVER_CHANGES}",
    ]


def test_a_distribution_never_cut_has_no_last_release_until_its_first_cut(repo):
    """``version = "0.0.0"``, ``ref = ""``: a new distribution (an example at 0.1.0, unreleased) is listed with no
    last release to hold to; ``.ci/release.py`` cuts its first version like any other, and the check holds it."""
    releases = repo.root / ".ci" / "releases.toml"
    releases.write_text(
        releases.read_text() + '\n[new-dist]\npath = "new"\nversion = "0.0.0"\nref = ""\napi = []\n'
    )
    (repo.root / "new").mkdir()
    (repo.root / "new" / "pyproject.toml").write_text('[project]\nname = "new-dist"\nversion = "0.1.0"\n')
    (repo.root / "new" / "CHANGELOG.md").write_text("# Changelog\n\n## Unreleased\n\n- First.\n")
    repo.commit("new-dist, not released")
    done = repo.check()
    assert (done.returncode, done.stdout) == (0, OK.format(count=2))
    assert repo.run(".ci/release.py", "new", "0.1.0", "--date", "2026-11-29").returncode == 0
    repo.commit("release: new-dist 0.1.0")
    assert 'version = "0.1.0"\nref = "new-dist-v0.1.0"' in releases.read_text()
    done = repo.check()
    assert (done.returncode, done.stdout) == (0, OK.format(count=3))
