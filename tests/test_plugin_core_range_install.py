"""A plugin wheel beside the core wheel in a fresh venv, with the real installed metadata: the example plugin as
last released loads where its core range admits this core and is listed incompatible where it does not; one
built for the next core minor is listed incompatible, in one line, never imported (docs/versioning.md).

Plugins go in with ``--no-deps``, as a plugin already installed stays when ``pip install -U`` moves core on.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/drivetrain-toy-engine"
CORE = "drivetrain-engine-core"
LAST_RELEASE_REF = tomllib.loads((REPO / ".ci" / "releases.toml").read_text())["drivetrain-toy-engine"]["ref"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("uv") is None or shutil.which("git") is None, reason="needs uv and git"),
]


def _run(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _wheel(source: Path | str, out: Path) -> Path:
    before = set(out.glob("*.whl"))
    _run("uv", "build", "--quiet", "--wheel", "-o", out, source)
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


def _core_range(wheel: Path) -> Requirement:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    requires = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    (core,) = [r for r in requires if r.name == CORE]
    return core


def _plugins(bin_dir: Path) -> tuple[dict[str, dict], str]:
    listed = _run(bin_dir / "drivetrain", "plugins", "--json")
    return {p["name"]: p for p in json.loads(listed.stdout)}, listed.stderr


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[Path, Path]:
    """A fresh venv with the core wheel alone, and the folder the wheels are built into."""
    root = tmp_path_factory.mktemp("core-range")
    core_wheel = _wheel(REPO / "packages" / "engine-core", root)
    _run("uv", "venv", "--quiet", "--python", sys.executable, root / "venv")
    _run("uv", "pip", "install", "--quiet", "--python", root / "venv" / "bin" / "python", core_wheel)
    return root / "venv", root


def _install(venv: Path, wheel: Path) -> None:
    _run(
        "uv",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--reinstall",
        "--python",
        venv / "bin" / "python",
        wheel,
    )


def test_the_last_released_plugin_loads_where_its_range_admits_this_core(venv):
    env, root = venv
    if subprocess.run(["git", "cat-file", "-e", f"{LAST_RELEASE_REF}^{{commit}}"], cwd=REPO).returncode != 0:
        pytest.skip(f"{LAST_RELEASE_REF} is not in this clone")
    old = root / "old"
    old.mkdir()
    archive = subprocess.run(
        ["git", "archive", LAST_RELEASE_REF, EXAMPLE], cwd=REPO, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
    wheel = _wheel(old / EXAMPLE, root)
    _install(env, wheel)
    core = Version(importlib.metadata.version(CORE))
    admitted = _core_range(wheel).specifier.contains(core, prereleases=True)
    listed, stderr = _plugins(env / "bin")
    assert listed["toy"]["status"] == ("loaded" if admitted else "incompatible"), stderr
    assert ("is incompatible" in stderr) == (not admitted)


def test_a_plugin_built_for_the_next_core_minor_is_listed_incompatible_in_one_line(venv):
    env, root = venv
    core = Version(importlib.metadata.version(CORE))
    future = f">={core.major}.{core.minor + 1},<{core.major}.{core.minor + 2}"
    copy = root / "future"
    shutil.copytree(REPO / EXAMPLE, copy, ignore=shutil.ignore_patterns("build", "dist", "__pycache__"))
    pyproject = (copy / "pyproject.toml").read_text()
    pyproject = re.sub(r'"drivetrain-engine-core\[testing\][^"]*"', f'"{CORE}[testing]{future}"', pyproject)
    (copy / "pyproject.toml").write_text(pyproject.replace('version = "', 'version = "9', 1))
    wheel = _wheel(copy, root)
    declared = _core_range(wheel).specifier
    _install(env, wheel)

    listed, _ = _plugins(env / "bin")
    assert (listed["toy"]["status"], listed["toy"]["registered"]) == ("incompatible", [])
    result = subprocess.run(
        [env / "bin" / "drivetrain", "engines"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0
    assert "no engines registered" in result.stdout
    version = listed["toy"]["version"]
    assert result.stderr == (
        f"drivetrain: plugin 'toy' (drivetrain-toy-engine {version}) is incompatible: requires {CORE}{declared} "
        f"but {CORE} {core} is installed, so it is not loaded. Install a release of it built for this core: "
        f'pip install --upgrade drivetrain-toy-engine "{CORE}=={core}" (or keep this one and install the core '
        f'it was built for: pip install "{CORE}{declared}")\n'
    )
