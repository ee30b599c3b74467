"""The install hint for a missing command, and the one silenced upstream log."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
from click.testing import CliRunner
from drivetrain_engine_core._cli import missing_command_message
from drivetrain_engine_core._plugins import reset_plugins
from drivetrain_engine_core._upstream_noise import silence_upstream_noise
from drivetrain_engine_core.job import build_cli


def test_missing_first_party_command_names_the_distribution(monkeypatch) -> None:
    monkeypatch.setenv("DRIVETRAIN_DISABLE_PLUGINS", "roles")
    reset_plugins()
    try:
        result = CliRunner().invoke(build_cli(), ["sft"])
    finally:
        monkeypatch.delenv("DRIVETRAIN_DISABLE_PLUGINS")
        reset_plugins()
    assert result.exit_code == 2
    assert (
        "No such command 'sft': drivetrain-roles" in result.output and "drivetrain plugins" in result.output
    )

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert missing_command_message("sft") == (
        "No such command 'sft': it comes from drivetrain-roles, which is not installed. Install it with: "
        "pip install drivetrain-roles"
    )


@pytest.mark.parametrize(
    ("name", "noise"),
    [
        (
            "torch.fx._symbolic_trace",
            "is_fx_tracing will return true for both fx.symbolic_trace and torch.export. Please use ...",
        ),
        ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='/usr/local'"),
    ],
)
def test_only_the_known_noise_records_are_silenced(caplog: pytest.LogCaptureFixture, name, noise) -> None:
    logger = logging.getLogger(name)
    silence_upstream_noise()
    silence_upstream_noise()  # idempotent
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning(noise)
        logger.warning("another message of that logger")
    assert [r.getMessage() for r in caplog.records] == ["another message of that logger"]
    assert len([f for f in logger.filters if type(f).__name__ == "_DropMessage"]) == 1
