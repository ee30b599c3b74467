"""vLLM's trainer side of drivetrain's weight transfer: a ``TrainerWeightTransferEngine`` driving vLLM's
start/update/finish protocol, one ``update_weights`` per weight bucket, through a ``VLLMWeightSyncClient``.

``send_weights()`` sends a whole round of a :class:`.weight_source.BucketSource`, as vLLM's ``nccl`` and ``ipc``
trainer engines do; the colocated rollout (``rollout.options.weight_transfer=vllm``) drives the same protocol a
bucket at a time from core's ``update_weights`` template (:meth:`DrivetrainTrainerEngine.send`), so core's
checks run on every bucket before vLLM sees it. The worker's side is :mod:`.transfer_engine`.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

from drivetrain_engine_core.rollout import HandoffError, WeightBucket
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferUpdatePayload,
)

from .transfer_engine import BACKEND
from .weight_source import BucketSource, check_sendable


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` (whose methods take the requests' dicts)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


@dataclass
class DrivetrainTrainerInitInfo(TrainerInitInfo):
    """Drivetrain's transfer needs no rendezvous (the worker is in this process); ``rank`` 0 sends."""

    backend: ClassVar[str] = BACKEND


class DrivetrainTrainerEngine(TrainerWeightTransferEngine[DrivetrainTrainerInitInfo]):
    """Sends weight buckets through vLLM's update protocol, each with its tensors' digests."""

    init_info_cls = DrivetrainTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None, is_sender: bool = True
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self._open = False  # whether vLLM's worker holds an update session this engine started
        self._sent: set[str] = set()
        self._version: int | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: DrivetrainTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        """Send one round of the source: start, each bucket, finish.

        Raises:
            HandoffError: the source is not a :class:`.BucketSource`, or the round failed (see :meth:`send`).
        """
        if not isinstance(self.source, BucketSource):
            raise HandoffError(
                f"drivetrain's weight transfer sends weight buckets, and was given {type(self.source).__name__}; "
                "pass source=BucketSource(lambda: engine.weight_buckets(...))."
            )
        try:
            for bucket in self.source.buckets():
                self.send(bucket)
            self.finish()
        except BaseException:
            self.abort()
            raise

    def send(self, bucket: WeightBucket) -> None:
        """Send one bucket (opening vLLM's update session at a stream's first), its digests beside vLLM's
        metadata; vLLM's worker checks them before loading any of it.

        Raises:
            HandoffError: a delta or adapter stream (:func:`.weight_source.check_sendable`), or the worker
                refused the bucket (a tensor's digest differs; vLLM then ends the session).
        """
        check_sendable(bucket)
        if not self.is_sender:
            return
        if not self._open:
            self.client.start_weight_update()
            self._open, self._sent, self._version = True, set(), bucket.version
        try:
            self.client.update_weights(update_payload(bucket))
        except BaseException:
            self._open = False  # vLLM's worker ended the session (gpu_worker.update_weights)
            raise
        self._sent.update(bucket.names)

    def finish(self, required: Set[str] = frozenset()) -> None:
        """End the session: vLLM processes the loaded layers and records the version as its weight version.

        Args:
            required: tensors the stream must have sent (the served checkpoint's); none missing is checked
                before vLLM processes anything.

        Raises:
            HandoffError: the stream missed a required tensor (the session is left open: :meth:`abort` ends it).
        """
        missing = sorted(set(required) - self._sent)
        if missing:
            raise HandoffError(
                f"the weight stream missed {len(missing)} of the model's tensors ({missing[:3]}); vLLM reloads the "
                "whole model each version, so the sender's export must yield every Hugging Face weight."
            )
        if self._open and self.is_sender:
            self.client.finish_weight_update(weight_version=str(self._version))
        self._open = False

    def abort(self) -> None:
        """End a session a failed stream left open (vLLM processes what arrived: the model holds a partial
        version, which the rollout refuses to serve until a complete one)."""
        if self._open:
            self._open = False
            self.client.finish_weight_update()


def open_transfer(llm: Any) -> DrivetrainTrainerEngine:
    """vLLM's trainer-side engine of drivetrain's transfer, rendezvoused with the offline ``vllm.LLM`` ``llm``
    through vLLM's factory (started with ``weight_transfer_config={"backend": "drivetrain"}``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    engine = WeightTransferTrainerFactory.trainer_init(
        DrivetrainTrainerInitInfo(rank=0), client=LLMClient(llm)
    )
    return cast(DrivetrainTrainerEngine, engine)  # what register_backend registered under the backend


def update_payload(bucket: WeightBucket) -> dict[str, Any]:
    """The worker's ``update_weights`` payload for ``bucket`` (:class:`.transfer_engine.DrivetrainUpdateInfo`):
    vLLM's names, dtypes and shapes, drivetrain's offsets and digests beside them, and the buffer by reference
    (``dataclasses.asdict`` would deep-copy it)."""
    specs = bucket.specs
    return {
        "version": bucket.version,
        "index": bucket.index,
        "names": [spec.name for spec in specs],
        "dtype_names": [str(spec.dtype).removeprefix("torch.") for spec in specs],
        "shapes": [list(spec.shape) for spec in specs],
        "offsets": [spec.offset for spec in specs],
        "digests": [spec.digest for spec in specs],
        "buffer": bucket.buffer,
    }
