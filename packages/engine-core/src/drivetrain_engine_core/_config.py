"""Typed, frozen configuration dataclasses shared by every engine backend.

Backends subclass :class:`EngineConfig` in their own package to add their knobs (FSDP mesh sizes, Megatron
parallel sizes, ...). Every check lives in ``__post_init__`` and its message names the field and the fix, so
a wrong config fails before any process group or model is touched.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from ._config_build import build_dataclass
from ._errors import ConfigError

ModelType = Literal["language_model", "value_model"]
MODEL_TYPES: tuple[str, ...] = ("language_model", "value_model")
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _require_choice(value: str, choices: tuple[str, ...], field_name: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{field_name}={value!r} is not supported; choose one of {list(choices)}.{hint}")


ALL_LINEAR = "all-linear"
"""``model.lora.target_modules=[all-linear]``: every linear layer but the output layer (PEFT's option)."""


@dataclass(kw_only=True, frozen=True)
class LoraConfig:
    """Low-rank adapters (PEFT LoRA) applied to the model before sharding.

    Attributes:
        rank: adapter rank ``r``.
        alpha: scaling numerator; the adapter output is scaled by ``alpha / rank``.
        target_modules: module-name suffixes that receive adapters (linear layers); ``[all-linear]`` adapts
            every linear layer but the output layer, as in PEFT and TRL.
        dropout: adapter dropout; keep 0 where results must be reproducible.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _require(self.rank > 0, f"lora.rank must be positive, got {self.rank}.")
        _require(len(self.target_modules) > 0, "lora.target_modules must name at least one module.")
        _require(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}.")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Which model to build and what it is used for.

    Attributes:
        path: a local Hugging Face model directory (``config.json`` plus weights, tokenizer optional);
            drivetrain's commands also take a Hub repository id and hand engines its cached snapshot.
        model_type: ``language_model`` (log-probs, entropy) or ``value_model`` (a scalar value per token).
        from_config_only: build from ``config.json`` with freshly initialised weights instead of loading them.
        trust_remote_code: forwarded to transformers.
        lora: adapters to train instead of the full model; ``None`` trains every parameter.
        gradient_checkpointing: recompute activations in backward to save memory.
        use_remove_padding: run packed no-padding rows (``True``) or padded rows (``False``); results match.
        disable_dropout: build the model with every dropout probability 0 (TRL's ``disable_dropout``; the
            config's ``*dropout``/``*pdrop`` fields and every ``nn.Dropout``); exports keep the original config.
    """

    path: str
    model_type: ModelType = "language_model"
    from_config_only: bool = False
    trust_remote_code: bool = False
    lora: LoraConfig | None = None
    gradient_checkpointing: bool = False
    use_remove_padding: bool = True
    disable_dropout: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.path), "model.path must name a local Hugging Face model directory.")
        _require_choice(self.model_type, MODEL_TYPES, "model.model_type")


@dataclass(kw_only=True, frozen=True)
class MicroBatchConfig:
    """How a batch is cut into micro-batches inside ``forward_backward_batch``.

    Exactly one of the two limits is set. ``max_tokens`` selects dynamic batching: micro-batches are filled
    up to that many tokens (a hard cap) and balanced by workload, with the same count on every data-parallel
    rank.

    Attributes:
        micro_batch_size: sequences per micro-batch (fixed batching).
        max_tokens: token budget per micro-batch (dynamic batching).
        budget: what ``max_tokens`` counts: ``tokens``, the real tokens (the no-padding layout's cost), or
            ``padded``, rows x the longest sequence of the micro-batch (what a padded layout computes on).
    """

    micro_batch_size: int | None = 1
    max_tokens: int | None = None
    budget: Literal["tokens", "padded"] = "tokens"

    exclusive_fields: ClassVar[tuple[str, ...]] = ("micro_batch_size", "max_tokens")
    """Setting one of these in a config layer clears the other (see :func:`.config_build.exclusive_limits`)."""

    def __post_init__(self) -> None:
        _require(
            (self.micro_batch_size is None) != (self.max_tokens is None),
            "micro_batch: set exactly one of micro_batch_size (fixed) or max_tokens (dynamic), "
            f"got micro_batch_size={self.micro_batch_size}, max_tokens={self.max_tokens}.",
        )
        if self.micro_batch_size is not None:
            _require(
                self.micro_batch_size > 0,
                f"micro_batch.micro_batch_size must be > 0, got {self.micro_batch_size}.",
            )
        if self.max_tokens is not None:
            _require(self.max_tokens > 0, f"micro_batch.max_tokens must be > 0, got {self.max_tokens}.")
        _require_choice(self.budget, ("tokens", "padded"), "micro_batch.budget")

    @property
    def dynamic(self) -> bool:
        """Whether micro-batches are sized by a token budget rather than a sequence count."""
        return self.max_tokens is not None


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """Backend-independent engine settings; backends subclass this to add their own.

    Attributes:
        backend: registered backend name (``fsdp``, ``megatron``, ...).
        device: device type the model runs on (``cpu``, ``cuda``, ...); never hard-coded in a backend. In a
            command's config it defaults to the machine's: ``cuda`` where torch sees a GPU, else ``cpu``.
        param_dtype: dtype of compute (mixed precision); master weights stay float32.
        micro_batch: micro-batching policy.
        param_offload: keep parameters on CPU outside ``train_mode``/``eval_mode``.
        optimizer_offload: keep optimizer state on CPU outside ``train_mode``.
        seed: seed for model initialisation and dropout.
        dist_timeout_s: timeout of collective operations, so that a failed rank never hangs the others forever.
        peak_tflops: peak dense TFLOP/s of one device for ``perf/mfu``; ``None`` takes
            ``DRIVETRAIN_PEAK_TFLOPS`` or core's table of known data-center GPUs for ``param_dtype`` (none for
            float32 at full precision, none on CPU: no ``perf/mfu`` there).
        entropy_chunk_size: positions whose logits exist at once when a language model's log-probs and
            entropy are computed (from the last hidden states, or from logits where a backend needs them);
            recomputed in backward, so memory scales with ``entropy_chunk_size x vocab`` (per vocabulary
            shard), not with the micro-batch's tokens.
    """

    backend: str = "fsdp"
    device: str = "cpu"
    param_dtype: str = "float32"
    micro_batch: MicroBatchConfig = field(default_factory=MicroBatchConfig)
    param_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 0
    dist_timeout_s: float = 600.0
    peak_tflops: float | None = None
    entropy_chunk_size: int = 1024

    def __post_init__(self) -> None:
        _require(bool(self.backend), "engine.backend must name an installed backend, e.g. 'fsdp'.")
        _require(
            _is_device_type(self.device),
            f"engine.device={self.device!r} is not a device type torch knows; write 'cpu' or 'cuda' (or another "
            "torch device type, e.g. 'xpu').",
        )
        _require_choice(self.param_dtype, DTYPES, "engine.param_dtype")
        _require(self.dist_timeout_s > 0, f"engine.dist_timeout_s must be > 0, got {self.dist_timeout_s}.")
        _require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"engine.peak_tflops must be > 0 (TFLOP/s of one device) or None (look it up), got {self.peak_tflops}.",
        )
        _require(
            isinstance(self.entropy_chunk_size, int) and self.entropy_chunk_size >= 1,
            f"engine.entropy_chunk_size must be an integer >= 1, got {self.entropy_chunk_size!r}.",
        )

    def check_world(self, world_size: int) -> None:
        """Check that this config's parallel sizes fit ``world_size`` ranks (nothing to check here; backends
        with model or sequence parallelism override it).

        Raises:
            ConfigError: a parallel size does not divide ``world_size``; the message names the sizes that would.
        """

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks (ranks that see different sequences) of this config on ``world_size`` ranks.

        What the engine's ``data_parallel_size`` will be, known before any engine is built, so that a trainer
        can check its batch sizes before it spends time (a warm start) on a run that cannot proceed. Backends
        with model or sequence parallelism override it; ``Engine.initialize`` checks that the two agree.

        Raises:
            ConfigError: see :meth:`check_world`.
        """
        self.check_world(world_size)
        return world_size


def _is_device_type(name: str) -> bool:
    """Whether torch parses ``name`` as a device (it needs no such device present: ``cuda`` parses on a CPU
    machine, whose engine then refuses it with the fix).

    NOTE: ``cpu`` and ``cuda``, what nearly every config says, are answered without importing torch: building a
    command's config (``--help-config``, ``--print-config``) must not spend seconds on it.
    """
    if name in ("cpu", "cuda"):
        return True
    import torch

    try:
        torch.device(name)
    except RuntimeError:
        return False
    return bool(name)


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """AdamW with an LR schedule of linear warm-up then constant, cosine or linear decay.

    Attributes:
        lr: peak learning rate.
        betas, eps, weight_decay: AdamW hyper-parameters.
        clip_grad: max global grad norm; ``None`` disables clipping (the norm is still reported).
        lr_schedule: after warm-up, ``constant``, ``cosine`` decay or ``linear`` decay (the Hugging Face
            Trainer's and TRL's default) to the floor at ``total_steps``.
        warmup_steps: steps of linear warm-up from 0 to ``lr``.
        total_steps: schedule length; required by ``cosine`` and ``linear``.
        min_lr_ratio: the decay's floor as a fraction of ``lr``.
        max_consecutive_skips: stop with an error after this many optimizer updates in a row were skipped for
            a non-finite grad norm (the run is diverging, not hitting one bad batch); ``None`` never stops.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    max_consecutive_skips: int | None = 10

    def __post_init__(self) -> None:
        _require(self.lr >= 0, f"optimizer.lr must be >= 0, got {self.lr}.")
        if self.max_consecutive_skips is not None:
            _require(
                self.max_consecutive_skips >= 1,
                f"optimizer.max_consecutive_skips must be >= 1 or None, got {self.max_consecutive_skips}.",
            )
        _require_choice(self.lr_schedule, LR_SCHEDULES, "optimizer.lr_schedule")
        _require(self.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}.")
        _require(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.",
        )
        if self.clip_grad is not None:
            _require(self.clip_grad > 0, f"optimizer.clip_grad must be > 0 or None, got {self.clip_grad}.")
        if self.lr_schedule != "constant":
            _require(
                self.total_steps is not None and self.total_steps > self.warmup_steps,
                f"optimizer.lr_schedule={self.lr_schedule!r} needs optimizer.total_steps greater than warmup_steps, "
                f"got total_steps={self.total_steps}, warmup_steps={self.warmup_steps}.",
            )


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """What a checkpoint holds and how many are kept.

    Attributes:
        save_optimizer: include optimizer state (needed to resume training, not to export weights).
        max_ckpt_to_keep: keep the newest N complete steps; ``None`` keeps all.
    """

    save_optimizer: bool = True
    max_ckpt_to_keep: int | None = None

    def __post_init__(self) -> None:
        if self.max_ckpt_to_keep is not None:
            _require(
                self.max_ckpt_to_keep > 0,
                f"checkpoint.max_ckpt_to_keep must be > 0, got {self.max_ckpt_to_keep}.",
            )


ConfigT = TypeVar("ConfigT")


def config_from_dict(cls: type[ConfigT], values: dict[str, Any], *, where: str = "") -> ConfigT:
    """Build a (possibly nested) config dataclass from plain values, as read from YAML.

    Unknown keys are an error that lists the known ones and the closest match, and every value is checked
    against its annotation by the one config builder (:mod:`.config_build`, on OmegaConf, imported only now).

    Raises:
        ConfigError: a key is unknown or a value fails validation.
    """
    return build_dataclass(cls, values, where=where or cls.__name__)
