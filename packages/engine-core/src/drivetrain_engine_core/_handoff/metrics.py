"""What one weight sync cost: bytes on the wire, the share of the version that changed, wall seconds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class SyncMetrics:
    """One completed ``Rollout.update_weights``.

    Attributes:
        version: the version now served.
        delta: whether it came as a delta stream.
        bytes_sent: bytes of the stream's buffers (the tensors sent plus alignment padding).
        fraction_changed: bytes of the tensors sent over bytes of every tensor of the version (1.0 for a full
            stream, which sends every tensor whether it changed or not).
        seconds: wall time of the update: producing the stream (gathering, casting, hashing on the sender),
            applying it and verifying it.
        verified: whether the served weights were checked against the stream's digests.
    """

    version: int
    delta: bool
    bytes_sent: int
    fraction_changed: float
    seconds: float
    verified: bool

    def as_metrics(self, prefix: str = "rollout/sync_") -> dict[str, float]:
        """The numbers under metric names (``rollout/sync_bytes``, ...), for a metrics writer."""
        return {
            f"{prefix}bytes": float(self.bytes_sent),
            f"{prefix}fraction_changed": self.fraction_changed,
            f"{prefix}seconds": self.seconds,
            f"{prefix}delta": float(self.delta),
            f"{prefix}verified": float(self.verified),
        }
