"""drivetrain-engine-core installs and runs alone, and every plugin depends on it by a compatible range.

Builds real wheels with ``uv build``, installs core into a fresh venv (no transformers, peft or
megatron-core, and none of the job runtime's libraries: psutil), and runs the ``drivetrain`` console script
and core's config builder (on OmegaConf, core's one config library) there. Fast with a warm uv cache.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CORE = "drivetrain-engine-core"
PLUGINS = (
    "drivetrain-engine-fsdp",
    "drivetrain-engine-megatron",
    "drivetrain-roles",
    "drivetrain-ckpt-tools",
)
HEAVY = ("transformers", "peft", "megatron")
JOB_RUNTIME = ("psutil",)
"""What drivetrain-roles' job runtime needs and a backend author's install (core + a backend) does not."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("uv") is None, reason="uv is not on PATH; it builds the wheels and the venv"
    ),
]


def _run(*args: str | Path, cwd: Path = REPO) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _wheel(dist_dir: Path, distribution: str) -> Path:
    _run("uv", "build", "--package", distribution, "--wheel", "-o", dist_dir)
    (wheel,) = dist_dir.glob(f"{distribution.replace('-', '_')}-*.whl")
    return wheel


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    return [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("isolated")
    wheel = _wheel(root / "dist", CORE)
    _run("uv", "venv", root / "venv", "--python", f"{sys.version_info.major}.{sys.version_info.minor}")
    python = root / "venv" / "bin" / "python"
    _run("uv", "pip", "install", "--python", python, wheel)
    return root / "venv" / "bin"


def test_core_alone_imports_and_lists(core_venv):
    probe = f"import importlib.util as u, json; print(json.dumps([m for m in {HEAVY!r} if u.find_spec(m)]))"
    assert json.loads(_run(core_venv / "python", "-c", probe)) == [], "the isolated venv must lack backends"
    runtime = (
        f"import importlib.util as u, json; print(json.dumps([m for m in {JOB_RUNTIME!r} if u.find_spec(m)]))"
    )
    assert json.loads(_run(core_venv / "python", "-c", runtime)) == [], (
        "core must not install the job runtime"
    )
    assert json.loads(_run(core_venv / "drivetrain", "plugins", "--json")) == []
    assert "no engines registered" in _run(core_venv / "drivetrain", "engines")
    no_torch = (
        "import sys\n"
        "import drivetrain_engine_core\n"
        "from drivetrain_engine_core._cli import main\n"
        "main(['engines', '--json'], standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, 'listing engines must not import torch'\n"
    )
    assert _run(core_venv / "python", "-c", no_torch).strip() == "[]"
    build = "from drivetrain_engine_core._config import ModelConfig, config_from_dict as b; print(b(ModelConfig, {'path': 5}).path)"
    assert _run(core_venv / "python", "-c", build).strip() == "5"


def test_plugins_depend_on_core_by_range(tmp_path):
    """Each plugin admits the core beside it and no core minor that may break it (docs/versioning.md)."""
    current = Version(importlib.metadata.version(CORE))
    breaking = Version(f"0.{current.minor + 1}") if current.major == 0 else Version(f"{current.major + 1}")
    for distribution in PLUGINS:
        (core,) = [r for r in _requires(_wheel(tmp_path, distribution)) if r.name == CORE]
        assert core.specifier.contains(current), f"{distribution} requires {core}, not the core beside it"
        assert not core.specifier.contains(breaking), f"{distribution} requires {core}, admitting {breaking}"
        assert all(spec.operator != "==" for spec in core.specifier), f"{distribution} pins core with =="
