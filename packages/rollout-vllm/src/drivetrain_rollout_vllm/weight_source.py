"""drivetrain's weight stream as vLLM's trainer-side ``WeightSource``, its digest manifest carried beside.

vLLM's trainer engines (``WeightTransferTrainerFactory``: NCCL, IPC) replay a ``WeightSource`` each round: its
``metadata()`` declares every parameter (name, dtype, full shape) and iterating it yields ``(name, tensor)``
pairs. :class:`BucketSource` is one over ``engine.weight_buckets(...)``: each round draws a fresh stream, checks
it as core's receiver does (one version, buckets in order, complete) and yields views into the buckets, so the
stream's bounded memory holds. vLLM's ``ParamMeta`` carries no digest: the round's digests stay on the source
(:attr:`BucketSource.manifest`), for the receiver to check what it serves before it serves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from drivetrain_engine_core.rollout import BucketReceiver, HandoffError, TensorDigest, WeightBucket
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


class BucketSource(WeightSource):
    """vLLM's ``WeightSource`` over drivetrain weight streams: one full stream (one version) per round.

    Args:
        buckets: called once per round for that round's stream, e.g.
            ``lambda: engine.weight_buckets(version=trainer.step)``; every round must be a newer version.
        layout: what ``metadata()`` declares before the first round (backends that size their receive buffers
            from it, vLLM's ``nccl``, need it first); after each round, that round's manifest.

    Attributes:
        manifest: every tensor of the last complete round with its digest, in stream order.
        version: the last complete round's version (``None`` before one).
    """

    def __init__(
        self, buckets: Callable[[], Iterable[WeightBucket]], *, layout: Sequence[ParamMeta] | None = None
    ) -> None:
        self._buckets = buckets
        self._layout = list(layout) if layout is not None else None
        self._receiver = BucketReceiver()
        self.manifest: tuple[TensorDigest, ...] = ()
        self.version: int | None = None

    def metadata(self) -> list[ParamMeta]:
        """The parameters a round yields: the declared layout, or the last round's.

        Raises:
            HandoffError: neither is known yet.
        """
        if self._layout is None:
            raise HandoffError(
                "BucketSource.metadata(): a drivetrain stream learns its tensors as it sends them, and no layout "
                "was declared nor a round sent yet; pass layout=[ParamMeta(name, dtype, shape), ...] in stream "
                "order (e.g. the previous run's source.manifest), or use a backend that reads the layout from "
                "the stream (vLLM's ipc, drivetrain's)."
            )
        return list(self._layout)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket.tensors()

    def buckets(self) -> Iterator[WeightBucket]:
        """One round: a fresh stream's buckets, each checked before it is yielded (see :meth:`_check`).

        Raises:
            HandoffError: a delta or adapter stream, a stale, reordered or incomplete one, or one that disagrees
                with the declared layout.
        """
        receiver, sent = self._receiver, 0
        try:
            for bucket in self._buckets():
                self._check(bucket, sent)
                receiver.accept(bucket)
                sent += len(bucket.specs)
                yield bucket
            manifest = tuple(receiver.manifest)
            if self._layout is not None and sent != len(self._layout):
                raise HandoffError(
                    f"the weight stream sent {sent} tensors and the source declared {len(self._layout)}; "
                    "declare the layout of the whole model."
                )
            self.version = receiver.commit()
        except BaseException:
            receiver.abort(applied=True)
            raise
        self.manifest = manifest
        self._layout = [ParamMeta(held.name, held.dtype, held.shape) for held in manifest]

    def _check(self, bucket: WeightBucket, sent: int) -> None:
        """Refuse what vLLM's protocol cannot carry (:func:`check_sendable`) and tensors that disagree with the
        layout declared before the round (the receiver sized its buffers from it)."""
        check_sendable(bucket)
        for index, spec in enumerate(bucket.specs, start=sent):
            declared = self._layout[index] if self._layout is not None and index < len(self._layout) else None
            if self._layout is not None and (declared is None or _meta(spec) != declared):
                raise HandoffError(
                    f"the weight stream's tensor {index} is {_meta(spec)}, the source declared {declared}; "
                    "metadata() must list the stream's tensors in stream order."
                )


def check_sendable(bucket: WeightBucket) -> None:
    """Refuse a delta or adapter stream: vLLM's weight-transfer protocol reloads the whole model each round
    (its update window moves every layer to the meta device and rebuilds each from what arrives).

    Raises:
        HandoffError: naming the version, what it is and the fix.
    """
    if bucket.base_version is None and bucket.lora == "merged":
        return
    kind = f"a delta on version {bucket.base_version}" if bucket.base_version is not None else "LoRA adapters"
    raise HandoffError(
        f"version {bucket.version} arrived as {kind}, and vLLM's weight-transfer protocol reloads the whole model "
        "each version; hand off full merged weights (weight_buckets(base_version=None, lora='merged')), or, "
        "for the vllm rollouts, set rollout.options.weight_transfer=drivetrain."
    )


def _meta(held: TensorDigest) -> ParamMeta:
    return ParamMeta(held.name, held.dtype, held.shape)
