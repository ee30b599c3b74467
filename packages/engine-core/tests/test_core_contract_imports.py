"""Core is the engine contract: its faces load no job-runtime library (OmegaConf, psutil).

A backend author installs core and a backend; the command config layer, trackers and process plumbing live in
drivetrain-roles. Core's one config builder (``config_build``) stands on OmegaConf, imported only when a config
is built, never by importing the surface. Checked in a fresh interpreter, where ``sys.modules`` shows every
module the imports pulled in.
"""

from __future__ import annotations

import json
import subprocess
import sys

FACES = ("backend", "kit", "rollout", "job")
RUNTIME_LIBRARIES = ("omegaconf", "psutil")

PROBE = f"""
import importlib, json, sys
def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] in {RUNTIME_LIBRARIES!r} + ("drivetrain_roles",))
for face in {FACES!r}:
    module = importlib.import_module(f"drivetrain_engine_core.{{face}}")
    for name in module.__all__:
        getattr(module, name)
print(json.dumps(loaded()))
from drivetrain_engine_core.backend import ModelConfig
from drivetrain_engine_core.job import config_from_dict
config_from_dict(ModelConfig, {{"path": "/m", "lora": {{"rank": 4}}}})
print(json.dumps(loaded()))
"""


def test_the_faces_import_no_runtime_library_and_building_a_config_only_omegaconf() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    surface, building = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert surface == []
    assert building and {m.split(".")[0] for m in building} == {"omegaconf"}
