"""The command line answers without torch or transformers where it needs neither: ``drivetrain --help``, every
config-driven command's ``--help``, ``--help-config`` and ``--print-config``, and ``ckpt ls`` (which builds the
backend's checkpoint merger of each complete step, fsdp's and megatron's here).

Their import took 8-30 s on two busy cores before anything printed (about 2,000 modules, torch's among them, for
a config listing). Checked in a fresh interpreter, where ``sys.modules`` shows what the commands pulled in; the
count, not the time, so that a busy machine cannot fail it.
"""

from __future__ import annotations

import json
import subprocess
import sys

from drivetrain_roles.runtime.command_config.machine import may_see_a_gpu

COMMANDS = ("sft", "dpo", "rm", "grpo", "ppo")

PROBE = f"""
import json, sys, tempfile
from pathlib import Path
from click.testing import CliRunner
from drivetrain_engine_core._checkpoint import Manifest, step_dir_name, write_manifest
from drivetrain_engine_core._cli import build_cli

root = Path(tempfile.mkdtemp())
for step, backend in enumerate(("fsdp", "megatron"), start=1):
    (root / step_dir_name(step) / "optimizer").mkdir(parents=True)
    (root / step_dir_name(step) / "optimizer" / "shard").write_bytes(b"state")
    write_manifest(root / step_dir_name(step), Manifest(
        backend=backend, global_step=step, world_size=1, model_type="language_model", model_path="/m"))
cli, runner = build_cli(), CliRunner()
listing = runner.invoke(cli, ["ckpt", "ls", str(root)]).output
assert listing.count("optimizer: per-parameter") == 1 and listing.count("optimizer: distributed") == 1, listing
calls = [["--help"]]
for command in {COMMANDS!r}:
    calls += [[command, "--help"], [command, "--help-config"], [command, "--print-config"]]
for args in calls:
    result = runner.invoke(cli, args)
    assert result.exit_code == 0 and result.output, (args, result.output, result.exception)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {{"torch", "transformers"}})))
"""


def test_help_config_listings_and_ckpt_ls_import_neither_torch_nor_transformers() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert not [m for m in loaded if m.split(".")[0] == "transformers"]
    # NOTE: where a GPU may be visible, the engine's default device is torch's answer, which costs its import.
    if not may_see_a_gpu():
        assert loaded == []
