"""Saving and loading an engine's step: the collective sequence around the backend's checkpoint hooks.

``Engine.save_checkpoint`` / ``load_checkpoint`` check the engine and call these. Saving: rank 0 prepares a
temporary step directory, every rank writes its share (the backend's ``_save_checkpoint``) and core's
``extra/`` state, every rank hashes a share of the files (:mod:`.file_shares`), rank 0 publishes the step
durably with its manifest and prunes old ones, never the step just published (:mod:`.publish`); barriers
separate the phases. Loading: the manifest names the backend, every rank checks a share of the files and
every rank raises the first problem found, then the
backend reads its state with offloaded state held on the device, and core restores the LR schedule and the
skipped-step count.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _distributed as distributed
from .._errors import CheckpointError
from .extra_state import load_extra_state, require_json, save_extra_state
from .file_shares import attempt, describe_on_every_rank, raise_any, verify_on_every_rank
from .hf_state import HFTrainingState
from .layout import OPTIMIZER_DIR, prepare_temporary_step_dir, resolve_step_dir, temporary_step_dir
from .manifest import Manifest, read_manifest
from .publish import prune_old_steps, publish_step

if TYPE_CHECKING:
    from .._engine import Engine


def save_engine_checkpoint(
    engine: Engine,
    path: str | Path,
    global_step: int,
    max_ckpt_to_keep: int | None,
    extra_state: dict[str, Any] | None,
    *,
    write: Callable[..., None],
) -> Path:
    """Write ``<path>/global_step_<N>/`` atomically (collective); see ``Engine.save_checkpoint``.

    ``write(step_dir, save_optimizer=...)`` is the backend's share (its ``_save_checkpoint`` hook, handed in by
    the engine).
    """
    require_json("extra_state", extra_state)
    root = Path(path)
    temporary = temporary_step_dir(root, global_step)
    is_writer = distributed.rank() == 0
    if is_writer:
        prepare_temporary_step_dir(temporary)
    distributed.barrier()
    write(temporary, save_optimizer=engine.checkpoint_config.save_optimizer)
    save_extra_state(temporary / "extra", _core_state(engine, extra_state or {}))
    distributed.barrier()
    files = describe_on_every_rank(temporary)
    final = root / f"global_step_{global_step}"
    if is_writer:
        final = publish_step(root, temporary, global_step, _manifest(engine, global_step), files)
        keep = max_ckpt_to_keep if max_ckpt_to_keep is not None else engine.checkpoint_config.max_ckpt_to_keep
        prune_old_steps(root, keep, published=final)
    distributed.barrier()
    return final


def load_engine_checkpoint(
    engine: Engine,
    path: str | Path,
    read: Callable[..., None],
    read_hf_state: Callable[..., None] | None,
    *,
    load_optimizer: bool,
    verify: bool,
) -> dict[str, Any]:
    """Read a step (collective); see ``Engine.load_checkpoint``.

    ``read(step_dir, load_optimizer=...)`` is the backend's read of its own steps (its ``_load_checkpoint``
    hook, handed in by the engine); a step of another backend goes through
    ``read_hf_state(state, load_optimizer=...)`` (``_load_hf_state``, for backends with ``hf_state_resume``)
    with the step's :class:`.hf_state.HFTrainingState`, read by the merger the engine's ``mergers`` finds for
    its backend. Either runs with offloaded state held on the device.

    Raises:
        CheckpointError: incomplete step, missing or corrupt file, another backend's checkpoint that this
            backend cannot read, or another model's.
    """
    step_dir, manifest = _agreed_step(path)
    foreign = manifest.backend != engine.backend_name
    if foreign and read_hf_state is None:
        raise CheckpointError(
            f"{step_dir} was written by the {manifest.backend!r} backend; this engine is {engine.backend_name!r}, "
            "which cannot load another backend's steps (no hf_state_resume capability). Merge it to Hugging "
            "Face format with `drivetrain ckpt merge` and start from that model."
        )
    if verify:
        verify_on_every_rank(step_dir, manifest)
    load_optimizer = load_optimizer and engine.optimizer_config is not None
    if load_optimizer and not any(name.startswith(f"{OPTIMIZER_DIR}/") for name in manifest.files):
        raise CheckpointError(
            f"{step_dir} holds no optimizer state (saved with checkpoint.save_optimizer=false), which resuming "
            "training needs. Load it with load_optimizer=False for a fresh optimizer, or start a new run from its "
            f"weights: `drivetrain ckpt merge {step_dir} OUT`, then model.path=OUT."
        )
    with engine.holding_state():
        if foreign:
            assert read_hf_state is not None  # refused above
            read_hf_state(
                HFTrainingState.from_step(step_dir, manifest, engine.mergers), load_optimizer=load_optimizer
            )
        else:
            read(step_dir, load_optimizer=load_optimizer)
    state = load_extra_state(step_dir / "extra")
    if engine.lr_schedule is not None and "lr_schedule" in state:
        engine.lr_schedule.load_state_dict(state["lr_schedule"])
    engine.skips.load_state_dict(state)
    return {"global_step": manifest.global_step, **state["extra_state"]}


def _manifest(engine: Engine, global_step: int) -> Manifest:
    lora = engine.model_config.lora
    return Manifest(
        backend=engine.backend_name,
        global_step=global_step,
        world_size=distributed.world_size(),
        model_type=engine.model_config.model_type,
        model_path=str(Path(engine.model_config.path).resolve()),
        lora=None if lora is None else {**lora.__dict__, "target_modules": list(lora.target_modules)},
        trust_remote_code=engine.model_config.trust_remote_code,
        backend_info=engine.checkpoint_backend_info,
    )


def _agreed_step(path: str | Path) -> tuple[Path, Manifest]:
    """The step every rank loads and its manifest: rank 0's resolution of ``path``, or on every rank the error
    it raised.

    NOTE: ranks resolving ``latest`` each on their own could load different steps where a node's view of the
    filesystem lags (attribute caching); megatron likewise agrees on the iteration before loading. A rank that
    cannot read the step's files (a root that is not shared) fails when it checks or loads them.
    """

    def resolve() -> tuple[str, Manifest]:
        step_dir = resolve_step_dir(path)
        return str(step_dir), read_manifest(step_dir)

    agreed = distributed.broadcast_object(attempt(resolve) if distributed.rank() == 0 else None)
    raise_any([agreed])
    assert isinstance(agreed, tuple)  # rank 0 sent a step or a failure
    return Path(agreed[0]), agreed[1]


def _core_state(engine: Engine, caller_state: dict[str, Any]) -> dict[str, Any]:
    """What core saves beside the backend's state: caller state, skipped steps (the run's and the current
    streak, so that ``optimizer.max_consecutive_skips`` counts across a resume: a run that crashed and resumed
    in a loop restarted the streak each time), LR schedule."""
    state: dict[str, Any] = {"extra_state": caller_state, **engine.skips.state_dict()}
    if engine.lr_schedule is not None:
        state["lr_schedule"] = engine.lr_schedule.state_dict()
    return state
