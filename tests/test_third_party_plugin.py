"""A backend published outside this repository works: the example plugin, installed into a fresh venv next
to a non-editable drivetrain-engine-core, is listed by ``drivetrain engines`` and passes the conformance kit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "drivetrain-toy-engine"


def run(*command: str | Path, cwd: Path = ROOT, timeout: int = 300) -> str:
    """Run a command, failing the test with its output when it exits non-zero."""
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_example_plugin_installs_lists_and_passes_the_conformance_kit(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH; install it to run the third-party plugin test")
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    run(uv, "venv", "--quiet", "--python", sys.executable, venv)  # the interpreter running the tests
    run(
        uv, "pip", "install", "--quiet", "--python", python,
        f"{ROOT / 'packages' / 'engine-core'}[testing]", EXAMPLE, "pytest",
    )  # fmt: skip

    engines = json.loads(run(venv / "bin" / "drivetrain", "engines", "--json"))
    assert {(e["model_type"], e["backend"], e["device"], e["distribution"]) for e in engines} == {
        ("language_model", "toy", "*", "drivetrain-toy-engine")
    }

    report = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=EXAMPLE, timeout=600)
    assert " passed" in report and "failed" not in report and "error" not in report
