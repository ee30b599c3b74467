"""Released versions never change: every release in ``.ci/released.toml`` keeps the commit it was cut from.

Three rules (docs/versioning.md, Release policy); each violation is one line naming the release, the commits
and the fix, and the exit status is 1:

1. The ledger only grows: every entry an earlier commit of ``released.toml`` recorded is still there,
   unchanged, and ``declared_earlier`` (the exceptions cut before the ledger) lists nothing its first version
   did not.
2. Each release's commit is in this clone's history and is the commit that first declared its version in the
   distribution's pyproject.toml; where the clone has the release tag, the tag points at it too.
3. Each distribution's last release in ``releases.toml`` is in the ledger, at the same commit.

    uv run --all-packages --locked python .ci/release_check.py
"""

from __future__ import annotations

import sys

from packaging.version import InvalidVersion, Version
from releasing import (
    LEDGER,
    RELEASES,
    ROOT,
    Ledger,
    Release,
    declared_versions,
    git,
    load_ledger,
    load_releases,
    ref_commit,
    release_key,
    tag_commit,
    tag_name,
)

LEDGER_PATH = LEDGER.relative_to(ROOT).as_posix()
# Each distribution's versions, each mapped to the first commit that declared it (releasing.declared_versions).
Declared = dict[str, dict[Version, str]]
NEVER_CHANGES = "A released version never changes: cut a new patch version for what changed."


def ledger_history() -> list[tuple[str, Ledger]]:
    """Every committed version of the ledger (side branches' too), oldest first, with its commit."""
    commits = git("log", "--full-history", "--reverse", "--format=%H", "--", LEDGER_PATH).stdout.split()
    shown = ((commit, git("show", f"{commit}:{LEDGER_PATH}")) for commit in commits)
    return [(commit, load_ledger(text.stdout)) for commit, text in shown if text.returncode == 0]


def changed_entries(now: Ledger, history: list[tuple[str, Ledger]]) -> list[str]:
    """Rule 1: recorded entries that changed or disappeared, and exceptions added after the first version."""
    first: dict[tuple[str, str], tuple[str, str]] = {}
    for commit, then in history:
        for table, entries in (("released", then.released), ("declared_earlier", then.declared_earlier)):
            for key, ref in entries.items():
                first.setdefault((table, key), (ref, commit))
    problems = []
    for (table, key), (ref, commit) in first.items():
        current = getattr(now, table).get(key)
        if current != ref:
            problems.append(
                f"FAIL {key}: [{table}] of {LEDGER_PATH} recorded it at {ref} in {commit[:12]}, now "
                f"{'at ' + current if current else 'removed'}: restore it. {NEVER_CHANGES}"
            )
    origin, original = history[0] if history else ("", now)
    for key, ref in now.declared_earlier.items():
        if key not in original.declared_earlier:
            problems.append(
                f"FAIL {key}: [declared_earlier] lists it (first declared at {ref}), but {LEDGER_PATH}'s first "
                f"version ({origin[:12]}) did not; only releases cut before the ledger may be there: remove it. "
                f"{NEVER_CHANGES}"
            )
    return problems


def entry_release(key: str, releases: dict[str, Release]) -> tuple[Release, Version]:
    """The distribution and version a ledger key names.

    Raises:
        ValueError: the key is not ``"<distribution> <version>"`` of a distribution in ``releases.toml``.
    """
    distribution, _, version = key.partition(" ")
    if distribution not in releases:
        known = ", ".join(releases)
        raise ValueError(
            f"no distribution {distribution!r} in {RELEASES.relative_to(ROOT)}; there are: {known}"
        )
    try:
        return releases[distribution], Version(version)
    except InvalidVersion as e:
        raise ValueError(f'{version!r} is not a version; keys are "<distribution> <version>"') from e


def recorded_commit(ref: str, release: Release, version: Version, first: str | None) -> str | None:
    """The commit a ledger entry records: for the release's tag, the commit that first declared the version
    (``first``; the tag, where a clone has it, must point there too), else ``ref``'s commit; None if absent."""
    if ref == tag_name(release.distribution, version):
        return first
    return ref_commit(ref, release.distribution, release.path, version)


def commit_problem(
    key: str, ref: str, release: Release, version: Version, first: str | None, earlier: str | None
) -> str:
    """Rule 2 for one entry: why ``ref`` is not ``key``'s release commit, or ``""`` where it is.

    ``first`` is the commit that first declared ``version`` (None where none did); ``earlier`` is the entry's
    ``declared_earlier`` exception: the commit that must have declared it first instead.
    """
    commit = recorded_commit(ref, release, version, first)
    pyproject = f"{release.path}/pyproject.toml"
    if commit is None and first is None:
        return (
            f"FAIL {key}: recorded as {ref}, which this clone lacks, and no commit declares version {version} "
            f"in {pyproject}. Commit the release (`.ci/release.py` sets the version), or fetch the history "
            "(`git fetch --unshallow --tags origin`)."
        )
    if commit is None:
        return (
            f"FAIL {key}: recorded at {ref}, which is not in this clone's history: fetch it (`git fetch "
            f"--unshallow --tags origin`), or restore the history that held it. {NEVER_CHANGES}"
        )
    tag = tag_commit(release.distribution, version)
    if tag is not None and tag != commit:
        name = tag_name(release.distribution, version)
        return (
            f"FAIL {key}: its tag {name} points at {tag[:12]}, but it was cut from {commit[:12]} "
            f"({LEDGER_PATH}): put the tag back (`git tag -f {name} {commit[:12]}`). {NEVER_CHANGES}"
        )
    expected = commit if earlier is None else ref_commit(earlier, release.distribution, release.path, version)
    if first == expected:
        return ""
    said = f"[declared_earlier] says {earlier} first declared it" if earlier else f"recorded at {commit[:12]}"
    found = f"the first commit declaring it is {first[:12]}" if first else "no commit declares it"
    return (
        f"FAIL {key}: {said} in {LEDGER_PATH}, but {found} in {pyproject} (a release is cut from the commit "
        f"that first declares its version): record {first[:12] if first else 'that commit'}. {NEVER_CHANGES}"
    )


def wrong_commits(ledger: Ledger, releases: dict[str, Release], declared: Declared) -> list[str]:
    """Rule 2: every entry whose commit is missing or is not its version's release commit."""
    problems = []
    for key, ref in ledger.released.items():
        try:
            release, version = entry_release(key, releases)
        except ValueError as e:
            problems.append(f"FAIL {key}: in {LEDGER_PATH}: {e}")
            continue
        first = declared[release.distribution].get(version)
        earlier = ledger.declared_earlier.get(key)
        problems.append(commit_problem(key, ref, release, version, first, earlier))
    return [problem for problem in problems if problem]


def resolved(ref: str, commit: str | None) -> str:
    """`` (<commit>)`` where ``ref`` is not already that commit's abbreviation, for messages."""
    if commit is None:
        return " (not in this clone)"
    return "" if commit.startswith(ref) else f" ({commit[:12]})"


def unrecorded_last_releases(ledger: Ledger, releases: list[Release], declared: Declared) -> list[str]:
    """Rule 3: each distribution's last release in ``releases.toml`` is in the ledger at the same commit (one
    never cut has none)."""
    problems = []
    for release in filter(lambda release: release.released, releases):
        key = release_key(release.distribution, release.version)
        ref = ledger.released.get(key)
        if ref is None:
            problems.append(
                f"FAIL {key}: {RELEASES.relative_to(ROOT)} records it as the last release ({release.ref}) but "
                f"{LEDGER_PATH} does not. `.ci/release.py` appends every cut; for one made by hand add "
                f'"{key}" = "{tag_name(release.distribution, release.version)}" under [released].'
            )
            continue
        first = declared[release.distribution].get(release.version)
        recorded = recorded_commit(ref, release, release.version, first)
        last = recorded_commit(release.ref, release, release.version, first)
        if recorded is not None and last != recorded:
            problems.append(
                f"FAIL {key}: {RELEASES.relative_to(ROOT)} records it at {release.ref}"
                f'{resolved(release.ref, last)}, {LEDGER_PATH} at {recorded[:12]}: set its ref = "{ref}" '
                f"there. {NEVER_CHANGES}"
            )
    return problems


def main() -> int:
    releases = load_releases()
    if not LEDGER.exists():
        print(f"FAIL {LEDGER_PATH} is missing: it lists every release ever cut (git log -- {LEDGER_PATH}).")
        return 1
    now = load_ledger(LEDGER.read_text())
    declared = {release.distribution: declared_versions(release.path) for release in releases}
    problems = [
        *changed_entries(now, ledger_history()),
        *wrong_commits(now, {release.distribution: release for release in releases}, declared),
        *unrecorded_last_releases(now, releases, declared),
    ]
    if problems:
        print("\n".join(problems))
        return 1
    print(f"ok   {len(now.released)} releases in {LEDGER_PATH}: none changed, each at its release commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
