"""The checks the public ``Engine`` methods run before they call a backend hook: each raises the one error that
names what was asked and the fix."""

from __future__ import annotations

from tensordict import TensorDict

from . import _distributed as distributed
from ._config import EngineConfig, ModelConfig, OptimizerConfig
from ._data.batch import require_tensordict, validate_batch
from ._data.options import refuse_batch_options
from ._data.values import TokenLimits, check_batch_values
from ._errors import EngineStateError
from ._modes import Mode
from ._outputs import LossFn


def check_config_class(engine: str, expected: type[EngineConfig], config: EngineConfig) -> None:
    """The engine config is the backend's own config type."""
    if not isinstance(config, expected):
        raise TypeError(
            f"{engine} needs a {expected.__name__}, got {type(config).__name__}; "
            f"build it with {expected.__module__}.{expected.__name__}(...)."
        )


def require_initialized(initialized: bool, what: str) -> None:
    if not initialized:
        raise EngineStateError(f"{what} needs an initialised engine; call engine.initialize() first.")


def require_optimizer(initialized: bool, has_optimizer: bool, what: str) -> None:
    require_initialized(initialized, what)
    if not has_optimizer:
        raise EngineStateError(
            f"{what} needs an optimizer; this engine was built with optimizer_config=None."
        )


def check_compute(
    initialized: bool,
    mode: Mode | None,
    optimizer: OptimizerConfig | None,
    loss_fn: LossFn | None,
    forward_only: bool,
) -> None:
    """A forward (and backward) may run: initialised, inside a mode block, backward in train mode with a loss
    on an engine with an optimizer."""
    require_initialized(initialized, "forward_backward_batch()")
    if mode is None:
        raise EngineStateError(
            "compute needs a mode: wrap the call in `with engine.train_mode():` or `with engine.eval_mode():`."
        )
    if not forward_only:
        if mode != "train":
            raise EngineStateError(
                "backward (train_batch / forward_only=False) must run inside `engine.train_mode()`."
            )
        if loss_fn is None:
            raise EngineStateError("backward needs a loss function: pass loss_fn=... (or use infer_batch).")
        require_optimizer(initialized, optimizer is not None, "training")


def check_batch(batch: TensorDict, *, with_loss: bool, limits: TokenLimits) -> None:
    """A well-formed no-padding batch of tensors only, whose values the model can take.

    Raises:
        BatchError: naming the field, the sequence and the fix.
    """
    require_tensordict(batch)
    refuse_batch_options(batch)
    validate_batch(batch, required=required_fields(with_loss))
    check_batch_values(batch, limits)


def required_fields(with_loss: bool) -> tuple[str, ...]:
    """Batch fields the engine needs; ``loss_mask`` is needed to normalise losses."""
    return ("input_ids", "position_ids", "loss_mask") if with_loss else ("input_ids", "position_ids")


def check_data_parallel_size(engine: str, built: int, config: EngineConfig) -> None:
    """The layout the backend built is the one its config predicts (trainers check batch sizes with the
    prediction before any engine exists)."""
    world = distributed.world_size()
    predicted = config.data_parallel_size(world)
    if built != predicted:
        raise EngineStateError(
            f"{engine} built {built} data-parallel ranks on {world} ranks, but "
            f"{type(config).__name__}.data_parallel_size({world}) predicts {predicted}; the backend's "
            "config must override EngineConfig.data_parallel_size to describe the layout it builds."
        )


def require_adapters(initialized: bool, model_config: ModelConfig) -> None:
    """``disable_adapter()`` needs an initialised engine with LoRA adapters."""
    require_initialized(initialized, "disable_adapter()")
    if model_config.lora is None:
        raise EngineStateError(
            "disable_adapter() needs LoRA adapters; set model.lora to train with adapters."
        )


def check_move(
    device: str, engine_device: str, model: bool, grad: bool, *, offload: bool, backend: str
) -> bool:
    """Whether ``engine.to(device, ...)`` moves anything (``False``: the state is already there).

    Raises:
        ValueError: an unknown device, or gradients asked to move without their parameters.
        EngineStateError: a move off the device on a backend without the ``offload`` capability.
    """
    allowed = {"cpu", engine_device}
    if device not in allowed:
        raise ValueError(f"engine.to({device!r}): the device must be one of {sorted(allowed)}.")
    if grad and not model:
        raise ValueError(
            f"engine.to({device!r}, model=False, grad=True): a gradient lives on its parameter's device, so "
            "gradients move with the model; pass model=True, or grad=False to move the optimizer state alone."
        )
    if offload:
        return True
    if device != engine_device:
        raise EngineStateError(
            f"engine.to({device!r}): the {backend} backend keeps its state on {engine_device!r} (it does not "
            "declare the 'offload' capability)."
        )
    return False
