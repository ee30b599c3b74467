"""vLLM's worker side of drivetrain's weight transfer: a ``WeightTransferEngine`` registered with vLLM's factory.

Each ``update_weights`` call carries one weight bucket (its buffer, and each tensor's name, dtype, shape, offset
and digest): vLLM's ``nccl``/``ipc`` metadata plus the digests its ``ParamMeta`` lacks. The engine checks every
tensor of the bucket against its digest before any of it is loaded, then loads the bucket through the model's
``load_weights`` inside vLLM's own update window (``initialize_layerwise_reload``/``finalize_layerwise_reload``
on the whole model, as vLLM's ``nccl`` and ``ipc`` engines do). The buffer travels by reference: the transport
is the worker's own process, which is where the colocated rollout runs vLLM (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
and the only one of vLLM's transports that runs on CPU (``nccl`` and ``ipc`` need CUDA).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from drivetrain_engine_core.rollout import HandoffError, digest_of
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

BACKEND = "drivetrain"
"""The name both of vLLM's factories know drivetrain's transfer by (``weight_transfer_config={"backend": ...}``)."""


@dataclass
class DrivetrainInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the buffers arrive in the worker's own process."""


@dataclass
class DrivetrainUpdateInfo(WeightTransferUpdateInfo):
    """One weight bucket: its flat buffer and, per tensor, where it lies in it and the digest the sender took.

    Attributes:
        version: the stream's version (for the error messages).
        index: the bucket's position in the stream.
    """

    version: int
    index: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    digests: list[str]
    buffer: torch.Tensor

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into the buffer, each checked against its digest first.

        Raises:
            HandoffError: naming the first tensor whose bytes differ from the sender's.
        """
        views = []
        for name, dtype_name, shape, offset in zip(
            self.names, self.dtype_names, self.shapes, self.offsets, strict=True
        ):
            dtype = getattr(torch, dtype_name)
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            views.append((name, self.buffer[offset : offset + size].view(dtype).view(shape)))
        for (name, view), digest in zip(views, self.digests, strict=True):
            if digest_of(view) != digest:
                raise HandoffError(
                    f"weight bucket {self.index} of version {self.version}: {name} reached vLLM's worker with "
                    "other bytes than were sent (its digest differs): the transfer corrupted it. Nothing of this "
                    f"bucket was loaded, and the version is not served; send version {self.version} again."
                )
        return views


class DrivetrainWeightTransferEngine(WeightTransferEngine[DrivetrainInitInfo, DrivetrainUpdateInfo]):
    """Loads weight buckets into vLLM's model inside vLLM's update window, each tensor digest-checked first."""

    init_info_cls = DrivetrainInitInfo
    update_info_cls = DrivetrainUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: DrivetrainInitInfo) -> None:
        """Nothing to open: the buckets arrive in this process."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one bucket (vLLM's ``update_weights``); a failure closes vLLM's update window.

        NOTE: vLLM's worker ends its session when a bucket fails, and nothing else would close the window this
        engine's ``start_weight_update`` opened: the model's layers would stay on the meta device, and the next
        session's ``initialize_layerwise_reload`` fails on them ("'Parameter' object has no attribute
        'weight_loader'"). Closed, the model holds a partial version (which the rollout refuses to serve) until a
        complete one arrives.
        """
        try:
            super().update_weights(update_info)
        except BaseException:
            self.finish_weight_update()
            raise

    def receive_weights(self, update_info: DrivetrainUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        tensors = update_info.tensors()
        with disable_mtp_completeness_check():
            self.model.load_weights(tensors)

    def shutdown(self) -> None:
        """Nothing to release."""


def register_backend() -> None:
    """Register drivetrain's transfer with both of vLLM's factories (once per process; again is a no-op).

    NOTE: vLLM builds the worker's engine when it loads the model, from its factory's registry, so this runs
    before ``vllm.LLM(...)`` in the process that holds the worker (the colocated rollout's own).
    """
    for factory, module, name in (
        (WeightTransferEngineFactory, __name__, "DrivetrainWeightTransferEngine"),
        (WeightTransferTrainerFactory, "drivetrain_rollout_vllm.transfer", "DrivetrainTrainerEngine"),
    ):
        with contextlib.suppress(ValueError):  # registered before in this process
            factory.register_engine(BACKEND, module, name)
