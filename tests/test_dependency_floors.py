"""Declared dependency floors are true, and the extras pull a working set in one install command.

A floor below what a dependency itself needs is a promise no resolver can keep (tensordict 0.15 requires
torch >= 2.11, so core's ``torch>=2.6`` was false). Read from the installed metadata, no network.
"""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

WORKSPACE = (
    "drivetrain-engine-core",
    "drivetrain-engine-fsdp",
    "drivetrain-engine-megatron",
    "drivetrain-roles",
    "drivetrain-ckpt-tools",
    "drivetrain-rollout-vllm",
)


def _requirements(distribution: str, extra: str | None = None) -> list[Requirement]:
    requirements = [Requirement(line) for line in importlib.metadata.requires(distribution) or []]
    environment = {"extra": extra or ""}
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def _floors(requirements: list[Requirement]) -> dict[str, Version]:
    floors = {}
    for requirement in requirements:
        bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "~=", "==")]
        if bounds:
            floors[requirement.name.lower()] = max(bounds)
    return floors


@pytest.mark.parametrize("distribution", WORKSPACE)
def test_no_floor_is_below_what_a_direct_dependency_requires(distribution) -> None:
    own = _requirements(distribution)
    declared = _floors(own)
    for dependency in own:
        try:
            needed = _floors(_requirements(dependency.name))
        except importlib.metadata.PackageNotFoundError:
            continue
        for name, floor in needed.items():
            if name in declared:
                assert declared[name] >= floor, (
                    f"{distribution} declares {name}>={declared[name]} but {dependency.name} needs {name}>={floor}; "
                    f"raise the floor in {distribution}'s pyproject.toml"
                )


@pytest.mark.parametrize(
    ("distribution", "extra", "provides"),
    [
        ("drivetrain-engine-core", "fsdp", "drivetrain-engine-fsdp"),
        ("drivetrain-engine-core", "megatron", "drivetrain-engine-megatron"),
        ("drivetrain-engine-core", "roles", "drivetrain-roles"),
        ("drivetrain-engine-core", "ckpt", "drivetrain-ckpt-tools"),
        ("drivetrain-roles", "fsdp", "drivetrain-engine-fsdp"),
        ("drivetrain-roles", "megatron", "drivetrain-engine-megatron"),
    ],
)
def test_extras_pull_the_sibling_by_range(distribution, extra, provides) -> None:
    (requirement,) = [r for r in _requirements(distribution, extra) if r.name == provides]
    current = Version(importlib.metadata.version(provides))
    breaking = Version(f"0.{current.minor + 1}") if current.major == 0 else Version(f"{current.major + 1}")
    assert requirement.specifier.contains(current), f"{distribution}[{extra}] excludes {provides} {current}"
    assert not requirement.specifier.contains(breaking), (
        f"{distribution}[{extra}] admits a breaking {breaking}"
    )
