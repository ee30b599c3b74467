"""Receiver verification: each tensor as it arrives, and what a rollout serves, read back from its model, against
the stream's digests.

Every bucket is checked on arrival (:func:`check_arrived`), before anything of it is applied, whatever the
schedule: a transport that corrupts a tensor would otherwise have it served and sampled from in every version
the schedule does not read back. A stream can reach a receiver intact and still be served wrong: a name bound to no module, a fused or padded
layout filled in the wrong order, a dtype the model casts again. So the check reads every tensor of the version
back from the served model (the rollout's ``_served_tensor`` undoes its own layout transforms), casts it to the
stream dtype, and compares the digest of those bytes with the one the sender computed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from .._config import ConfigError
from .bucket import TensorDigest, WeightBucket
from .digest import digest_of
from .receiver import HandoffError

VerifyMode = Literal["every", "periodic", "never"]
VERIFY_MODES: tuple[str, ...] = ("every", "periodic", "never")


@dataclass(kw_only=True, frozen=True)
class VerifyConfig:
    """When a rollout checks what it serves against the stream's digests.

    Reading back and hashing every served tensor costs about what the sender's hashing does (plus a copy to
    host memory on an accelerator), so by default it is done for the first version and every ``every_n``-th.

    Attributes:
        mode: ``every`` version, ``periodic`` (the first version a rollout receives, every ``every_n``-th after
            it, and the one after any failed verification) or ``never``.
        every_n: the period of ``periodic``.
    """

    mode: VerifyMode = "periodic"
    every_n: int = 10

    def __post_init__(self) -> None:
        if self.mode not in VERIFY_MODES:
            raise ConfigError(f"verify mode {self.mode!r} is not one of {list(VERIFY_MODES)}.")
        if self.every_n < 1:
            raise ConfigError(f"verify every_n must be >= 1 (1 verifies every version), got {self.every_n}.")

    def due(self, received: int) -> bool:
        """Whether the version after ``received`` committed ones is to be verified."""
        return self.mode == "every" or (self.mode == "periodic" and received % self.every_n == 0)


def check_arrived(bucket: WeightBucket) -> None:
    """Check every tensor ``bucket`` sends against the digest the sender took of it.

    NOTE: the buffer is copied to host memory once (a bucket on an accelerator), then each tensor's bytes are
    hashed in place: about 30 us per MiB on one CPU core (XXH3, 35 GB/s) and a few us per tensor.

    Raises:
        HandoffError: naming the first tensor whose bytes differ, its bucket and version, and the fix.
    """
    host = bucket.buffer.detach().cpu()
    for spec in bucket.specs:
        if digest_of(host[spec.offset : spec.offset + spec.nbytes]) != spec.digest:
            raise HandoffError(
                f"weight bucket {bucket.index} of version {bucket.version}: {spec.name} arrived with other bytes "
                "than were sent (its digest differs): the transport corrupted it. Nothing of this bucket was "
                f"applied; send version {bucket.version} again."
            )


ReadBack = Callable[[str], torch.Tensor | None]
"""The served tensor under a stream name (as the sender named it), or ``None`` when the rollout serves none."""


def verify_served(manifest: Iterable[TensorDigest], read_back: ReadBack, *, version: int, rank: int) -> None:
    """Check that every tensor of ``manifest`` is served with the bytes it was sent with.

    Raises:
        HandoffError: one error naming the first tensor that is missing, of another shape or of other bytes,
            the version and the rank, and how many tensors failed.
    """
    failed: list[str] = []
    for held in manifest:
        served = read_back(held.name)
        if served is None:
            failed.append(f"{held.name} is not served")
        elif tuple(served.shape) != held.shape:
            failed.append(f"{held.name} is served with shape {tuple(served.shape)}, sent as {held.shape}")
        elif digest_of(served.to(held.dtype)) != held.digest:
            failed.append(f"{held.name} is served with other bytes than were sent (in {held.dtype})")
    if failed:
        more = f" (and {len(failed) - 1} more tensors)" if len(failed) > 1 else ""
        raise HandoffError(
            f"weight verification failed for version {version} on rank {rank}: {failed[0]}{more}. The rollout "
            "refuses to generate with these weights; check its weight loading (names, fused layouts, dtype) and "
            "hand the version off in full."
        )
