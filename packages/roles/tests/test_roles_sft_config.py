"""``drivetrain sft``'s config: built on the job runtime's config layer, one source of defaults, printable and documented."""

from __future__ import annotations

import dataclasses
import re
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_engine_core.backend import ConfigError, EngineConfig
from drivetrain_roles.jobs.config_reference import reference_page
from drivetrain_roles.runtime.command_config import describe_fields, to_plain
from drivetrain_roles.sft.config import SFTConfig, load_config

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.total_steps=abc", "trainer.total_steps='abc' is not a valid int; write a whole number"),
        ("trainer.total_steps=2.5", "trainer.total_steps=2.5 is not a valid int; write a whole number"),
        (
            "data.train_files=/abs/train.jsonl",
            r"data.train_files='/abs/train.jsonl' is not a valid tuple\[str, \.\.\.\]; write a list in brackets, "
            r"e.g. data.train_files=\[a, b\]",
        ),
        ("trainer.progress_bar=nope", "trainer.progress_bar='nope' is not a valid bool; write true or false"),
        ("model.use_remove_padding=maybe", "model.use_remove_padding='maybe' is not a valid bool"),
        ("trainer.report_to=[jsonl, wandbb]", "trainer.report_to names 'wandbb';.*Did you mean 'wandb'"),
        # Accepted by --print-config; a run then failed at the process group ("has no collective backend").
        ("engine.device=gpu", r"engine.device='gpu' is not a device type torch knows; write 'cpu' or 'cuda'"),
        # OmegaConf names no key here ("SFTConfig: TupleConfig length 1 does not match type hint length 2").
        (
            "optimizer.betas=[0.9]",
            r"optimizer.betas=\[0.9\] is not a valid tuple\[float, float\]; write a list of exactly 2 values",
        ),
    ],
)
def test_the_issues_bad_values_are_refused_naming_the_field(override, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_one_source_of_defaults_and_derived_schedule() -> None:
    config, declared = load_config(), SFTConfig()
    # The dataclass defaults are the command's defaults; the engine section becomes the backend's class.
    assert dataclasses.replace(config, engine=declared.engine) == declared
    base_fields = [f.name for f in dataclasses.fields(EngineConfig)]
    assert [getattr(config.engine, n) for n in base_fields] == [
        getattr(declared.engine, n) for n in base_fields
    ]
    assert (config.optimizer.lr, config.optimizer.lr_schedule, config.engine.micro_batch.max_tokens) == (
        3e-3,
        "cosine",
        2048,
    )
    short = load_config(None, ["trainer.total_steps=50"]).run_optimizer()
    assert (short.total_steps, short.warmup_steps) == (50, 5)
    assert (
        load_config(None, ["trainer.total_steps=50", "optimizer.warmup_steps=0"]).run_optimizer().warmup_steps
        == 0
    )


def test_print_config_is_the_resolved_yaml_and_loads_back(tmp_path) -> None:
    result = CliRunner().invoke(drivetrain_cli, ["sft", "--print-config", "trainer.total_steps=40"])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.output)
    assert printed["trainer"]["total_steps"] == 40 and printed["optimizer"]["total_steps"] is None
    assert printed["engine"]["fsdp_size"] == -1  # the backend's own fields are part of it
    (tmp_path / "resolved.yaml").write_text(result.output)
    assert load_config(tmp_path / "resolved.yaml") == load_config(None, ["trainer.total_steps=40"])
    assert printed == to_plain(load_config(None, ["trainer.total_steps=40"]))


def test_help_config_lists_every_field_with_type_default_and_help() -> None:
    result = CliRunner().invoke(drivetrain_cli, ["sft", "--help-config"])
    assert result.exit_code == 0, result.output
    fields = describe_fields(load_config())
    assert len(fields) > 50 and all(f"{f.name}: {f.type} = " in result.output for f in fields)
    assert "data.train_files: tuple[str, ...] = []\n    parquet/jsonl files" in result.output
    assert all(f.help for f in fields), [f.name for f in fields if not f.help]


def test_shipped_example_yaml_holds_the_defaults() -> None:
    example = files("drivetrain_roles.sft").joinpath("example.yaml")
    assert load_config(str(example)) == load_config()


def test_reference_page_is_generated_from_the_dataclasses() -> None:
    assert (REPO / "docs" / "sft-config.md").read_text() == reference_page(), (
        "docs/sft-config.md is stale; regenerate it with "
        'python -c "from drivetrain_roles.jobs.config_reference import reference_page; '
        "open('docs/sft-config.md', 'w').write(reference_page())\""
    )


@pytest.mark.parametrize("command", ["sft", "dpo", "rm", "grpo", "ppo"])
def test_reference_pages_name_no_private_module(command) -> None:
    """The field help named ``drivetrain_engine_core._throughput``, a module users cannot rely on."""
    names = re.findall(r"drivetrain_\w+(?:\.\w+)+", reference_page(command))
    assert [n for n in names if any(part.startswith("_") for part in n.split("."))] == []


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_model_path_that_is_not_a_model_directory_is_one_line_before_anything_starts(
    tmp_path, nproc
) -> None:
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        drivetrain_cli, ["sft", "--nproc", nproc, "--output-dir", str(run_dir), "model.path=/nonexistent"]
    )
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: model.path=/nonexistent does not exist; set model.path to a local Hugging Face model directory "
        "(config.json, weights, tokenizer), a Hub repository id such as Qwen/Qwen2.5-0.5B-Instruct, or an "
        "embedded model: builtin:arithmetic or builtin:multistep or builtin:calculator."
    ]
    assert not run_dir.exists()
