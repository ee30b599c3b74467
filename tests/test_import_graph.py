"""No import circles inside any package, and the floors hold: core imports no sibling, the others only core.

Read with grimp (the graph import-linter uses), which sees every ``import`` statement, including the lazy ones
inside functions. Imports under ``if TYPE_CHECKING:`` are left out of the circle check: they never run, and an
annotation naming a higher class (the checkpoint helpers' ``engine: Engine``) is not a load-order dependency.
The floor check counts them too: core does not even name a sibling's types, and neither RL command (``grpo``,
``ppo``) names the other's: what both need is ``drivetrain_roles.rl``'s.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp
import pytest

CORE = "drivetrain_engine_core"
PACKAGES = (
    CORE,
    "drivetrain_engine_fsdp",
    "drivetrain_engine_megatron",
    "drivetrain_roles",
    "drivetrain_ckpt_tools",
    "drivetrain_rollout_vllm",
)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Each circle once: a direct import ``a -> b`` inside ``package`` and the shortest way back ``b -> ... -> a``."""
    circles: dict[frozenset[str], list[str]] = {}
    for importer in sorted(graph.find_descendants(package) | {package}):
        for imported in graph.find_modules_directly_imported_by(importer):
            if not _inside(imported, package):
                continue
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                circles.setdefault(frozenset(back), [importer, *back])
    return list(circles.values())


@pytest.fixture(scope="module")
def runtime_graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(runtime_graph: grimp.ImportGraph, package: str) -> None:
    circles = _circles(runtime_graph, package)
    assert circles == [], "import circles (each: a -> ... -> a):\n" + "\n".join(
        " -> ".join(c) for c in circles
    )


def test_core_imports_no_sibling_and_the_others_only_core() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    allowed = {package: set() if package == CORE else {CORE} for package in PACKAGES}
    for importer in PACKAGES:
        for imported in PACKAGES:
            if imported == importer or imported in allowed[importer]:
                continue
            chains = graph.find_shortest_chains(importer=importer, imported=imported, as_packages=True)
            assert not chains, f"{importer} must not import {imported}: {sorted(chains)}"


# NOTE: the RL commands are siblings over ``drivetrain_roles.rl``: what both need lives there, so that neither
# command's internals become the other's API (and a third RL command needs neither).
SIBLING_COMMANDS = ("drivetrain_roles.grpo", "drivetrain_roles.ppo")


@pytest.fixture(scope="module")
def roles_graph() -> grimp.ImportGraph:
    """Every import of ``drivetrain_roles``, those under ``if TYPE_CHECKING:`` included."""
    return grimp.build_graph("drivetrain_roles", cache_dir=None)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [SIBLING_COMMANDS, tuple(reversed(SIBLING_COMMANDS))],
    ids=["grpo-ppo", "ppo-grpo"],
)
def test_rl_commands_do_not_import_each_other(
    roles_graph: grimp.ImportGraph, importer: str, imported: str
) -> None:
    chains = roles_graph.find_shortest_chains(importer=importer, imported=imported, as_packages=True)
    assert not chains, (
        f"{importer} must not import {imported} (share it through drivetrain_roles.rl): {sorted(chains)}"
    )


# NOTE: core's API is its faces (docs/versioning.md); every other core module is private and may change in any
# release, so a plugin that imported one would break on a patch release of core.
FACES = frozenset(f"{CORE}.{face}" for face in ("backend", "kit", "rollout", "job", "testing"))
CORE_SOURCES = Path(__file__).resolve().parents[1] / "packages" / "engine-core" / "src" / CORE


def _is_face(module: str) -> bool:
    return module in FACES or _inside(module, f"{CORE}.testing")


def _non_face_imports(graph: grimp.ImportGraph, package: str) -> list[str]:
    """``importer -> core module`` for each import of a core module that is not a face, under ``package``."""
    return sorted(
        f"{importer} -> {imported}"
        for importer in graph.find_descendants(package) | {package}
        for imported in graph.find_modules_directly_imported_by(importer)
        if _inside(imported, CORE) and not _is_face(imported)
    )


@pytest.fixture(scope="module")
def full_graph() -> grimp.ImportGraph:
    """Every import of every package, those under ``if TYPE_CHECKING:`` included."""
    return grimp.build_graph(*PACKAGES, cache_dir=None)


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != CORE])
def test_plugins_import_core_only_through_its_faces(full_graph: grimp.ImportGraph, package: str) -> None:
    offenders = _non_face_imports(full_graph, package)
    assert offenders == [], (
        f"{package} imports private core modules; import from {sorted(FACES)} instead:\n"
        + "\n".join(offenders)
    )


def test_the_face_check_sees_a_private_import(full_graph: grimp.ImportGraph) -> None:
    """Core's own conformance kit imports private modules: the check above would name it."""
    assert f"{CORE}.testing.reference -> {CORE}._data.batch" in _non_face_imports(
        full_graph, f"{CORE}.testing"
    )


def test_core_api_is_exactly_its_faces() -> None:
    """The API check covers the faces (``.ci/releases.toml``), and every other core module is ``_``-private."""
    releases = tomllib.loads((CORE_SOURCES.parents[3] / ".ci" / "releases.toml").read_text())
    public = {
        f"{CORE}.{path.name.removesuffix('.py')}"
        for path in CORE_SOURCES.iterdir()
        if not path.name.startswith("_") and (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert public == set(releases["drivetrain-engine-core"]["api"]) == FACES
