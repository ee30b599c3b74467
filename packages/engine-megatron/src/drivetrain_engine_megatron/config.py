"""``MegatronEngineConfig``: the Megatron-Core backend's parallel layout and options.

Layout checks that need no process group are made here, so a wrong config fails at construction;
device-dependent refusals (sequence parallel on CPU) are made by the engine's ``initialize``.
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError, EngineConfig


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(kw_only=True, frozen=True)
class MegatronEngineConfig(EngineConfig):
    """Megatron-Core engine settings.

    Attributes:
        tensor_model_parallel_size: ranks that split each weight matrix (TP).
        pipeline_model_parallel_size: ranks that split the layers into stages (PP).
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved schedule), or
            ``None``; needs ``pipeline_model_parallel_size > 1`` and layers divisible by PP x VPP.
        context_parallel_size: ranks that split each sequence (CP); needs Transformer Engine attention.
        expert_model_parallel_size: ranks that split a mixture-of-experts layer's experts (EP); they are
            data-parallel ranks for the rest of the model, so it must divide the data-parallel size and the
            model's expert count.
        sequence_parallel: shard activations along the sequence in TP regions (needs TP > 1 and packed rows).
        use_distributed_optimizer: shard optimizer state over data-parallel ranks (megatron's
            DistributedOptimizer); checkpoints store it ``dp_reshardable``.
        router_aux_loss_coef: weight of a mixture-of-experts router's load-balancing loss (core's
            ``router_balance``: transformers' formula per sequence, averaged over the global batch's sequences,
            the FSDP engine's term). ``None`` follows the model's config as transformers does; the unscaled
            value is the metric ``router_aux_loss``.
        make_vocab_size_divisible_by: pad the vocabulary to a multiple of this times TP (``None``: no padding).
        initial_loss_scale: ``param_dtype="float16"`` only: the first value of megatron's dynamic loss scale.
            A step whose scaled gradients overflow is skipped, and from the second overflow on each one
            halves the scale; 1000 clean steps in a row double it. The default is ``torch.amp.GradScaler``'s 2^16 rather than megatron's 2^32, which
            overflows (and so skips) the first dozen or more steps of a run on ordinary gradients.
    """

    backend: str = "megatron"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    router_aux_loss_coef: float | None = None
    make_vocab_size_divisible_by: int | None = None
    initial_loss_scale: float = 2.0**16

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value >= 1,
                f"engine.{name} must be an integer >= 1, got {value!r}.",
            )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _require(
                vpp >= 2 and self.pipeline_model_parallel_size >= 2,
                "engine.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2 and a value "
                f">= 2 (got vpp={vpp}, pp={self.pipeline_model_parallel_size}); set it to None to disable.",
            )
        _require(
            not self.sequence_parallel or self.tensor_model_parallel_size > 1,
            "engine.sequence_parallel=True needs tensor_model_parallel_size > 1; set sequence_parallel=False.",
        )
        _require(
            self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
            "engine.router_aux_loss_coef must be >= 0 (0 turns the load-balancing loss off, unset follows the "
            f"model's config), got {self.router_aux_loss_coef}.",
        )
        if self.make_vocab_size_divisible_by is not None:
            _require(
                self.make_vocab_size_divisible_by >= 1,
                f"engine.make_vocab_size_divisible_by must be >= 1 or None, got {self.make_vocab_size_divisible_by}.",
            )
        _require(
            self.initial_loss_scale >= 1,
            f"engine.initial_loss_scale must be >= 1 (megatron's minimum loss scale), got {self.initial_loss_scale}.",
        )

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: TP x PP x CP."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def check_world(self, world_size: int) -> None:
        """The world must hold whole copies of the model, and the experts split over data-parallel ranks.

        Raises:
            ConfigError: ``world_size`` is not a multiple of :attr:`model_parallel_size`, or the data-parallel
                size is not a multiple of ``expert_model_parallel_size``.
        """
        if world_size % self.model_parallel_size:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {self.model_parallel_size}; launch a "
                f"multiple of {self.model_parallel_size} ranks or shrink the parallel sizes."
            )
        data_parallel = world_size // self.model_parallel_size
        if data_parallel % self.expert_model_parallel_size:
            raise ConfigError(
                f"engine.expert_model_parallel_size={self.expert_model_parallel_size} splits the experts over "
                f"data-parallel ranks, but world size {world_size} leaves {data_parallel} of them (world / "
                f"(TP x PP x CP = {self.model_parallel_size})); launch a multiple of "
                f"{self.model_parallel_size * self.expert_model_parallel_size} ranks or lower "
                "expert_model_parallel_size."
            )

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (TP x PP x CP)``: the ranks of one model copy share their sequences."""
        self.check_world(world_size)
        return world_size // self.model_parallel_size
