"""Typed configuration of the SFT trainer and its loading from YAML plus dotted overrides.

A run's config is the embedded defaults (the tiny arithmetic job), then a YAML file, then command-line
overrides such as ``engine.micro_batch.max_tokens=512`` (values parsed as YAML scalars). Sections map
one-to-one onto frozen dataclasses; the ``engine`` section is built by the chosen backend's own config class
through core's factory, so backend knobs (``engine.ulysses_sequence_parallel_size``) are checked too.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drivetrain_engine_core.config import (
    CheckpointConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    OptimizerConfig,
    config_from_dict,
)

from ..losses.aggregation import AGGREGATION_MODES
from .default_assets import BUILTIN_MODEL

DEFAULTS: dict[str, Any] = {
    "model": {"path": BUILTIN_MODEL},
    "engine": {"backend": "fsdp", "micro_batch": {"micro_batch_size": None, "max_tokens": 2048}},
    "optimizer": {
        "lr": 5e-3,
        "weight_decay": 0.0,
        "lr_schedule": "cosine",
        "min_lr_ratio": 0.1,
        "clip_grad": 1.0,
    },
    "checkpoint": {"max_ckpt_to_keep": 2},
}
"""Section values that differ from the dataclass defaults: those of the embedded arithmetic job."""


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the examples come from and how they are tokenised.

    Attributes:
        train_files: parquet/jsonl files; empty selects the generated arithmetic data set.
        val_files: held-out files; empty with generated data uses the generated held-out split, empty with
            user files disables held-out evaluation.
        prompt_key, response_key: columns of prompt/response pairs (loss on the response).
        messages_key: column of chat messages (rendered with the tokenizer's chat template; loss on the last
            assistant turn); when set, prompt/response columns are not read.
        max_length: token budget of one example (prompt + response); longer examples are an error.
        generated_train_size, generated_val_size: sizes of the generated arithmetic splits.
    """

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str | None = None
    max_length: int = 32
    generated_train_size: int = 2000
    generated_val_size: int = 200

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2 tokens, got {self.max_length}.")
        if self.generated_train_size < 1 or self.generated_val_size < 0:
            raise ConfigError("data.generated_train_size must be >= 1 and data.generated_val_size >= 0.")

    @property
    def generated(self) -> bool:
        """Whether the run uses the generated arithmetic data set."""
        return not self.train_files


@dataclass(kw_only=True, frozen=True)
class TrainerConfig:
    """The training loop.

    Attributes:
        total_steps: optimizer steps of the run (the data are re-shuffled and repeated as needed).
        batch_size: sequences per optimizer step over all data-parallel ranks (divisible by their number).
        loss_agg_mode: ``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean``.
        eval_every: held-out evaluation every N steps (also always before the first and after the last
            step); 0 evaluates only before and after.
        save_every: checkpoint every N steps (and at the end); 0 saves only at the end.
        eval_samples: held-out examples whose responses are generated greedily for the accuracy.
        max_new_tokens: generation budget of one answer.
        seed: seed of the data order.
        progress_bar: show a tqdm bar on the output rank.
        cpu_threads: intra-op threads per rank when the engine runs on CPU (``torch.set_num_threads``);
            ``None`` keeps torch's default. Small models run fastest with 1: extra threads mostly spin.
    """

    total_steps: int = 800
    batch_size: int = 64
    loss_agg_mode: str = "token-mean"
    eval_every: int = 100
    save_every: int = 200
    eval_samples: int = 200
    max_new_tokens: int = 8
    seed: int = 0
    progress_bar: bool = True
    cpu_threads: int | None = 1

    def __post_init__(self) -> None:
        for name in ("total_steps", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(self, name)}.")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"trainer.cpu_threads must be >= 1 or null, got {self.cpu_threads}.")
        for name in ("eval_every", "save_every", "eval_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name} must be >= 0, got {getattr(self, name)}.")
        if self.loss_agg_mode not in AGGREGATION_MODES:
            raise ConfigError(
                f"trainer.loss_agg_mode={self.loss_agg_mode!r} is not supported; choose one of {list(AGGREGATION_MODES)}."
            )


@dataclass(kw_only=True, frozen=True)
class SFTConfig:
    """Everything one SFT run needs (see :func:`load_config`)."""

    model: ModelConfig
    engine: EngineConfig
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SFTConfig))


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> SFTConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: unreadable YAML, a malformed override, an unknown section or key, or an invalid value.
        PluginError: ``engine.backend`` names a backend that is not installed.
    """
    values = merge(copy.deepcopy(DEFAULTS), _read_yaml(config_file) if config_file else {})
    for override in overrides:
        apply_override(values, override)
    return build_config(values)


def build_config(values: dict[str, Any]) -> SFTConfig:
    """The typed config from merged plain values (see :func:`load_config`)."""
    from drivetrain_engine_core.factory import engine_config_from_dict

    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], SECTIONS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config section {unknown[0]!r}; sections are {list(SECTIONS)}.{hint}")
    trainer = config_from_dict(TrainerConfig, values.get("trainer", {}), where="trainer")
    # Schedule length follows the run; warm-up defaults to a tenth of it, at most 10 steps.
    optimizer_values = {
        "total_steps": trainer.total_steps,
        "warmup_steps": min(10, trainer.total_steps // 10),
        **values.get("optimizer", {}),
    }
    return SFTConfig(
        model=config_from_dict(ModelConfig, values.get("model", {}), where="model"),
        engine=engine_config_from_dict(values.get("engine", {})),
        optimizer=config_from_dict(OptimizerConfig, optimizer_values, where="optimizer"),
        checkpoint=config_from_dict(CheckpointConfig, values.get("checkpoint", {}), where="checkpoint"),
        data=config_from_dict(DataConfig, values.get("data", {}), where="data"),
        trainer=trainer,
    )


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Merge ``update`` into ``base`` recursively (in place) and return ``base``.

    ``micro_batch`` is special: its two limits are exclusive, so setting one clears the other.
    """
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
        if key in ("micro_batch_size", "max_tokens") and value is not None:
            other = "max_tokens" if key == "micro_batch_size" else "micro_batch_size"
            base[other] = None
    return base


def apply_override(values: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` override; the value is parsed as a YAML scalar (``512``, ``true``, ``[a]``).

    Raises:
        ConfigError: the override has no ``=`` or an empty key.
    """
    import yaml

    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(
            f"override {override!r} must look like section.key=value, e.g. trainer.total_steps=100."
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({e}).") from e
    nested: dict[str, Any] = _number_or_value(value)
    for part in reversed(parts):
        nested = {part: nested}
    merge(values, nested)


def _number_or_value(value: Any) -> Any:
    """YAML 1.1 reads ``5e-3`` as a string (it wants ``5.0e-3``); users mean the number."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file to --config.")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model, engine, ...).")
    return loaded
