"""``drivetrain env`` (added by drivetrain-roles to core's CLI root) prints what a bug report needs."""

from __future__ import annotations

import importlib.metadata
import json

from click.testing import CliRunner
from drivetrain_engine_core.job import build_cli, plugins


def test_env_prints_torch_libraries_and_every_plugin() -> None:
    result = CliRunner().invoke(build_cli(), ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["libraries"]["torch"] == importlib.metadata.version("torch")
    assert report["libraries"]["transformers"] == importlib.metadata.version("transformers")
    assert report["libraries"]["megatron-core"] == importlib.metadata.version("megatron-core")
    assert {"cuda_build", "cuda_available", "nccl"} <= set(report["accelerator"])
    for info in plugins().plugins:
        assert report["plugins"][info.name].startswith(f"{info.distribution} {info.version}")
    text = CliRunner().invoke(build_cli(), ["env"]).output
    assert f"  torch: {importlib.metadata.version('torch')}" in text
