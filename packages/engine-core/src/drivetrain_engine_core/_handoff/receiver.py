"""The receiving side of the hand-off: a stream is accepted only whole, in order, newer than what is served
and, for a delta stream, on the base the receiver serves intact."""

from __future__ import annotations

from .._errors import DrivetrainError
from .bucket import TensorDigest, WeightBucket


class HandoffError(DrivetrainError, RuntimeError):
    """A weight stream is stale, out of order, interrupted, incomplete or failed verification; the message
    says which."""


class DeltaBaseError(HandoffError):
    """A delta stream arrived for a base the receiver does not serve intact: the sender must send the version
    in full (``weight_buckets(..., base_version=None)``). Raised at the stream's first bucket, before anything
    was applied."""


class BucketReceiver:
    """Tracks one rollout's weight versions and checks every bucket against the stream so far.

    A stream has *ended* once its ``last`` bucket arrived after buckets ``0..last`` in order; its version is
    *served* once the rollout applied every bucket and :meth:`commit` recorded it. Until then the receiver (and
    the rollout using it) reports the previous version, so a partial or failed update is never reported served.

    Attributes:
        version: the newest served version, or ``None`` before the first complete stream.
        intact: whether the served weights are exactly ``version``'s: false once a stream failed after some of
            it was applied, until a full stream is committed. Only then may a delta stream build on them.
        manifest: every tensor of the stream in progress (sent or unchanged), with its digest.
        bytes_received: bytes of the buffers of the stream in progress.
        tensor_bytes_sent: bytes of the tensors the stream in progress sent (not listed as unchanged).
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.intact = True
        self._pending: int | None = None
        self._base: int | None = None
        self._next_index = 0
        self._ended = False
        self.manifest: list[TensorDigest] = []
        self.bytes_received = self.tensor_bytes_sent = 0

    @property
    def receiving(self) -> bool:
        """Whether a stream has started and not ended (its weights are partly applied)."""
        return self._pending is not None and not self._ended

    @property
    def ended(self) -> bool:
        """Whether a stream's last bucket arrived and the stream is not yet committed or aborted."""
        return self._pending is not None and self._ended

    def accept(self, bucket: WeightBucket) -> None:
        """Check ``bucket`` against the stream; call before applying it.

        Raises:
            HandoffError: the bucket is from a version older than (or equal to) the one served, from another
                version or base than the stream in progress, or not the next index.
            DeltaBaseError: the first bucket of a delta stream whose base is not the intact served version.
        """
        if self._pending is None:
            self._start(bucket)
        elif bucket.base_version != self._base:
            raise HandoffError(
                f"weight bucket {bucket.index} of version {bucket.version} is based on version "
                f"{bucket.base_version}, the stream's first bucket on {self._base}; a stream has one base."
            )
        elif self._ended:
            raise HandoffError(
                f"weight bucket {bucket.index} of version {bucket.version} arrived after the last bucket of "
                f"version {self._pending}; the sender must end a hand-off with its last bucket."
            )
        elif bucket.version != self._pending:
            raise HandoffError(
                f"weight bucket of version {bucket.version} arrived while version {self._pending} was still "
                f"streaming (bucket {self._next_index} expected next); the sender must finish one hand-off "
                "before starting the next."
            )
        if bucket.index != self._next_index:
            raise HandoffError(
                f"weight bucket {bucket.index} of version {bucket.version} arrived, but bucket {self._next_index} "
                "was expected: buckets were lost or reordered; send the version again from bucket 0."
            )
        self._next_index += 1
        self._ended = bucket.last
        self.manifest.extend(bucket.digests)
        self.bytes_received += bucket.nbytes
        self.tensor_bytes_sent += sum(spec.nbytes for spec in bucket.specs)

    @property
    def delta(self) -> bool:
        """Whether the stream in progress is a delta stream."""
        return self._base is not None

    @property
    def pending_version(self) -> int:
        """The version of the stream in progress.

        Raises:
            HandoffError: no stream is in progress.
        """
        if self._pending is None:
            raise HandoffError("update_weights() received no bucket; pass engine.weight_buckets(...).")
        return self._pending

    def commit(self) -> int:
        """Record the ended stream's version as served (call once its weights are applied); returns it.

        Raises:
            HandoffError: no bucket arrived, or the stream has not ended.
        """
        if self._pending is None:
            raise HandoffError("update_weights() received no bucket; pass engine.weight_buckets(...).")
        if not self._ended:
            raise HandoffError(
                "the weight stream ended before its last bucket: the served weights would be partial. Send "
                "the whole engine.weight_buckets(...) stream."
            )
        self.version, self.intact = self._pending, True
        self.abort(applied=False)
        return self.version

    def abort(self, *, applied: bool) -> None:
        """Forget a stream that failed or was not committed.

        Args:
            applied: whether any of it reached the served weights (they are partial until a full stream).
        """
        self._pending, self._base, self._next_index, self._ended = None, None, 0, False
        self.manifest, self.bytes_received, self.tensor_bytes_sent = [], 0, 0
        self.intact = self.intact and not applied

    def _start(self, bucket: WeightBucket) -> None:
        if self.version is not None and bucket.version <= self.version:
            raise HandoffError(
                f"stale weights: version {bucket.version} arrived after version {self.version} was loaded; "
                "hand off with a larger version (the training step) each time."
            )
        if bucket.base_version is not None and (bucket.base_version != self.version or not self.intact):
            served = (
                f"serves version {self.version}" if self.intact else "holds partial weights (a stream failed)"
            )
            raise DeltaBaseError(
                f"version {bucket.version} arrived as a delta on version {bucket.base_version}, but this receiver "
                f"{served}; send version {bucket.version} in full (weight_buckets(..., base_version=None)), or "
                "pass base_version=rollout.delta_base."
            )
        self._pending, self._base = bucket.version, bucket.base_version
