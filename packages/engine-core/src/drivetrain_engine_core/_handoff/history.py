"""The sender's memory of what it streamed: the digests of its last few versions, the bases of delta streams.

A delta stream needs what the receiver holds. Keeping the base tensors would double the sender's memory; their
digests (one per tensor) tell as well which tensors changed. Only complete streams are remembered (the
consumer took the last bucket), per stream kind: a version sent in bfloat16 is no base for a float32 stream,
nor a merged one for an adapter stream.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .bucket import LoraMode, TensorDigest, WeightBucket
from .stream import BaseVersion, bucket_tensors

logger = logging.getLogger(__name__)

KEPT_VERSIONS = 4
"""Complete streams remembered: the receiver's base is usually the last one, or one before it when the last
stream failed at the receiver."""


class SentVersions:
    """Streams weight versions (full or delta) and remembers the digests of the last :data:`KEPT_VERSIONS` streams."""

    def __init__(self) -> None:
        self._sent: OrderedDict[tuple[int, LoraMode, str], dict[str, TensorDigest]] = OrderedDict()

    def stream(
        self,
        tensors: Iterable[tuple[str, torch.Tensor | TensorDigest]],
        *,
        version: int,
        base_version: int | None,
        dtype: torch.dtype | None,
        lora: LoraMode,
        **options: Any,
    ) -> Iterator[WeightBucket]:
        """:func:`.stream.bucket_tensors` against ``base_version``'s digests; a full stream when it is
        ``None`` or not remembered (then every bucket says ``base_version=None``, and any receiver applies it)."""
        base = None if base_version is None else self.base(base_version, lora, dtype, log=True)
        record: dict[str, TensorDigest] = {}
        for bucket in bucket_tensors(tensors, version=version, dtype=dtype, lora=lora, base=base, **options):
            record.update((held.name, held) for held in bucket.digests)
            if bucket.last:
                self._remember((version, lora, str(dtype)), record)
            yield bucket

    def base(
        self, version: int, lora: LoraMode, dtype: torch.dtype | None, *, log: bool = False
    ) -> BaseVersion | None:
        """The digests ``version`` was streamed with (``lora`` mode, ``dtype``), or ``None`` where it is not
        remembered (logged with ``log``: the stream then goes in full)."""
        digests = self._sent.get((version, lora, str(dtype)))
        if digests is None:
            if not log:
                return None
            logger.info(
                "weight_buckets(base_version=%d): no %s stream in %s of that version was sent (the last %d are "
                "kept); sending the full version",
                version,
                lora,
                dtype,
                KEPT_VERSIONS,
            )
            return None
        return BaseVersion(version=version, digests=digests)

    def _remember(self, key: tuple[int, LoraMode, str], record: Mapping[str, TensorDigest]) -> None:
        self._sent[key] = dict(record)
        self._sent.move_to_end(key)
        while len(self._sent) > KEPT_VERSIONS:
            self._sent.popitem(last=False)
