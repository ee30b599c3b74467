"""API-break check: each distribution's Python API against its last release, with griffe.

For every distribution in ``.ci/releases.toml``: find its last release (the newest ``<distribution>-v<version>``
tag merged into HEAD, else the ref the file records; a recorded tag a clone lacks, the commit that declared that
version), load the API modules there and in the working tree, and list griffe's breaking changes. Breaking
changes pass only when the working tree's version allows them (a new minor in 0.x, a new major from 1.0) and
its CHANGELOG.md has a section for that version; otherwise each changed symbol is printed with the fix, and
the exit status is 1. A check that cannot run (a ref this clone lacks and cannot fetch, a stale module list)
says why on stderr, also with status 1.

    uv run --all-packages --locked python .ci/api_check.py [DISTRIBUTION ...]
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass

import griffe
from cli_contract import cli_breaks
from packaging.version import InvalidVersion, Version
from releasing import (
    RELEASES,
    ROOT,
    Release,
    allows_breaking,
    changelog_section,
    find_release,
    git,
    has_commit,
    load_releases,
    project_version,
    ref_commit,
    tag_name,
)
from subclass_contract import hook_breaks

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(kw_only=True, frozen=True)
class Baseline:
    """The release a distribution's API is compared against."""

    version: Version
    ref: str


def available_ref(last: Baseline, release: Release) -> str:
    """``last``'s ref as this clone can read it. A release tag the clone lacks stands for the commit that cut
    it, found by the version it declares (CI clones without tags, and ``.ci/release`` records the tag it
    prints); any other missing ref, or a cut outside a shallow clone's history, is fetched from ``origin`` once.

    Raises:
        SystemExit: the ref cannot be found or fetched, with the command that gets it.
    """
    ref, distribution = last.ref, release.distribution
    is_tag = ref == tag_name(distribution, last.version)
    found = ref_commit(ref, distribution, release.path, last.version)
    if found is None and git("remote", "get-url", "origin").returncode == 0:
        shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
        git("fetch", "--quiet", "--tags", *(["--unshallow"] if shallow else []), "origin")
        if not has_commit(ref):
            git("fetch", "--quiet", "origin", ref)
        found = ref_commit(ref, distribution, release.path, last.version)
    if found is not None:
        return found
    if is_tag:
        raise SystemExit(
            f"api-check: {distribution}'s last release is recorded as tag {ref!r}, which does not exist, and no "
            f"commit declares version {last.version}. Commit the release, then create the tag on that commit "
            f"(`git tag {ref} <commit>`; docs/versioning.md, Cutting a release), or fetch tags "
            "(`git fetch --tags origin`)."
        )
    raise SystemExit(
        f"api-check: git ref {ref!r} (a last release recorded in {RELEASES.relative_to(ROOT)} or its tag) is "
        "not in this clone and could not be fetched from origin. The check needs the history and tags: clone "
        "without --depth, or run `git fetch --unshallow --tags origin`."
    )


def baseline(release: Release) -> Baseline:
    """The newest of the recorded release and the distribution's release tags merged into HEAD."""
    newest = Baseline(version=release.version, ref=release.ref)
    prefix = tag_name(release.distribution, "")
    for tag in git("tag", "--merged", "HEAD", "--list", f"{prefix}*").stdout.split():
        try:
            version = Version(tag.removeprefix(prefix))
        except InvalidVersion:
            continue
        if version >= newest.version:
            newest = Baseline(version=version, ref=tag)
    return newest


def load_package(package: str, src: str, ref: str | None) -> griffe.Object | None:
    """The top-level ``package`` under ``src`` in the working tree (``ref`` None) or at git ``ref``; None if absent."""
    try:
        if ref is None:
            return griffe.load(package, search_paths=[ROOT / src])
        return griffe.load_git(package, ref=ref, repo=ROOT, search_paths=[src])
    except ModuleNotFoundError:
        return None


def member(root: griffe.Object | None, dotted: str) -> griffe.Object | griffe.Alias | None:
    """``dotted`` (e.g. ``pkg.data.batch``) inside the loaded top-level package ``root``, or None."""
    if root is None:
        return None
    inner = dotted.partition(".")[2]
    try:
        return root[inner] if inner else root
    except KeyError:
        return None


def read_face(module: griffe.Object | griffe.Alias | None) -> None:
    """Give a face module its exports as the run time does: a module without a static ``__all__`` whose
    ``if TYPE_CHECKING:`` imports list its public names (core's faces; ``drivetrain_engine_core._face``)."""
    if module is None or module.is_alias or not module.is_module or module.exports is not None:
        return
    typed = [name for name, item in module.members.items() if item.is_alias and not item.runtime]
    if typed:
        module.exports = typed


def inline_moved(old: griffe.Object | griffe.Alias, new: griffe.Object | griffe.Alias) -> None:
    """Put, in the loaded working tree only, the definition of each public object the release defined in ``old``
    and ``new`` now re-exports (an alias), so that it is compared: griffe's diff marks the released path as seen
    before it follows the alias, and then compares nothing (a moved class's changed default passed unseen)."""
    if old.is_alias or new.is_alias or not old.is_module:
        return
    for name, old_member in old.members.items():
        new_member = new.members.get(name)
        if new_member is None:
            continue
        if new_member.is_alias and not old_member.is_alias and old_member.is_public:
            try:
                new.members[name] = new_member.final_target
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
        else:
            inline_moved(old_member, new_member)


def breaking_changes(release: Release, against: str) -> list[str]:
    """One line per breaking change of ``release``'s API modules since ``against`` (deduplicated, sorted).

    Raises:
        SystemExit: a listed module or hook exists neither now nor at ``against`` (releases.toml is stale).
    """
    src = f"{release.path}/src"
    packages = sorted({path.partition(".")[0] for path in (*release.api, *release.hooks)})
    old_roots = {p: load_package(p, src, against) for p in packages}
    new_roots = {p: load_package(p, src, None) for p in packages}
    lines: set[str] = set()
    for module in release.api:
        top = module.partition(".")[0]
        old, new = member(old_roots[top], module), member(new_roots[top], module)
        read_face(old)
        read_face(new)
        if old is None and new is None:
            raise SystemExit(
                f"api-check: {release.distribution}'s API module {module!r} (listed in "
                f"{RELEASES.relative_to(ROOT)}) exists neither in the working tree nor at {against}; fix the list."
            )
        if new is None:
            lines.add(f"{module}: module was removed")
        elif old is not None:
            inline_moved(old, new)
            lines.update(ANSI.sub("", b.explain()) for b in griffe.find_breaking_changes(old, new))
            lines.update(cli_breaks(old, new))

    def released(path: str) -> griffe.Object | griffe.Alias | None:
        return member(old_roots[path.partition(".")[0]], path)

    def current(path: str) -> griffe.Object | griffe.Alias | None:
        return member(new_roots[path.partition(".")[0]], path)

    for entry in release.hooks:
        if released(entry) is None and current(entry) is None:
            raise SystemExit(
                f"api-check: {release.distribution}'s hook {entry!r} (listed in {RELEASES.relative_to(ROOT)}) "
                f"exists neither in the working tree nor at {against}; fix the list."
            )
    lines.update(hook_breaks(release.hooks, released, current))
    return sorted(lines)


def check(release: Release) -> bool:
    """Print ``release``'s verdict; True when it has no unmatched breaking change."""
    folder = ROOT / release.path
    current = project_version((folder / "pyproject.toml").read_text())
    last = baseline(release)
    name = f"{release.distribution} {current}"
    if not last.ref:
        print(f"ok   {name}: not released yet, nothing to compare")
        return True
    if current < last.version:
        print(f"FAIL {name}: its version is below its last release {last.version} ({last.ref}).")
        return False
    if not release.api:
        print(f"ok   {name}: no Python API to check (releases.toml lists none)")
        return True
    ref = available_ref(last, release)
    breaks = breaking_changes(release, ref)
    if not breaks:
        print(f"ok   {name}: no breaking change since {last.version} ({last.ref})")
        return True
    section = changelog_section((folder / "CHANGELOG.md").read_text(), current)
    if allows_breaking(last.version, current) and section and section.strip():
        print(f"ok   {name}: {len(breaks)} breaking change(s) since {last.version}, released as {current}")
        return True
    print(f"FAIL {name}: {len(breaks)} breaking change(s) since {last.version} ({last.ref}):")
    print("\n".join(f"       {line}" for line in breaks))
    print(
        f"     A break needs a new {'minor' if last.version.major == 0 else 'major'} version with a changelog "
        f"entry: set version in {release.path}/pyproject.toml and describe the break under its heading in "
        f"{release.path}/CHANGELOG.md (`uv run python .ci/release.py {release.distribution} VERSION` does both), "
        "or restore the old API (deprecate first: docs/versioning.md)."
    )
    return False


def main(names: list[str]) -> int:
    # Unresolved imports of third-party code are not breaks; griffe would log each one.
    logging.getLogger("griffe").setLevel(logging.ERROR)
    releases = load_releases()
    selected = [find_release(releases, name) for name in names] if names else releases
    results = [check(release) for release in selected]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
