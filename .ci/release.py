"""Cut one distribution's version: bump it, date its changelog, move its siblings' ranges, print the tag.

    uv run python .ci/release.py DISTRIBUTION VERSION [--date YYYY-MM-DD]

DISTRIBUTION is a name (``drivetrain-engine-core``) or folder (``engine-core``). It sets ``version`` in the
distribution's pyproject.toml; moves its CHANGELOG.md's ``## Unreleased`` entries under ``## VERSION — DATE``
(leaving an empty ``## Unreleased``); where VERSION leaves the range siblings require (a new core minor), rewrites
every workspace requirement on it to the new range and notes that in the sibling's changelog; records the release
in ``.ci/releases.toml`` and appends it to the ledger of every release, ``.ci/released.toml``, as the tag it prints
(the release commit does not exist yet; the tag stands for the commit that first declares the version, which a
clone without tags finds too). It edits files only: review, ``uv lock``, commit, ``.ci/run``, then create the tag
it prints (docs/versioning.md, "Cutting a release").
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from releasing import (
    LEDGER,
    RELEASES,
    ROOT,
    Release,
    find_release,
    load_ledger,
    load_releases,
    project_version,
    release_key,
    tag_name,
)

UNRELEASED = re.compile(r"^## Unreleased[^\n]*\n", re.MULTILINE)


def compatible_range(version: Version) -> str:
    """The range a sibling requires of ``version``: its minor in 0.x (``>=0.2,<0.3``), its major from 1.0."""
    if version.major == 0:
        return f">=0.{version.minor},<0.{version.minor + 1}"
    return f">={version.major}.{version.minor},<{version.major + 1}"


def set_version(pyproject: str, version: Version) -> str:
    """``pyproject`` with its ``[project]`` version set to ``version``."""
    head, project, rest = pyproject.partition("[project]")
    updated, count = re.subn(r'(?m)^version = "[^"]*"', f'version = "{version}"', rest, count=1)
    if not project or count != 1:
        raise SystemExit(
            'release: no static `version = "..."` under [project]; drivetrain versions are static.'
        )
    return head + project + updated


def move_unreleased(changelog: str, version: Version, date: datetime.date) -> str:
    """``changelog`` with the ``## Unreleased`` entries under a new ``## <version> — <date>`` heading.

    Raises:
        SystemExit: there is no ``## Unreleased`` section, or it has no entries (nothing to release).
    """
    found = UNRELEASED.search(changelog)
    if found is None:
        raise SystemExit("release: the changelog has no `## Unreleased` section to release.")
    following = re.search(r"^## ", changelog[found.end() :], re.MULTILINE)
    end = found.end() + following.start() if following else len(changelog)
    entries = changelog[found.end() : end].strip()
    if not entries:
        raise SystemExit("release: `## Unreleased` has no entries; say what the release changes first.")
    released = f"## Unreleased\n\n## {version} — {date.isoformat()}\n\n{entries}\n\n"
    return changelog[: found.start()] + released + changelog[end:].lstrip("\n")


def add_unreleased_entry(changelog: str, entry: str) -> str:
    """``changelog`` with ``entry`` (a markdown list item) first under ``## Unreleased``."""
    found = UNRELEASED.search(changelog)
    if found is None:
        raise SystemExit(
            "release: a sibling's changelog has no `## Unreleased` section for the range change."
        )
    return changelog[: found.end()] + f"\n{entry}\n" + changelog[found.end() :]


def update_ranges(pyproject: str, distribution: str, version: Version) -> str:
    """``pyproject`` with each quoted requirement on ``distribution`` that excludes ``version`` set to its
    :func:`compatible_range` (extras and markers kept); requirements that admit it are left alone."""
    requirement = re.compile(
        rf'"(?P<name>{re.escape(distribution)})(?=[\[<>=!~;" ])(?P<extras>\[[^\]]*\])?(?P<spec>[^";]*)'
        r'(?P<marker>;[^"]*)?"'
    )

    def replace(match: re.Match[str]) -> str:
        if SpecifierSet(match["spec"]).contains(version, prereleases=True):
            return match[0]
        marker = match["marker"] or ""
        return f'"{match["name"]}{match["extras"] or ""}{compatible_range(version)}{marker}"'

    return requirement.sub(replace, pyproject)


def set_release(releases: str, distribution: str, version: Version, ref: str) -> str:
    """``releases.toml``'s text with ``distribution``'s ``version`` and ``ref`` set."""
    start = releases.index(f"[{distribution}]\n")
    following = releases.find("\n[", start + 1)
    end = len(releases) if following == -1 else following
    table = re.sub(r'(?m)^version = "[^"]*"', f'version = "{version}"', releases[start:end], count=1)
    table = re.sub(r'(?m)^ref = "[^"]*"', f'ref = "{ref}"', table, count=1)
    return releases[:start] + table + releases[end:]


def add_to_ledger(ledger: str, distribution: str, version: Version) -> str:
    """``released.toml``'s text with ``distribution`` ``version`` appended to ``[released]`` as its tag.

    Raises:
        SystemExit: the ledger already lists that release (a released version is never cut again).
    """
    key = release_key(distribution, version)
    if key in load_ledger(ledger).released:
        raise SystemExit(
            f"release: {key} was already released ({LEDGER.relative_to(ROOT)}); a released version never "
            "changes: pick a higher version."
        )
    start = ledger.index("[released]\n")
    following = ledger.find("\n[", start)
    end = len(ledger[: len(ledger) if following == -1 else following].rstrip("\n"))
    return ledger[:end] + f'\n"{key}" = "{tag_name(distribution, version)}"' + ledger[end:]


def cut(release: Release, releases: list[Release], version: Version, date: datetime.date) -> list[str]:
    """Edit the files for ``release`` at ``version``; returns the siblings whose range on it moved."""
    folder = ROOT / release.path
    pyproject = folder / "pyproject.toml"
    current = project_version(pyproject.read_text())
    if version <= release.version or version < current:
        raise SystemExit(
            f"release: {version} is not after {release.distribution}'s last release {release.version} and its "
            f"version in pyproject.toml ({current}); pick a higher version."
        )
    ledger = add_to_ledger(LEDGER.read_text(), release.distribution, version)
    pyproject.write_text(set_version(pyproject.read_text(), version))
    changelog = folder / "CHANGELOG.md"
    changelog.write_text(move_unreleased(changelog.read_text(), version, date))
    moved = []
    for sibling in releases:
        path = ROOT / sibling.path / "pyproject.toml"
        before = path.read_text()
        after = update_ranges(before, release.distribution, version)
        if after != before:
            path.write_text(after)
            moved.append(sibling.distribution)
            if sibling is not release:
                notes = ROOT / sibling.path / "CHANGELOG.md"
                entry = f"- Requires {release.distribution} `{compatible_range(version)}` ({version})."
                notes.write_text(add_unreleased_entry(notes.read_text(), entry))
    RELEASES.write_text(
        set_release(
            RELEASES.read_text(), release.distribution, version, tag_name(release.distribution, version)
        )
    )
    LEDGER.write_text(ledger)
    return moved


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("distribution")
    parser.add_argument("version", type=Version)
    parser.add_argument("--date", type=datetime.date.fromisoformat, default=datetime.date.today())
    args = parser.parse_args(argv)
    releases = load_releases()
    release = find_release(releases, args.distribution)
    moved = cut(release, releases, args.version, args.date)
    tag = tag_name(release.distribution, args.version)
    print(
        f"{release.distribution} {args.version}: version, CHANGELOG.md, {RELEASES.relative_to(ROOT)} and "
        f"{LEDGER.relative_to(ROOT)} updated."
    )
    others = [name for name in moved if name != release.distribution]
    if others:
        print(
            f"Range on it moved to {compatible_range(args.version)} in: {', '.join(others)}; cut those too."
        )
    print(
        "Next: uv lock; review `git diff`; fix prose naming the old range (grep the docs and READMEs); commit;"
    )
    print(
        f"then .ci/run (amend the commit until it passes); then: git tag {tag} and push the tag with the commit. "
        "From then on it never changes: a later fix is a new version."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
