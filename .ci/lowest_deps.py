"""Compatibility matrix, lowest side: each plugin against the lowest versions it declares (docs/versioning.md).

For each plugin: core at the floor of the plugin's core range (built from that release's tag or recorded ref,
or from the working tree when the floor is the current version), every direct dependency of core and the plugin
(torch, transformers, peft, ...) at its declared floor (``uv pip compile --resolution lowest-direct``), both
installed into a fresh venv, then the plugin's conformance tests run there. ``.ci/run`` runs only
``--resolve-only`` (seconds): a floor torch is a multi-gigabyte download and the kits take minutes on CPU.

    uv run --all-packages --locked python .ci/lowest_deps.py [--resolve-only] [DISTRIBUTION ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from io import BytesIO
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version
from releasing import CORE, ROOT, Release, find_release, load_releases, project_version, tag_name

KITS = {
    "drivetrain-engine-fsdp": ["tests/test_fsdp_conformance.py"],
    "drivetrain-roles": ["tests/test_roles_losses.py"],
    "drivetrain-ckpt-tools": ["tests/test_ckpt_merge_synthetic.py"],
    "drivetrain-toy-engine": ["tests/test_toy_conformance.py"],
}
"""The tests each plugin runs at its floors: the conformance kit where it is a backend."""

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


def core_floor(plugin: Release) -> Version:
    """The lowest core version the plugin's range admits (its ``>=`` bound)."""
    cores = [r for r in requirements(ROOT / plugin.path / "pyproject.toml") if r.name == CORE]
    if not cores:
        raise SystemExit(
            f"lowest-deps: {plugin.distribution} does not require {CORE}; the matrix is for plugins."
        )
    core = cores[0]
    floors = [Version(s.version) for s in core.specifier if s.operator in (">=", "~=", "==")]
    if not floors:
        raise SystemExit(f"lowest-deps: {plugin.distribution} requires {core} with no lower bound; add one.")
    return max(floors)


def core_source(floor: Version, work: Path) -> Path:
    """A folder holding core at ``floor``: the working tree's if it is that version, else that release's."""
    here = ROOT / "packages" / "engine-core"
    if project_version((here / "pyproject.toml").read_text()) == floor:
        return here
    recorded = find_release(load_releases(), CORE)
    ref = recorded.ref if recorded.version == floor else tag_name(CORE, floor)
    archive = subprocess.run(["git", "archive", ref, "packages/engine-core"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"lowest-deps: core {floor} is not at {ref!r} in this clone (`git fetch --tags`).")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(work / "core-src", filter="data")
    return work / "core-src" / "packages" / "engine-core"


def lowest_set(plugin: Release, core: Path, work: Path) -> Path:
    """The pinned requirements: every non-drivetrain direct dependency of core and the plugin at its floor."""
    wanted = requirements(core / "pyproject.toml", ("testing",))
    wanted += requirements(ROOT / plugin.path / "pyproject.toml")
    lines = sorted({str(r) for r in wanted if not r.name.startswith("drivetrain-")} | set(TEST_TOOLS))
    source = work / f"{plugin.distribution}.in"
    source.write_text("\n".join(lines) + "\n")
    pinned = work / f"{plugin.distribution}.txt"
    run("uv", "pip", "compile", "--quiet", "--resolution", "lowest-direct", "--python", sys.executable,
        source, "-o", pinned)  # fmt: skip
    return pinned


def floor_report(source: Path, pinned: Path) -> str:
    """``torch 2.13.0 (declared >=2.11)``-style notes for torch and transformers: a resolved version above the
    declared floor means that floor is not installable beside the other floors."""
    declared = {r.name: r for r in map(Requirement, source.read_text().split())}
    resolved = dict(
        line.split("==") for line in pinned.read_text().splitlines() if "==" in line and line[0] != " "
    )
    notes = []
    for name in ("torch", "transformers"):
        floors = (
            [s.version for s in declared[name].specifier if s.operator == ">="] if name in declared else []
        )
        floor = max(floors, key=Version) if floors else None
        stale = floor is not None and Version(resolved[name]) > Version(floor)
        notes.append(
            f"{name} {resolved[name]}"
            + (f" (declared >={floor}: the other floors need more)" if stale else "")
        )
    return ", ".join(notes)


def check(plugin: Release, work: Path, resolve_only: bool) -> None:
    """Resolve (and unless ``resolve_only``, install and test) ``plugin`` at its floors."""
    started = time.monotonic()
    floor = core_floor(plugin)
    core = core_source(floor, work)
    pinned = lowest_set(plugin, core, work)
    print(f"{plugin.distribution}: core {floor}, {floor_report(pinned.with_suffix('.in'), pinned)}")
    if not resolve_only:
        venv = work / f"venv-{plugin.distribution}"
        python = venv / "bin" / "python"
        run("uv", "venv", "--quiet", "--python", sys.executable, venv)
        run("uv", "pip", "install", "--quiet", "--python", python, "-r", pinned)
        run("uv", "pip", "install", "--quiet", "--no-deps", "--python", python, core, ROOT / plugin.path)
        run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KITS[plugin.distribution],
            cwd=ROOT / plugin.path)  # fmt: skip
    print(f"{plugin.distribution}: ok in {time.monotonic() - started:.0f} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--resolve-only", action="store_true", help="compile the lowest sets, install nothing"
    )
    parser.add_argument("distributions", nargs="*", default=list(KITS))
    args = parser.parse_args(argv)
    releases = load_releases()
    with tempfile.TemporaryDirectory(prefix="lowest-deps-") as work:
        for name in args.distributions:
            check(find_release(releases, name), Path(work), args.resolve_only)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
