"""Rotary position embedding at each token's position, applied by drivetrain's core attention.

megatron rotates query and key in ``SelfAttention`` before core attention. For a packed (``thd``) row its
unfused rotation reads ``cu_seqlens`` on the host for the query and again for the key in every layer
(``_apply_rotary_pos_emb_thd``: a ``.tolist()`` and a Python loop over the sequences; the fused kernel needs
Transformer Engine), so the host waits for the device twice per layer and micro-batch. drivetrain's bridge
therefore builds ``GPTModel`` without a position embedding and :class:`~.attention.SdpaCoreAttention`
rotates query and key itself with :class:`TokenRotary`: megatron's own frequencies (``RotaryEmbedding``) and
rotation (``_apply_rotary_pos_emb_bshd``) at the position of each token, which the packed row carries on the
device (restarting at every sequence) and right-padded rows have as ``0..s-1``. The numbers are megatron's
bit for bit (the same float32 products of position and frequency); nothing is read back to the host.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


class TokenRotary(torch.nn.Module):
    """Rotates query and key, ``[tokens, ..., head_dim]``, at given positions (non-interleaved, full rotary
    dim); the angles are computed once for both.

    Args:
        head_dim: the attention head size (``kv_channels``).
        rotary_base: the RoPE base (``rope_theta``).
    """

    def __init__(self, head_dim: int, rotary_base: float) -> None:
        super().__init__()
        # NOTE: megatron's module only for its frequencies (a plain attribute: no parameter, no state dict entry).
        self._inv_freq = RotaryEmbedding(
            kv_channels=head_dim, rotary_percent=1.0, rotary_base=rotary_base, use_cpu_initialization=True
        ).inv_freq

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query`` and ``key`` rotated: token ``i`` (their first dimension) at ``positions[i]``."""
        if self._inv_freq.device != query.device:
            self._inv_freq = self._inv_freq.to(query.device)
        freqs = torch.outer(positions.to(self._inv_freq.dtype), self._inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # as RotaryEmbedding.get_emb, non-interleaved
        angles = angles.view(angles.shape[0], *([1] * (query.dim() - 2)), angles.shape[-1])
        return _apply_rotary_pos_emb_bshd(query, angles), _apply_rotary_pos_emb_bshd(key, angles)
