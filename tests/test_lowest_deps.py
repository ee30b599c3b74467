"""``.ci/lowest_deps.py``: a floor that cannot be tested (two packages disagree, or it is not what resolves) is
refused with the package, the dependency and the fix; the repository's own floors agree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

from lowest_deps import (  # noqa: E402
    KITS,
    compile_lowest,
    declared,
    disagreements,
    floor_runs,
    floors_not_resolved,
    release_version,
    requirements,
    resolved_versions,
)
from releasing import CORE, cut_commit, find_release, load_releases  # noqa: E402


def _reqs(*lines: str) -> list[Requirement]:
    return [Requirement(line) for line in lines]


def test_a_lower_floor_beside_a_higher_one_names_the_package_the_dependency_and_the_fix():
    problems = disagreements(
        {
            "packages/engine-core": _reqs("torch>=2.11", "numpy>=1.25"),
            "packages/roles": _reqs("transformers>=4.56"),
            "packages/engine-fsdp": _reqs("transformers>=5.16", "numpy>=1.25"),
        }
    )
    assert problems == [
        "packages/roles/pyproject.toml declares transformers>=4.56 but packages/engine-fsdp declares "
        "transformers>=5.16; the shared floor environment installs 5.16, so 4.56 is never tested. Raise it to "
        "transformers>=5.16 (or lower packages/engine-fsdp's floor and prove it here)."
    ]


def _plugin_folders() -> list[Path]:
    """Every distribution folder in the repository that requires core (a new package included)."""
    folders = [*ROOT.glob("packages/*"), *ROOT.glob("examples/*")]
    return [
        folder
        for folder in sorted(folders)
        if (folder / "pyproject.toml").exists()
        and any(r.name == CORE for r in requirements(folder / "pyproject.toml"))
    ]


def test_every_plugin_is_in_the_floor_run():
    releases = {find_release(load_releases(), name).path for name in KITS}
    missing = [f.relative_to(ROOT).as_posix() for f in _plugin_folders()]
    missing = [folder for folder in missing if folder not in releases]
    assert not missing, (
        f"{missing} require {CORE} but .ci/lowest_deps.py never installs their floors: add each to KITS there "
        "(with its kit, or [] with the reason) and to .ci/releases.toml"
    )


def test_each_kit_runs_beside_every_plugin_that_admits_its_core_floor():
    """Roles' kit trains with fsdp: with roles alone at core 0.2.3 (the others from 0.2.2) it had no engine."""
    plugins = [find_release(load_releases(), name) for name in KITS]
    runs = floor_runs(plugins, set(KITS))
    assert sorted(test for _, _, kits in runs for test in kits) == sorted(
        t for ts in KITS.values() for t in ts
    )
    (roles_run,) = [beside for _, beside, kits in runs if KITS["drivetrain-roles"][0] in kits]
    assert {"drivetrain-roles", "drivetrain-engine-fsdp"} <= {p.distribution for p in roles_run}
    for floor, beside, _ in runs:
        for plugin in plugins:
            text = (ROOT / plugin.path / "pyproject.toml").read_text()
            (core,) = [
                Requirement(r) for r in tomllib.loads(text)["project"]["dependencies"] if r.startswith(CORE)
            ]
            assert (plugin in beside) == core.specifier.contains(f"{floor.major}.{floor.minor}.{floor.micro}")


def test_the_repositorys_floors_agree():
    by_package = {
        f.relative_to(ROOT).as_posix(): [
            r for r in requirements(f / "pyproject.toml") if not r.name.startswith("drivetrain-")
        ]
        for f in _plugin_folders()
    }
    by_package["packages/engine-core"] = declared(ROOT / "packages" / "engine-core", [])[
        "packages/engine-core"
    ]
    assert disagreements(by_package) == []


def test_resolved_versions_reads_a_compiled_file(tmp_path):
    pinned = tmp_path / "floors.txt"
    pinned.write_text("# header\nTorch==2.11.0\n    # via -r floors.in\nnumpy==1.25.0\n")
    assert {n: str(v) for n, v in resolved_versions(pinned).items()} == {"torch": "2.11.0", "numpy": "1.25.0"}


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv")
def test_a_floor_that_does_not_resolve_names_what_did_and_uvs_reason(tmp_path):
    # xxhash 3.4.0 is yanked: a resolver takes 3.4.1 for xxhash>=3.4 unless 3.4.0 is pinned exactly.
    lines = ["xxhash>=3.4"]
    by_package = {"packages/engine-core": _reqs(*lines)}
    problems = floors_not_resolved(by_package, lines, tmp_path, {"xxhash": Version("3.4.1")})
    (problem,) = problems
    assert problem.startswith(
        "packages/engine-core/pyproject.toml declares xxhash>=3.4, but resolving every floor together installs "
        "xxhash 3.4.1, so 3.4 is never tested. Raise the floor to xxhash>=3.4.1 in every package that declares "
        "it, or see uv, with xxhash==3.4 pinned:\n"
    )
    assert "yanked" in problem


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv")
def test_two_floors_that_cannot_both_hold_are_named_together(tmp_path):
    # tensordict 0.15.0 and 0.15.1 need torch>=2.13: torch>=2.11 beside tensordict>=0.15 never installs both floors.
    lines = ["tensordict>=0.15", "torch>=2.11"]
    by_package = {"packages/engine-core": _reqs(*lines)}
    resolved = {"torch": Version("2.13.0"), "tensordict": Version("0.15.0")}
    (problem,) = floors_not_resolved(by_package, lines, tmp_path, resolved)
    assert problem.endswith(
        "uv, with torch==2.11 pinned:\n    with torch==2.11 the others resolve to tensordict 0.15.2 (declared "
        ">=0.15): these floors cannot all hold at once, so raise this one or those"
    )


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv")
def test_a_compile_resolves_the_floors_whatever_an_earlier_compile_pinned(tmp_path):
    """uv prefers the versions an existing output file pins: the second core floor's group of the floor run
    resolved pyyaml 6.0.4 and tqdm 4.70.1 (the first group's transitive picks) for floors 6 and 4.66."""
    (tmp_path / "floors.txt").write_text("xxhash==3.5.0\n")
    compiled = compile_lowest(["xxhash>=3.4.1"], tmp_path, "floors")
    assert compiled.returncode == 0, compiled.stderr
    assert resolved_versions(tmp_path / "floors.txt") == {"xxhash": Version("3.4.1")}


def test_a_two_part_floor_names_the_three_part_release():
    """``>=0.2`` admits core 0.2.0, cut at tag ``drivetrain-engine-core-v0.2.0``: looking for ``-v0.2`` failed."""
    assert release_version(Version("0.2")) == Version("0.2.0")
    assert release_version(Version("0.2.1")) == Version("0.2.1")


def _git(root: Path, *args: str) -> str:
    identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
    return subprocess.run(
        ["git", *identity, *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout


def _commit_version(root: Path, version: str, note: str) -> str:
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "pyproject.toml").write_text(f'[project]\nname = "p"\nversion = "{version}"\n# {note}\n')
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", note)
    return _git(root, "rev-parse", "HEAD").strip()


def test_a_cut_is_found_without_tags_as_the_first_commit_declaring_its_version(tmp_path):
    """CI clones without tags: core 0.2.1, the toy example's floor, was looked up by tag only and the floor run
    stopped (`core 0.2.1 is not at 'drivetrain-engine-core-v0.2.1'`)."""
    _git(tmp_path, "init", "-q")
    _commit_version(tmp_path, "0.1.0", "start")
    cut_020 = _commit_version(tmp_path, "0.2.0", "release 0.2.0")
    _commit_version(tmp_path, "0.2.0", "a fix after the cut")
    cut_021 = _commit_version(tmp_path, "0.2.1", "release 0.2.1")
    _commit_version(tmp_path, "0.2.1", "another fix")
    assert cut_commit("p", "pkg", Version("0.2.0"), root=tmp_path) == cut_020
    assert cut_commit("p", "pkg", Version("0.2.1"), root=tmp_path) == cut_021
    assert cut_commit("p", "pkg", Version("0.3.0"), root=tmp_path) is None
    _git(tmp_path, "tag", "p-v0.2.0", "HEAD")
    assert (
        cut_commit("p", "pkg", Version("0.2.0"), root=tmp_path) == _git(tmp_path, "rev-parse", "HEAD").strip()
    )


def test_this_repositorys_older_core_cut_is_found_in_a_clone_without_tags(tmp_path):
    """Core 0.2.1 was cut at 5ce0386 (its tag's commit), found alike with and without tags."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-tags", "--shared", str(ROOT), str(clone)], check=True)
    assert _git(clone, "tag", "--list") == ""
    assert cut_commit(CORE, "packages/engine-core", Version("0.2.1"), root=clone).startswith("5ce0386e698f")
    assert cut_commit(CORE, "packages/engine-core", Version("0.2.1")).startswith("5ce0386e698f")
