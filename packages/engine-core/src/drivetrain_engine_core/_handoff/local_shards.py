"""Delta streams decided from each rank's local shards, so that only the tensors that changed are gathered.

A sharded backend (FSDP) gathers every tensor to hand it off; a delta decided on the gathered tensor
(:mod:`.stream`) saves the wire's bytes but not the gather's. A backend with the ``sharded_export`` capability
yields its weights as :class:`ShardedWeight` groups instead: this rank's local shards of what a group is computed
from (a LoRA-merged weight: its base weight and both adapters) and the collective that gathers the group's full
tensors. Each rank digests its local shards and compares them with the base version's; one all-reduce of the
flags agrees which groups changed on any rank, and only those are gathered. An unchanged group's tensors are
listed with the digests the base version was sent with. verl diffs each rank's local shard too
(``get_per_tensor_param_shard``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from .. import _distributed as distributed
from .bucket import LoraMode, TensorDigest, WeightBucket
from .digest import digest_of
from .history import KEPT_VERSIONS, SentVersions


@dataclass(frozen=True)
class ShardedWeight:
    """One group of exported tensors as this rank holds it.

    Attributes:
        key: the group's name, the same on every rank and every version (its module state-dict name).
        local: this rank's local shard of every tensor the group's tensors are computed from (views, not
            copies; an empty one where the rank holds none of it).
        gather: a collective (every rank calls it, in the same order): the group's full tensors under their
            Hugging Face names, one at a time.
    """

    key: str
    local: tuple[torch.Tensor, ...]
    gather: Callable[[], Iterable[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class ExportBytes:
    """What one weight stream cost the sender.

    Attributes:
        gathered: bytes of the full tensors the backend gathered (before the stream's dtype cast).
        sent: bytes of the tensors packed into buckets (the rest were listed as unchanged).
    """

    gathered: int
    sent: int


@dataclass(frozen=True)
class _Group:
    digest: str  # of the group's local shards on this rank
    names: tuple[str, ...]  # the Hugging Face names its gather yields


def local_digest(shards: Iterable[torch.Tensor]) -> str:
    """One digest of several local shards' bytes (each digested by :func:`.digest.digest_of`)."""
    return xxhash.xxh3_128_hexdigest("".join(digest_of(shard) for shard in shards).encode())


class SentShards:
    """Streams versions from :class:`ShardedWeight` groups through :attr:`versions` (which keeps the full
    tensors' digests) and remembers each complete stream's local shard digests, per stream kind, for the next
    delta.

    Attributes:
        versions: the full tensors' digests of the last streams (a backend without ``sharded_export`` streams
            through it directly).
        last: what the last complete stream from groups gathered and sent (``None`` before one).
    """

    def __init__(self) -> None:
        self.versions = self._sent = SentVersions()
        self._groups: OrderedDict[tuple[int, LoraMode, str], dict[str, _Group]] = OrderedDict()
        self.last: ExportBytes | None = None

    def stream(
        self,
        weights: Iterable[ShardedWeight],
        *,
        version: int,
        base_version: int | None,
        dtype: torch.dtype | None,
        lora: LoraMode,
        **options: Any,
    ) -> Iterator[WeightBucket]:
        """:meth:`SentVersions.stream` of the groups' tensors, gathering only the groups whose local shards
        changed on some rank since ``base_version`` (every group for a full stream; a collective)."""
        groups = list(weights)
        base = self._base(base_version, lora, dtype)
        digests = [local_digest(group.local) for group in groups]
        flags = [
            float(base is None or _digest(base[0], g.key) != d) for g, d in zip(groups, digests, strict=True)
        ]
        changed = distributed.all_reduce_maxes(
            flags
        )  # NOTE: one collective: every rank gathers the same groups
        record: dict[str, _Group] = {}
        gathered = sent = 0

        def tensors() -> Iterator[tuple[str, torch.Tensor | TensorDigest]]:
            nonlocal gathered
            for group, digest, flag in zip(groups, digests, changed, strict=True):
                if flag:  # every group of a full stream (no base: every flag is set)
                    names = []
                    for name, tensor in group.gather():
                        names.append(name)
                        gathered += tensor.numel() * tensor.element_size()
                        yield name, tensor
                    record[group.key] = _Group(digest, tuple(names))
                else:
                    assert base is not None  # a flag is clear only where the base holds the group's digest
                    record[group.key] = base[0][group.key]
                    yield from ((name, base[1][name]) for name in record[group.key].names)

        stream = self._sent.stream(
            tensors(), version=version, base_version=base_version, dtype=dtype, lora=lora, **options
        )
        for bucket in stream:
            sent += sum(spec.nbytes for spec in bucket.specs)
            if bucket.last:
                self._remember((version, lora, str(dtype)), record)
                self.last = ExportBytes(gathered=gathered, sent=sent)
            yield bucket

    def _base(
        self, version: int | None, lora: LoraMode, dtype: torch.dtype | None
    ) -> tuple[dict[str, _Group], dict[str, TensorDigest]] | None:
        """The base version's groups and full digests, where both are remembered."""
        if version is None:
            return None
        groups = self._groups.get((version, lora, str(dtype)))
        sent = self._sent.base(version, lora, dtype)
        return None if groups is None or sent is None else (groups, dict(sent.digests))

    def _remember(self, key: tuple[int, LoraMode, str], record: dict[str, _Group]) -> None:
        self._groups[key] = record
        self._groups.move_to_end(key)
        while len(self._groups) > KEPT_VERSIONS:
            self._groups.popitem(last=False)


def _digest(groups: dict[str, _Group], key: str) -> str | None:
    held = groups.get(key)
    return None if held is None else held.digest
