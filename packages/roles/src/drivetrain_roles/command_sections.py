"""Config pieces every training command shares: the ``trainer`` loop's common fields, the default model and the
``data`` section of prompt/response examples (``sft``, ``grpo`` and the SFT warm starts read it).

Each command's (``sft``, ``grpo``, ``dpo``, ``rm``) ``trainer`` section subclasses :class:`LoopConfig` or
:class:`BatchLoopConfig`, gives the run length and cadence its own defaults and adds only its own fields, so a
shared field means, defaults to and is checked the same in every command. ``--help-config`` and the
reference pages read the help from the ``Attributes:`` sections of the whole class hierarchy; a subclass's
entry replaces its base's where the command means something more specific.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from drivetrain_engine_core.backend import ConfigError, ModelConfig, OptimizerConfig

from .jobs.builtin_tasks import BUILTIN_TASKS
from .jobs.default_assets import BUILTIN_MODEL
from .jobs.divergence import DivergenceConfig
from .jobs.ray_config import RayConfig, choose_placement
from .runtime.command_config.presets import Preset, PresetChoice


def builtin_model() -> ModelConfig:
    """The default ``model`` section of every command: the embedded tiny arithmetic model."""
    return ModelConfig(path=BUILTIN_MODEL)


Overlong = Literal["error", "drop"]
"""What ``data.overlong`` does with an example longer than ``data.max_length``: refuse the data or skip it."""

USER_MODEL_MAX_LENGTH = 1024
"""``data.max_length`` of any model but the embedded one (TRL's SFT and DPO ``max_length``, verl's SFT)."""
USER_MODEL_MAX_NEW_TOKENS = 256
"""Generation budget of any model but the embedded one (TRL's ``GRPOConfig.max_completion_length``)."""


def model_presets(command: str, user_model: Mapping[str, Mapping[str, Any]]) -> PresetChoice:
    """The presets ``model.path`` picks for ``command``: each embedded task's own values (named by its
    ``model.path``, :attr:`~.jobs.builtin_tasks.BuiltinTask.defaults`; the commands' defaults are the arithmetic
    task's, so its preset is empty), and ``user-model`` for any other model: ``data.max_length`` of
    :data:`USER_MODEL_MAX_LENGTH` in every command, and ``user_model``, the command's own.

    NOTE: the embedded job's learning rates (SFT 3e-3, RM 2e-3, GRPO 2e-4, DPO 1e-4 with beta 0.5) applied to a
    user's model too, so ``drivetrain sft model.path=Qwen/Qwen2.5-0.5B`` ran a full fine-tune at 3e-3, which
    ruins a real model within steps; its 32-token ``data.max_length`` refused nearly any real data, and GRPO's
    6-token responses could never hold a real answer. A user's model gets the values its users know instead
    (verl, TRL).
    """
    return PresetChoice(
        key="model.path",
        presets={
            task.model_path: Preset(task.model_path, merged_sections(task.defaults.get(command, {})))
            for task in BUILTIN_TASKS.values()
        },
        otherwise=Preset(
            USER_MODEL_PRESET, merged_sections({"data": {"max_length": USER_MODEL_MAX_LENGTH}}, user_model)
        ),
    )


USER_MODEL_PRESET = "user-model"
"""The name of the preset of any model but an embedded one."""


def merged_sections(*parts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The union of several ``{section: {key: value}}`` mappings (later keys win)."""
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for section, entries in part.items():
            merged.setdefault(section, {}).update(entries)
    return merged


def check_val_files_have_train_files(train_files: Sequence[str], val_files: Sequence[str]) -> None:
    """Held-out files need training files: without them the run uses the generated data and its own held-out
    split, and ``data.val_files`` was never opened (a missing file too) while the run evaluated on something
    else.

    Raises:
        ConfigError: ``val_files`` without ``train_files``.
    """
    if val_files and not train_files:
        raise ConfigError(
            f"data.val_files={list(val_files)} is set without data.train_files: the run would train and evaluate on "
            "the generated data and never read these files. Set data.train_files too, or drop "
            "data.val_files."
        )


@dataclass(kw_only=True, frozen=True)
class LoopConfig:
    """The fields of every command's training loop (its ``trainer`` section).

    ``total_steps``, ``eval_every`` and ``save_every`` have no default here: each command sets its own.

    Attributes:
        total_steps: optimizer steps of the run (the data are re-shuffled and repeated as needed).
        eval_every: held-out evaluation every N steps (also always before the first and after the last
            step); 0 evaluates only before and after.
        save_every: checkpoint every N steps (and at the end); 0 saves only at the end.
        eval_samples: held-out examples whose responses are generated greedily for the accuracy.
        seed: seed of the data order.
        progress_bar: show a tqdm bar on the output rank.
        cpu_threads: intra-op threads per rank when the engine runs on CPU (``torch.set_num_threads``);
            ``None`` keeps torch's default. Small models run fastest with 1: extra threads mostly spin.
        report_to: metrics trackers: ``jsonl`` (``<run>/metrics.jsonl``), ``tensorboard``, ``wandb``,
            ``mlflow`` (each needs its package installed).
        divergence: the divergence guard: a loss or grad norm far above its running median, or a learning rate
            of 0, for a few steps in a row warns (or stops the run).
        placement: where the ranks run: ``local`` (this command starts them: ``--nproc``, ``--nnodes``) or
            ``ray`` (Ray actors on an existing cluster, placed as ``ray`` says; the run is the same).
        ray: the Ray cluster and the ranks' placement, read with ``placement=ray``.
    """

    total_steps: int
    eval_every: int
    save_every: int
    eval_samples: int = 200
    seed: int = 0
    progress_bar: bool = True
    cpu_threads: int | None = 1
    report_to: tuple[str, ...] = ("jsonl",)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    placement: str = "local"
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        from .runtime.tracking import check_report_to

        check_report_to(self.report_to)
        choose_placement(self.placement, self.ray)
        self._require_at_least(1, "total_steps")
        self._require_at_least(0, "eval_every", "save_every", "eval_samples")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"trainer.cpu_threads must be >= 1 or null, got {self.cpu_threads}.")

    def _require_at_least(self, minimum: int, *names: str) -> None:
        """Each of ``names`` is ``>= minimum``; else a :class:`ConfigError` names the first that is not."""
        for name in names:
            if getattr(self, name) < minimum:
                raise ConfigError(f"trainer.{name} must be >= {minimum}, got {getattr(self, name)}.")


@dataclass(kw_only=True, frozen=True)
class BatchLoopConfig(LoopConfig):
    """A training loop over fixed-size batches whose held-out prompts are answered greedily (sft, dpo, rm).

    ``batch_size`` has no default here: each command sets its own.

    Attributes:
        batch_size: sequences per optimizer step over all data-parallel ranks (divisible by their number).
        max_new_tokens: generation budget of one answer.
        eval_metrics: your own measures of the held-out greedy answers (``sft``, ``dpo``), each written as a
            reward function (a built-in such as ``math_verify``, ``package.module:function`` or
            ``path/to/file.py:function``: one number per answer, ``None`` where it does not apply), reported as
            ``val/<name>``, its mean, and plotted under the loss.
    """

    batch_size: int
    max_new_tokens: int = 8
    eval_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_at_least(1, "batch_size", "max_new_tokens")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the examples come from and how they are tokenised.

    Attributes:
        train_files: parquet/jsonl files, dataset folders (``save_to_disk``) or Hugging Face Hub dataset ids
            (``trl-lib/Capybara``); empty selects the generated data set of the embedded task ``model.path``
            names (arithmetic for any other model).
        val_files: held-out sources, as ``train_files``; empty with generated data uses the generated held-out
            split, empty with user files disables held-out evaluation.
        dataset_config: the config (subset) of each Hugging Face Hub dataset in ``train_files``/``val_files``
            (TRL's ``dataset_config``); ``None``: its default.
        train_split, val_split: the split read from each dataset folder or Hub dataset of ``train_files``, and of
            ``val_files`` (TRL's ``dataset_train_split``/``dataset_test_split``); files have none.
        prompt_key: column of the prompts.
        response_key: column of the responses (loss on them; the references of ``grpo`` and ``ppo``). Those two
            take ``null`` for rows without one (TRL's prompt-only data, for judges, reward models, length
            rewards): the prompt column, or the whole ``messages_key`` conversation, is the prompt; no
            ``references`` reach the reward functions and no held-out accuracy is measured.
        messages_key: column of chat messages (rendered with the tokenizer's chat template; loss on the assistant
            turns that ``assistant_turns`` picks); when set, prompt/response columns are not read.
        assistant_turns: which assistant turns of chat messages carry loss: ``all`` (verl's multi-turn SFT
            dataset, TRL's ``assistant_only_loss``) or ``last`` (the final one, as a prompt/response pair).
        apply_chat_template: render each prompt/response pair as a user turn and an assistant turn with the
            tokenizer's chat template (what verl's SFT dataset and RL prompts do with a prompt column; for an
            instruct model); off, the prompt is ``tokenizer(prompt)`` as written (TRL's prompt/completion).
        max_length: token budget of one example (prompt + response).
        overlong: what an example longer than ``max_length`` does: ``error`` (the run refuses the data, naming
            the row) or ``drop`` (skipped with one warning counting them, as OpenRLHF filters them; a cut
            response would train on text that never ends).
        generated_train_size, generated_val_size: sizes of the generated splits.
    """

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    dataset_config: str | None = None
    train_split: str = "train"
    val_split: str = "test"
    prompt_key: str = "prompt"
    response_key: str | None = "response"
    messages_key: str | None = None
    assistant_turns: Literal["all", "last"] = "all"
    apply_chat_template: bool = False
    max_length: int = 32
    overlong: Overlong = "error"
    generated_train_size: int = 2000
    generated_val_size: int = 200

    def __post_init__(self) -> None:
        check_val_files_have_train_files(self.train_files, self.val_files)
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2 tokens, got {self.max_length}.")
        if self.apply_chat_template and self.messages_key is not None:
            raise ConfigError(
                "data.apply_chat_template renders prompt/response columns, but data.messages_key reads chat "
                "messages (always rendered with the chat template); set one of them."
            )
        if self.generated_train_size < 1 or self.generated_val_size < 0:
            raise ConfigError("data.generated_train_size must be >= 1 and data.generated_val_size >= 0.")

    @property
    def generated(self) -> bool:
        """Whether the run uses the generated data set (no ``train_files``)."""
        return not self.train_files


@dataclass(kw_only=True, frozen=True)
class RunOptimizerConfig(OptimizerConfig):
    """A command's ``optimizer`` section: core's AdamW and LR schedule, whose length follows the run.

    The run's length has one home, ``trainer.total_steps``: the schedule reads it when the engine is made
    (:meth:`for_run`) rather than holding a copy, so a saved ``config.yaml`` (``null`` here) re-runs to the
    same schedule, and ``trainer.total_steps=400`` on top of it moves the schedule too.

    Give an engine ``for_run``'s result (each command's ``run_optimizer()``), never the section itself.

    Attributes:
        warmup_steps: steps of linear warm-up from 0 to ``lr``; ``null``: the command's share of the run.
        total_steps: schedule length; ``null``: the run's length (``trainer.total_steps``).
    """

    warmup_steps: int | None = None  # type: ignore[assignment]
    total_steps: int | None = None

    def __post_init__(self) -> None:
        """Core's checks need the run's length (cosine needs ``total_steps > warmup_steps``): every command's
        config runs them through :meth:`for_run` when it is built, so none is skipped."""

    def for_run(self, total_steps: int, warmup_steps: int) -> OptimizerConfig:
        """Core's optimizer config for a run of ``total_steps``: each length left ``null`` takes the run's.

        Args:
            total_steps: the run's optimizer steps.
            warmup_steps: the command's warm-up for that run, used when ``warmup_steps`` is ``null``.

        Raises:
            ConfigError: a value core's :class:`OptimizerConfig` refuses (the message names the field).
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(OptimizerConfig)}
        values["total_steps"] = total_steps if self.total_steps is None else self.total_steps
        values["warmup_steps"] = warmup_steps if self.warmup_steps is None else self.warmup_steps
        return OptimizerConfig(**values)
