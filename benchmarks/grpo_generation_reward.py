"""The reward of ``grpo_generation_bound.py``'s job: graded, cheap and independent of length.

The benchmark measures the loop, not learning, so the reward only has to vary within a group (equal rewards
would leave the loss nothing to do): a checksum of each completion's token ids, scaled to [0, 1).
"""

from __future__ import annotations

import zlib
from typing import Any


def checksum_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """Each completion's CRC-32 of its token ids, in [0, 1): the same ids always score the same."""
    return [zlib.crc32(bytes(str(ids), "ascii")) / 2**32 for ids in completion_ids]
