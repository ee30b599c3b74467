"""The commands' presets: the values ``model.path`` (an embedded task, or any other model) and GRPO's
``trainer.mode`` pick, laid under the user's file and overrides, and named beside each value in
``--print-config``. The expected values are the presets' as the README and the reference pages state them."""

from __future__ import annotations

import re

import pytest
import yaml
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli

_LINE = re.compile(r"^(?P<indent>(?:  )*)(?P<key>\w+):(?: (?P<value>[^#]*?))?(?:  # (?P<source>.*))?$")


def printed(command: str, *overrides: str) -> tuple[dict, dict[str, str]]:
    """``drivetrain <command> --print-config <overrides>``: the YAML loaded, and the comment of each dotted key."""
    result = CliRunner().invoke(drivetrain_cli, [command, "--print-config", *overrides])
    assert result.exit_code == 0, result.output
    sources, path = {}, []
    for line in result.output.splitlines():
        match = _LINE.match(line)
        if match:
            path = [*path[: len(match["indent"]) // 2], match["key"]]
            if match["source"]:
                sources[".".join(path)] = match["source"]
    return yaml.safe_load(result.output), sources


def test_a_users_model_gets_the_user_model_preset_and_the_user_beats_it() -> None:
    config, sources = printed("sft", "model.path=/models/instruct", "optimizer.lr=3e-6")
    assert (config["data"]["max_length"], config["trainer"]["max_new_tokens"]) == (1024, 256)
    assert sources["data.max_length"] == sources["trainer.max_new_tokens"] == "preset user-model"
    assert (config["optimizer"]["lr"], sources["optimizer.lr"]) == (
        3e-6,
        "command line",
    )  # not the preset's 1e-5
    assert sources["model.path"] == "command line"
    # The embedded model's values are the command's own defaults: no preset sets anything but the device.
    config, sources = printed("sft")
    assert (config["data"]["max_length"], config["optimizer"]["lr"]) == (32, 3e-3)
    assert sources == {"engine.device": "preset machine"}


@pytest.mark.parametrize(
    ("command", "overrides", "expected"),
    [
        (
            "dpo",
            ["model.path=/models/instruct"],
            {"warm_start.sft_steps": 0, "optimizer.lr": 1e-6, "dpo.beta": 0.1, "data.max_length": 1024},
        ),
        (
            "grpo",
            ["model.path=builtin:multistep"],
            {"trainer.total_steps": 60, "trainer.prompts_per_step": 8, "rollout.max_new_tokens": 96},
        ),
        ("grpo", ["trainer.mode=async"], {"algorithm.rollout_is_cap": 2.0}),
        (
            "ppo",
            ["model.path=/models/instruct"],
            {"optimizer.lr": 1e-6, "critic.optimizer.lr": 1e-5, "rollout.max_new_tokens": 256},
        ),
    ],
)
def test_each_preset_is_named_beside_the_values_it_sets(command, overrides, expected) -> None:
    config, sources = printed(command, *overrides)
    preset = {
        "model.path=/models/instruct": "preset user-model",
        "model.path=builtin:multistep": "preset builtin:multistep",
        "trainer.mode=async": "preset off-policy",
    }[overrides[0]]
    for key, value in expected.items():
        section, _, name = key.rpartition(".")
        node = config
        for part in section.split("."):
            node = node[part]
        assert (node[name], sources[key]) == (value, preset), key
