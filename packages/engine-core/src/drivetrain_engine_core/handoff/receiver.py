"""The receiving side of the hand-off: a stream is accepted only whole, in order and newer than what is served."""

from __future__ import annotations

from ..errors import DrivetrainError
from .bucket import WeightBucket


class HandoffError(DrivetrainError, RuntimeError):
    """A weight stream is stale, out of order, interrupted or incomplete; the message says which."""


class BucketReceiver:
    """Tracks one rollout's weight versions and checks every bucket against the stream so far.

    A stream has *ended* once its ``last`` bucket arrived after buckets ``0..last`` in order; its version is
    *served* once the rollout applied every bucket and :meth:`commit` recorded it. Until then the receiver (and
    the rollout using it) reports the previous version, so a partial or failed update is never reported served.

    Attributes:
        version: the newest served version, or ``None`` before the first complete stream.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self._pending: int | None = None
        self._next_index = 0
        self._ended = False

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
                version than the stream in progress, or not the next index.
        """
        if self._pending is None:
            self._start(bucket)
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
        self.version = self._pending
        self.abort()
        return self.version

    def abort(self) -> None:
        """Forget a stream that failed or was not committed (its weights are partial until a full one arrives)."""
        self._pending, self._next_index, self._ended = None, 0, False

    def _start(self, bucket: WeightBucket) -> None:
        if self.version is not None and bucket.version <= self.version:
            raise HandoffError(
                f"stale weights: version {bucket.version} arrived after version {self.version} was loaded; "
                "hand off with a larger version (the training step) each time."
            )
        self._pending = bucket.version
