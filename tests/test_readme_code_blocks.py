"""Every README code block runs as written on CPU, or says why not in its info string.

Blocks run in document order, one README per fresh process, in an empty temporary directory: ``python``
blocks share one namespace (a later block may use what an earlier one built), ``bash`` blocks run in a shell
with the workspace's ``drivetrain`` on ``PATH``. A block that must not run here names its reason after the
language, ``notest-<reason>`` with a reason from :data:`REASONS`, e.g. ````bash notest-install````.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
READMES = sorted(
    [REPO / "README.md", *REPO.glob("packages/*/README.md"), *REPO.glob("examples/*/README.md")],
    key=lambda p: str(p.relative_to(REPO)),
)
LANGUAGES = ("python", "bash")
REASONS = {
    "install": "installs packages (pip/uv) into the environment",
    "long": "the full main job or the whole test suite (minutes)",
    "gpu": "needs CUDA devices",
    "ray": "starts a Ray cluster (tests/test_roles_ray_worker_group.py runs the same calls)",
    "plugin": "needs a plugin that is not installed in the workspace (tests/test_third_party_plugin.py installs it)",
    "user-files": "runs on the user's own model or data files, which the block names but does not make",
}
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)

pytestmark = pytest.mark.slow


def code_blocks(readme: Path) -> list[tuple[str, list[str], str]]:
    """``(language, notest reasons, code)`` of every fenced block."""
    blocks = []
    for info, code in _FENCE.findall(readme.read_text()):
        language, *tags = info.split()
        reasons = [t.removeprefix("notest-") for t in tags if t.startswith("notest-")]
        blocks.append((language, reasons, code))
    return blocks


def test_every_block_runs_or_names_a_known_reason() -> None:
    for readme in READMES:
        for language, reasons, code in code_blocks(readme):
            where = f"{readme.relative_to(REPO)} block {code.splitlines()[0]!r}"
            assert language in (*LANGUAGES, "text", "yaml"), f"{where}: unknown language {language!r}"
            assert all(r in REASONS for r in reasons), (
                f"{where}: notest reasons must be among {sorted(REASONS)}"
            )


_DRIVER = """
import subprocess, sys
namespace = {"__name__": "__readme__"}
for language, code in BLOCKS:
    if language == "python":
        exec(compile(code, "<readme block>", "exec"), namespace)
    else:
        subprocess.run(["bash", "-euo", "pipefail", "-c", code], check=True)
"""


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO).parent))
def test_readme_blocks_run_as_written(readme: Path, tmp_path: Path) -> None:
    runnable = [
        (lang, code) for lang, reasons, code in code_blocks(readme) if lang in LANGUAGES and not reasons
    ]
    if not runnable:
        pytest.skip(f"{readme.relative_to(REPO)} has no runnable block")
    driver = f"BLOCKS = {runnable!r}\n{textwrap.dedent(_DRIVER)}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, "-c", driver], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, (
        f"{readme.relative_to(REPO)}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
