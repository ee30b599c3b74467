"""Compatibility matrix, lowest side: the plugins against the lowest versions they declare (docs/versioning.md).

Every floor is a promise, so every floor is installed and tested. Plugins with the same core floor share one
environment: core at that floor (built from that release's commit, found by its tag or, in a clone without
tags, as the first commit declaring that version; or from the working tree when the floor is the current
version), every plugin whose range admits it, and every direct dependency of core (with its ``testing`` extra)
and of those plugins at its declared floor (``uv pip compile --resolution lowest-direct``). Then the kits of
the plugins with that floor run there, in one pytest session. One environment can test a floor only where
every package declares the same floor for that dependency, so the script first checks that they agree, then
that each floor is what actually resolved, and names the package, the dependency and the fix when not.

    uv run --all-packages --locked python .ci/lowest_deps.py [--resolve-only] [DISTRIBUTION ...]

DISTRIBUTION names the plugins whose kits run (default: all); the environment holds every plugin regardless.

``.ci/run`` runs it whole (torch's floor is PyPI's CUDA build: 4.9 GB in a cold uv cache, 86 s here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections import defaultdict
from io import BytesIO
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from releasing import CORE, ROOT, Release, cut_commit, find_release, load_releases, project_version, tag_name

KITS = {
    "drivetrain-engine-fsdp": ["packages/engine-fsdp/tests/test_fsdp_conformance.py"],
    "drivetrain-engine-megatron": ["packages/engine-megatron/tests/test_megatron_conformance.py"],
    "drivetrain-roles": [
        "packages/roles/tests/test_roles_losses.py",
        "packages/roles/tests/test_roles_rollout_conformance.py",
        "packages/roles/tests/test_roles_job_template.py",
    ],
    "drivetrain-ckpt-tools": ["packages/ckpt-tools/tests/test_ckpt_merge_synthetic.py"],
    "drivetrain-toy-engine": ["examples/drivetrain-toy-engine/tests/test_toy_conformance.py"],
    "drivetrain-toy-environment": ["examples/drivetrain-toy-environment/tests/test_toy_environment_game.py"],
    # Its kit needs vLLM, which pins its own torch (the vLLM lane of .ci/run); its floors are installed here.
    "drivetrain-rollout-vllm": [],
}
"""The tests each plugin runs at its floors: its conformance kit, and for roles the job template and losses."""

TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3"]


def run(*args: str | Path, cwd: Path = ROOT) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"lowest-deps: {' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def requirements(pyproject: Path, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """The direct requirements (and ``extras``) a pyproject.toml declares."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project.get("dependencies", []))
    for extra in extras:
        lines += project.get("optional-dependencies", {}).get(extra, [])
    return [Requirement(line) for line in lines]


def floor_of(requirement: Requirement) -> Version | None:
    """The lowest version ``requirement`` admits by its ``>=``/``~=``/``==`` bounds, or None."""
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "~=", "==")]
    return max(floors) if floors else None


def core_requirement(plugin: Release) -> Requirement:
    """The plugin's requirement on core."""
    cores = [r for r in requirements(ROOT / plugin.path / "pyproject.toml") if r.name == CORE]
    if not cores:
        raise SystemExit(
            f"lowest-deps: {plugin.distribution} does not require {CORE}; the matrix is for plugins."
        )
    return cores[0]


def core_floor(plugin: Release) -> Version:
    """The lowest core version the plugin's range admits."""
    requirement = core_requirement(plugin)
    floor = floor_of(requirement)
    if floor is None:
        raise SystemExit(
            f"lowest-deps: {plugin.distribution} requires {requirement} with no lower bound; add one "
            f"(>=) in {plugin.path}/pyproject.toml."
        )
    return floor


def release_version(floor: Version) -> Version:
    """The release a floor admits first, spelled as cuts are (``>=0.2`` admits 0.2.0)."""
    return Version(f"{floor.major}.{floor.minor}.{floor.micro}")


def core_source(floor: Version, work: Path) -> Path:
    """A folder holding core at ``floor``: the working tree's if it is that version, else that release's."""
    here = ROOT / "packages" / "engine-core"
    if project_version((here / "pyproject.toml").read_text()) == floor:
        return here
    version = release_version(floor)
    commit = cut_commit(CORE, "packages/engine-core", version)
    if commit is None:
        raise SystemExit(
            f"lowest-deps: core {version} is neither tagged ({tag_name(CORE, version)}) nor declared by any "
            "commit of this clone: clone the whole history (not --depth), or require a core version that "
            "was released."
        )
    archive = subprocess.run(
        ["git", "archive", commit, "packages/engine-core"], cwd=ROOT, capture_output=True
    )
    if archive.returncode != 0:
        raise SystemExit(
            f"lowest-deps: git archive of core {version} at {commit} failed: {archive.stderr.decode().strip()}"
        )
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(work / f"core-{floor}", filter="data")
    return work / f"core-{floor}" / "packages" / "engine-core"


def declared(core: Path, plugins: list[Release]) -> dict[str, list[Requirement]]:
    """Each package's non-drivetrain direct requirements, by the package's folder (core with ``testing``)."""
    found = {"packages/engine-core": requirements(core / "pyproject.toml", ("testing",))}
    for plugin in plugins:
        found[plugin.path] = requirements(ROOT / plugin.path / "pyproject.toml")
    return {where: [r for r in reqs if not r.name.startswith("drivetrain-")] for where, reqs in found.items()}


def disagreements(by_package: dict[str, list[Requirement]]) -> list[str]:
    """One line per package whose floor for a dependency is below another package's: the shared environment
    installs the highest, so the lower floor would go untested."""
    floors: dict[str, dict[str, Version]] = defaultdict(dict)
    for where, reqs in by_package.items():
        for requirement in reqs:
            if (floor := floor_of(requirement)) is not None:
                floors[canonicalize_name(requirement.name)][where] = floor
    problems = []
    for name, by_where in sorted(floors.items()):
        highest = max(by_where.values())
        holder = next(w for w, f in by_where.items() if f == highest)
        problems += [
            f"{where}/pyproject.toml declares {name}>={floor} but {holder} declares {name}>={highest}; the "
            f"shared floor environment installs {highest}, so {floor} is never tested. Raise it to "
            f"{name}>={highest} (or lower {holder}'s floor and prove it here)."
            for where, floor in sorted(by_where.items())
            if floor < highest
        ]
    return problems


def compile_lowest(
    lines: list[str], work: Path, name: str, pins: str = ""
) -> subprocess.CompletedProcess[str]:
    """``uv pip compile --resolution lowest-direct`` of ``lines`` (plus ``pins`` as constraints) into
    ``work/name.txt``; the completed process, so that a failure's reason can be read."""
    source = work / f"{name}.in"
    source.write_text("\n".join(lines) + "\n")
    constraints = work / f"{name}.constraints"
    constraints.write_text(pins)
    output = work / f"{name}.txt"
    # NOTE: uv takes the versions an existing output file pins as preferences, so an earlier compile (another
    # core floor's group, an earlier pin's `why`) would lift this one's floors; each compile starts afresh.
    output.unlink(missing_ok=True)
    args = ["uv", "pip", "compile", "--no-progress", "--resolution", "lowest-direct", "--python", sys.executable,
            "-c", constraints, source, "-o", output]  # fmt: skip
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, check=False)


def resolved_versions(pinned: Path) -> dict[str, Version]:
    """``name -> version`` of a compiled requirements file."""
    pairs = [line.split("==") for line in pinned.read_text().splitlines() if "==" in line and line[0] != " "]
    return {canonicalize_name(name): Version(version) for name, version in pairs}


def why_not(lines: list[str], work: Path, pin: str, floors: dict[str, Version]) -> str:
    """Why ``pin`` (a floor, ``name==version``) did not resolve, as uv sees it: its conflict when the pin fails;
    the other floors the pin pushes up when it resolves (two floors that cannot both hold); else uv's warnings
    (a yanked release resolves only when pinned exactly)."""
    pinned = compile_lowest(lines, work, "why", pin + "\n")
    said = "\n".join(line for line in pinned.stderr.splitlines() if not line.startswith("Resolved ")).strip()
    if pinned.returncode != 0:
        return said
    name = canonicalize_name(Requirement(pin).name)
    pushed = [
        f"{other} {version} (declared >={floors[other]})"
        for other, version in sorted(resolved_versions(work / "why.txt").items())
        if other != name and other in floors and version != floors[other]
    ]
    if pushed:
        return (
            f"with {pin} the others resolve to {', '.join(pushed)}: these floors cannot all hold at once, so "
            "raise this one or those"
        )
    return said or f"{pin} resolves when pinned; a resolver prefers a later release"


def floors_not_resolved(
    by_package: dict[str, list[Requirement]], lines: list[str], work: Path, resolved: dict[str, Version]
) -> list[str]:
    """One line per declared floor that did not resolve (a higher version came instead), with uv's reason."""
    floors = {
        canonicalize_name(r.name): floor
        for reqs in by_package.values()
        for r in reqs
        if (floor := floor_of(r)) is not None
    }
    problems = []
    for where, reqs in by_package.items():
        for requirement in reqs:
            floor = floor_of(requirement)
            got = resolved.get(canonicalize_name(requirement.name))
            if floor is None or got is None or got == floor:
                continue
            reason = why_not(lines, work, f"{requirement.name}=={floor}", floors)
            problems.append(
                f"{where}/pyproject.toml declares {requirement}, but resolving every floor together installs "
                f"{requirement.name} {got}, so {floor} is never tested. Raise the floor to "
                f"{requirement.name}>={got} in every package that declares it, or see uv, with "
                f"{requirement.name}=={floor} pinned:\n    " + reason.replace("\n", "\n    ")
            )
    return problems


def resolve(core: Path, plugins: list[Release], work: Path) -> Path:
    """The pinned floor set for ``plugins`` beside ``core``, or SystemExit listing every floor that is not a
    tested promise (floors that disagree between packages, floors that do not resolve)."""
    by_package = declared(core, plugins)
    problems = disagreements(by_package)
    lines = sorted({str(r) for reqs in by_package.values() for r in reqs} | set(TEST_TOOLS))
    compiled = compile_lowest(lines, work, "floors")
    if compiled.returncode != 0:
        problems.append(
            "the declared floors do not install together; raise the floor uv names below in every package "
            f"that declares it (or move the other one):\n{compiled.stderr}"
        )
    else:
        problems += floors_not_resolved(by_package, lines, work, resolved_versions(work / "floors.txt"))
    if problems:
        raise SystemExit("lowest-deps: " + "\nlowest-deps: ".join(problems))
    return work / "floors.txt"


def install_and_test(core: Path, plugins: list[Release], kits: list[str], pinned: Path, work: Path) -> None:
    """A fresh venv with the pinned floors, core and the plugins (no deps), then ``kits`` in it."""
    venv = Path(tempfile.mkdtemp(prefix="venv-", dir=work))
    python = venv / "bin" / "python"
    run("uv", "venv", "--quiet", "--python", sys.executable, venv)
    run("uv", "pip", "install", "--quiet", "--python", python, "-r", pinned)
    run("uv", "pip", "install", "--quiet", "--no-deps", "--python", python, core,
        *(ROOT / p.path for p in plugins))  # fmt: skip
    loads(venv / "bin" / "drivetrain", plugins)
    if kits:
        run_kits(python, kits)


def loads(drivetrain: Path, plugins: list[Release]) -> None:
    """Every plugin, rollout-vllm's too (no kit here), is loaded by ``drivetrain plugins`` at the floors."""
    listed = {p["distribution"]: p for p in json.loads(run(drivetrain, "plugins", "--json"))}
    failed = [
        f"{p.distribution}: {listed.get(p.distribution, {}).get('status', 'not listed')} "
        f"({listed.get(p.distribution, {}).get('error')})"
        for p in plugins
        if listed.get(p.distribution, {}).get("status") != "loaded"
    ]
    if failed:
        raise SystemExit(
            f"lowest-deps: at the floors printed above, `drivetrain plugins` does not load: {'; '.join(failed)}. "
            "Fix the plugin's import, or raise the floor of the dependency it needs in every package."
        )


def run_kits(python: Path, kits: list[str]) -> None:
    """The kits in one pytest session, its output passed through. A kit skipped because a module did not
    import (``pytest.importorskip``) fails here: at the floors that is the finding, not an absent extra."""
    # NOTE: unbuffered, so that pytest's progress reaches the CI log as it happens, not at exit.
    tested = subprocess.Popen([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *kits], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    unimportable = []
    for line in tested.stdout or ():
        print(line, end="", flush=True)
        if line.startswith("SKIPPED") and "could not import" in line:
            unimportable.append(line.strip())
    if tested.wait() != 0 or unimportable:
        raise SystemExit(
            "lowest-deps: at the floors printed above, "
            + ("; ".join(unimportable) if unimportable else "a kit failed")
            + ". Fix the code, or raise the floor of the dependency it needs in every package that declares it."
        )


def check(floor: Version, plugins: list[Release], kits: list[str], work: Path, resolve_only: bool) -> None:
    """Resolve ``plugins`` beside core ``floor`` (and unless ``resolve_only``, install them and run ``kits``)."""
    started = time.monotonic()
    core = core_source(floor, work)
    pinned = resolve(core, plugins, work)
    names = ", ".join(p.distribution for p in plugins)
    wanted = {canonicalize_name(r.name) for reqs in declared(core, plugins).values() for r in reqs}
    floors = ", ".join(f"{n} {v}" for n, v in sorted(resolved_versions(pinned).items()) if n in wanted)
    print(f"lowest-deps: core {floor} with {names}: every floor resolved ({floors})", flush=True)
    if not resolve_only:
        install_and_test(core, plugins, kits, pinned, work)
    print(f"lowest-deps: core {floor} with {names}: ok in {time.monotonic() - started:.0f} s", flush=True)


def floor_runs(plugins: list[Release], chosen: set[str]) -> list[tuple[Version, list[Release], list[str]]]:
    """One run per core floor of the ``chosen`` plugins: the floor, the plugins installed beside it, the kits.

    NOTE: a kit runs at its plugin's core floor beside every plugin that admits that core, since kits use
    their siblings (roles' job template trains with fsdp, ckpt-tools' kit merges fsdp's steps); a sibling
    whose range starts above the floor cannot be there.
    """
    floors = {p.distribution: core_floor(p) for p in plugins}
    ranges = {p.distribution: core_requirement(p).specifier for p in plugins}
    runs = []
    for floor in sorted(set(floors.values())):
        tested = [p for p in plugins if floors[p.distribution] == floor and p.distribution in chosen]
        if tested:
            beside = [p for p in plugins if ranges[p.distribution].contains(release_version(floor))]
            runs.append((floor, beside, [test for p in tested for test in KITS[p.distribution]]))
    return runs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--resolve-only", action="store_true", help="check the floors resolve, install nothing"
    )
    parser.add_argument(
        "distributions", nargs="*", default=list(KITS), help="whose kits to run (default all)"
    )
    args = parser.parse_args(argv)
    releases = load_releases()
    chosen = {find_release(releases, name).distribution for name in args.distributions}
    if unknown := chosen - set(KITS):
        raise SystemExit(
            f"lowest-deps: {', '.join(sorted(unknown))} has no kit here; plugins: {', '.join(KITS)}."
        )
    plugins = [find_release(releases, name) for name in KITS]
    with tempfile.TemporaryDirectory(prefix="lowest-deps-") as work:
        for floor, beside, kits in floor_runs(plugins, chosen):
            check(floor, beside, kits, Path(work), args.resolve_only)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
