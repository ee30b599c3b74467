"""drivetrain's one config builder (``config_build``, on OmegaConf structured configs): what it accepts, how it
converts values as YAML and the command line give them, and the message it gives for each mistake.

Every expected value and message is written out here (the commands' layered config goes through the same
builder, so there is no second builder to agree with)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core._config_build import build_layers
from drivetrain_engine_core.backend import ConfigError, EngineConfig, LoraConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig, config_from_dict


@pytest.mark.parametrize(
    ("cls", "values", "built"),
    [
        (ModelConfig, {"path": 5}, ModelConfig(path="5")),
        (
            ModelConfig,
            {"path": "/m", "gradient_checkpointing": "yes"},
            ModelConfig(path="/m", gradient_checkpointing=True),
        ),
        (
            ModelConfig,
            {"path": "/m", "gradient_checkpointing": 0},
            ModelConfig(path="/m", gradient_checkpointing=False),
        ),
        (
            ModelConfig,
            {"path": "/m", "lora": {"rank": "4", "alpha": "5e-3", "target_modules": ["q_proj"]}},
            ModelConfig(path="/m", lora=LoraConfig(rank=4, alpha=0.005, target_modules=("q_proj",))),
        ),
        (ModelConfig, {"path": "/m", "lora": None}, ModelConfig(path="/m", lora=None)),
        (
            OptimizerConfig,
            {"lr": 3, "betas": [0.9, 0.95], "clip_grad": None, "total_steps": 10},
            OptimizerConfig(lr=3.0, betas=(0.9, 0.95), clip_grad=None, total_steps=10),
        ),
        # Setting one micro-batch limit clears the other (exclusive_fields).
        (MicroBatchConfig, {"max_tokens": 64}, MicroBatchConfig(micro_batch_size=None, max_tokens=64)),
    ],
)
def test_values_as_yaml_gives_them_are_converted_to_the_annotation(cls, values, built) -> None:
    assert config_from_dict(cls, values) == built  # a list becomes the annotated tuple: [0.9] != (0.9,)


M = "ModelConfig"


@pytest.mark.parametrize(
    ("cls", "values", "message"),
    [
        (ModelConfig, {}, f"{M}.path is required and has no default; set it."),
        (
            ModelConfig,
            {"path": "/m", "gradient_checkpointing": "maybe"},
            f"{M}.gradient_checkpointing='maybe' is not a valid bool; write true or false, e.g. "
            f"{M}.gradient_checkpointing=false.",
        ),
        (
            ModelConfig,
            {"path": "/m", "model_type": "reward"},
            f"{M}.model_type='reward' is not a valid 'language_model' | 'value_model'; write a value of type "
            "'language_model' | 'value_model'.",
        ),
        (
            ModelConfig,
            {"path": "/m", "lora": {"rank": 4.5}},
            f"{M}.lora.rank=4.5 is not a valid int; write a whole number, e.g. {M}.lora.rank=100.",
        ),
        (
            ModelConfig,
            {"path": "/m", "lora": {"rank": True}},
            f"{M}.lora.rank=True is not a valid int; write a whole number, e.g. {M}.lora.rank=100.",
        ),
        (ModelConfig, {"path": "/m", "lora": {"rank": 0}}, "lora.rank must be positive, got 0."),
        (
            ModelConfig,
            {"path": "/m", "lora": {"rnak": 4}},
            f"unknown option {M}.lora.rnak; known options: ['alpha', 'dropout', 'rank', 'target_modules']. "
            "Did you mean 'rank'?",
        ),
        (
            ModelConfig,
            {"path": "/m", "lora": {"target_modules": "q_proj"}},
            f"{M}.lora.target_modules='q_proj' is not a valid tuple[str, ...]; write a list in brackets, e.g. "
            f"{M}.lora.target_modules=[a, b] (one item: {M}.lora.target_modules=[a]).",
        ),
        (
            ModelConfig,
            {"path": "/m", "lora": 3},
            f"{M}.lora is a section of options, but it is given the value 3; write its options under it (in YAML "
            f"`lora:` then one indented `option: value` per line, or {M}.lora.<option>=<value> on the command line).",
        ),
        (
            OptimizerConfig,
            {"betas": [0.9]},
            "OptimizerConfig.betas=[0.9] is not a valid tuple[float, float]; write a list of exactly 2 values in "
            "brackets, e.g. OptimizerConfig.betas=[a, b].",
        ),
        (
            OptimizerConfig,
            {"lr": "fast"},
            "OptimizerConfig.lr='fast' is not a valid float; write a number, e.g. OptimizerConfig.lr=0.5.",
        ),
        (
            OptimizerConfig,
            {"warmup_steps": None},
            "OptimizerConfig.warmup_steps=None is not a valid int; write a whole number, e.g. "
            "OptimizerConfig.warmup_steps=100.",
        ),
        (
            MicroBatchConfig,
            {"micro_batch_size": 2, "max_tokens": 64},
            "micro_batch: set exactly one of micro_batch_size (fixed) or max_tokens (dynamic), got "
            "micro_batch_size=2, max_tokens=64.",
        ),
    ],
)
def test_each_mistake_is_one_message_naming_the_field_and_the_fix(cls, values, message) -> None:
    with pytest.raises(ConfigError) as error:
        config_from_dict(cls, values)
    assert str(error.value) == message


def test_layers_merge_in_order_and_a_section_takes_the_class_it_is_given() -> None:
    """Later layers win key by key; a section typed by another class (a backend's engine config) is built and
    checked as that class; a layer named by ``sources`` is named in its messages."""
    from dataclasses import dataclass, field

    @dataclass(kw_only=True, frozen=True)
    class Knobbed(EngineConfig):
        knob: int = 3

    @dataclass(kw_only=True, frozen=True)
    class Command:
        engine: EngineConfig = field(default_factory=EngineConfig)
        optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    layers = [{"optimizer": {"lr": 0.5, "eps": 1e-6}}, {"optimizer": {"lr": "2e-3"}, "engine": {"knob": "7"}}]
    built = build_layers(Command, layers, sections={"engine": Knobbed})
    assert built.optimizer == OptimizerConfig(lr=0.002, eps=1e-6)
    assert built.engine == Knobbed(knob=7)
    with pytest.raises(ConfigError) as error:
        build_layers(Command, [{"optimizer": 5}], sources=["the config file"])
    assert str(error.value).startswith(
        "optimizer is a section of options, but the config file gives it the value 5;"
    )
