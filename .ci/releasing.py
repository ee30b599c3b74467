"""What the release tools share: the last releases (``.ci/releases.toml``), versions, tags and changelogs.

Used by ``.ci/api_check.py`` (is a breaking change matched by a version bump and a changelog entry?) and
``.ci/release.py`` (cut a version). Standard library and ``packaging`` only; docs/versioning.md is the policy.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ROOT / ".ci" / "releases.toml"
LEDGER = ROOT / ".ci" / "released.toml"
CORE = "drivetrain-engine-core"


@dataclass(kw_only=True, frozen=True)
class Release:
    """One distribution's last release, as ``releases.toml`` records it.

    Attributes:
        distribution: its name on the index, e.g. ``drivetrain-engine-core``.
        path: its folder, relative to the repository root.
        version: the last released version.
        ref: the git ref that release was cut from (a commit or its tag); empty for a distribution never cut
            (``version = "0.0.0"``, ``ref = ""`` until ``.ci/release.py`` cuts its first version).
        api: modules whose public names are its Python API.
        hooks: what subclasses implement: classes (their abstract methods) and single overridable methods.
    """

    distribution: str
    path: str
    version: Version
    ref: str
    api: tuple[str, ...]
    hooks: tuple[str, ...] = ()

    @property
    def released(self) -> bool:
        """Whether a version of it was ever cut."""
        return bool(self.ref)


def load_releases(file: Path = RELEASES) -> list[Release]:
    """Every distribution's last release, in the file's order."""
    table = tomllib.loads(file.read_text())
    return [
        Release(
            distribution=name,
            path=entry["path"],
            version=Version(entry["version"]),
            ref=entry["ref"],
            api=tuple(entry["api"]),
            hooks=tuple(entry.get("hooks", ())),
        )
        for name, entry in table.items()
    ]


@dataclass(kw_only=True, frozen=True)
class Ledger:
    """``released.toml``: every release ever cut, never changed once recorded (docs/versioning.md).

    Attributes:
        released: ``"<distribution> <version>"`` -> the commit it was cut from, or its tag (which stands for the
            commit that first declared the version, :func:`ref_commit`).
        declared_earlier: the releases cut before the ledger existed from a commit other than the first to
            declare their version, each mapped to that first commit.
    """

    released: dict[str, str]
    declared_earlier: dict[str, str]


def load_ledger(text: str) -> Ledger:
    """The ledger in ``text`` (``released.toml``'s content at some commit)."""
    table = tomllib.loads(text)
    return Ledger(released=table.get("released", {}), declared_earlier=table.get("declared_earlier", {}))


def release_key(distribution: str, version: Version | str) -> str:
    """A release's key in the ledger: ``"<distribution> <version>"``."""
    return f"{distribution} {version}"


def find_release(releases: list[Release], name: str) -> Release:
    """The release named by its distribution (``drivetrain-roles``), folder (``roles``, ``packages/roles``) or a
    distinct end of its name (``core``, ``fsdp``).

    Raises:
        SystemExit: no distribution has that name, listing the ones there are.
    """
    for release in releases:
        if name in (release.distribution, release.path, Path(release.path).name):
            return release
    suffixed = [r for r in releases if r.distribution.endswith(f"-{name}")]
    if len(suffixed) == 1:
        return suffixed[0]
    known = ", ".join(r.distribution for r in releases)
    raise SystemExit(f"no distribution {name!r} in {RELEASES.relative_to(ROOT)}; there are: {known}")


def tag_name(distribution: str, version: Version | str) -> str:
    """The tag a release is cut at: ``<distribution>-v<version>``."""
    return f"{distribution}-v{version}"


def project_version(pyproject: str) -> Version:
    """The static ``[project] version`` of a pyproject.toml's text."""
    return Version(tomllib.loads(pyproject)["project"]["version"])


def git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``git *args`` in ``root``, its output captured, a failure returned rather than raised."""
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)


def has_commit(ref: str, root: Path = ROOT) -> bool:
    """Whether ``ref`` (a commit, tag or branch) names a commit in ``root``'s clone."""
    return git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", root=root).returncode == 0


def tag_commit(distribution: str, version: Version, root: Path = ROOT) -> str | None:
    """The commit ``distribution``'s release tag for ``version`` points at, or None where the clone lacks it."""
    tag = tag_name(distribution, version)
    return git("rev-parse", f"{tag}^{{commit}}", root=root).stdout.strip() if has_commit(tag, root) else None


def declared_versions(path: str, root: Path = ROOT) -> dict[Version, str]:
    """Each version ``<path>/pyproject.toml`` ever declared, mapped to the first commit that declared it."""
    pyproject = f"{path}/pyproject.toml"
    first: dict[Version, str] = {}
    for commit in git("log", "--reverse", "--format=%H", "--", pyproject, root=root).stdout.split():
        text = git("show", f"{commit}:{pyproject}", root=root)
        if text.returncode == 0:
            first.setdefault(project_version(text.stdout), commit)
    return first


def cut_commit(distribution: str, path: str, version: Version, root: Path = ROOT) -> str | None:
    """The commit ``distribution`` ``version`` was cut from, or None where this clone's history lacks it.

    Its tag where the clone has it; otherwise the first commit whose ``<path>/pyproject.toml`` declares that
    version, which is the cut itself (``.ci/release`` sets the version in the release commit, and the tag is
    created on that commit). A clone without tags (CI's) needs the second: ``releases.toml`` records only each
    distribution's last cut, and a plugin's core floor may be an older one.
    """
    return tag_commit(distribution, version, root) or declared_versions(path, root).get(version)


def ref_commit(ref: str, distribution: str, path: str, version: Version, root: Path = ROOT) -> str | None:
    """The full commit of ``ref`` (a commit or tag) recorded for ``distribution`` ``version``; where the clone
    lacks it and it is that version's release tag, the commit :func:`cut_commit` finds; else None."""
    if has_commit(ref, root):
        return git("rev-parse", f"{ref}^{{commit}}", root=root).stdout.strip()
    return cut_commit(distribution, path, version, root) if ref == tag_name(distribution, version) else None


def allows_breaking(old: Version, new: Version) -> bool:
    """Whether going from ``old`` to ``new`` may break the API: a new minor in 0.x, a new major from 1.0 on."""
    if old.major == 0 and new.major == 0:
        return new.minor > old.minor
    return new.major > old.major


def changelog_section(changelog: str, version: Version | str) -> str | None:
    """The body under ``## <version>`` (whatever follows it on the heading line, e.g. a date), or None."""
    heading = re.compile(rf"^## {re.escape(str(version))}(?:\s.*)?$", re.MULTILINE)
    found = heading.search(changelog)
    if found is None:
        return None
    after = changelog[found.end() :]
    following = re.search(r"^## ", after, re.MULTILINE)
    return after[: following.start() if following else len(after)]
