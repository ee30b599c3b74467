"""Whether a plugin was built for the installed core: its distribution's ``Requires-Dist`` on core, checked
before the plugin is imported.

A plugin written against another core minor would otherwise load and fail later, at run time, with an
``AttributeError`` deep in a job (docs/versioning.md: a core minor may break its API). Reading the range from the
installed metadata costs no import, so an incompatible plugin is reported in one line and never loaded.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

CORE_DISTRIBUTION = "drivetrain-engine-core"


def installed_core_version() -> Version | None:
    """The installed core's version, or None where core runs without distribution metadata (a bare source tree)."""
    try:
        return Version(importlib.metadata.version(CORE_DISTRIBUTION))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def declared_core_range(dist: Any) -> SpecifierSet | None:
    """The core range ``dist`` requires unconditionally (extras' requirements left out), or None if it declares none.

    Args:
        dist: an ``importlib.metadata.Distribution`` or a test double; one without ``requires`` declares nothing.
    """
    ranges = []
    for line in getattr(dist, "requires", None) or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue  # pip refuses such metadata at install; not this check's to report
        if canonicalize_name(requirement.name) != CORE_DISTRIBUTION:
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            ranges.append(requirement.specifier)
    if not ranges:
        return None
    combined = SpecifierSet()
    for specifier in ranges:
        combined &= specifier
    return combined


def core_incompatibility(dist: Any, core: Version | None) -> str | None:
    """Why ``dist`` cannot run on ``core`` (one line with the fix), or None when its range admits it.

    A plugin that declares no range, or a core without metadata, is not judged: nothing says they disagree.
    """
    if dist is None or core is None:
        return None
    declared = declared_core_range(dist)
    # prereleases=True: a release candidate of an admitted minor is admitted; the range decides, not the suffix.
    if declared is None or declared.contains(core, prereleases=True):
        return None
    return (
        f"requires {CORE_DISTRIBUTION}{declared} but {CORE_DISTRIBUTION} {core} is installed, so it is not "
        "loaded. Install a release of it built for this core: "
        f'pip install --upgrade {dist.name} "{CORE_DISTRIBUTION}=={core}" '
        f'(or keep this one and install the core it was built for: pip install "{CORE_DISTRIBUTION}{declared}")'
    )
