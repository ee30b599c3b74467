"""Log-probs and entropy on vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for a contiguous slice of the vocabulary. Softmax statistics are
combined with all-reduces over the tensor-parallel group (a max for stability, then sums), the way
megatron's vocab-parallel cross-entropy does, so memory stays ``tokens x vocab / TP``. The sums go through
megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward): the
downstream loss is computed identically on every TP rank, so each rank's slice receives the full gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _tp_sum(tensor: torch.Tensor) -> torch.Tensor:
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return tensor
    return reduce_from_tensor_model_parallel_region(tensor)


def _shifted_logits(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, int]:
    """Local logits minus the global row max, padded vocabulary entries at ``-inf``; and this slice's start."""
    local_vocab = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local_vocab
    if start + local_vocab > vocab_size:
        column = torch.arange(start, start + local_vocab, device=logits.device)
        logits = logits.masked_fill(column >= vocab_size, float("-inf"))
    row_max = logits.detach().max(dim=-1).values
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    return logits - row_max.unsqueeze(-1), start


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(label)`` per row, and the entropy of each row's distribution when asked.

    Args:
        logits: ``[tokens, vocab / TP]`` float logits of this rank's vocabulary slice.
        labels: ``[tokens]`` token ids in the full vocabulary.
        vocab_size: the real vocabulary size (padded entries beyond it are ignored).
        temperature: logits are divided by it first.
        with_entropy: also compute the entropy.

    Returns:
        ``(log_probs [tokens], entropy [tokens] or None)``, equal on every tensor-parallel rank.
    """
    shifted, start = _shifted_logits(logits.float() / temperature, vocab_size)
    exp = shifted.exp()
    sum_exp = _tp_sum(exp.sum(dim=-1))
    local_label = labels - start
    in_slice = (local_label >= 0) & (local_label < shifted.shape[-1])
    picked = shifted.gather(-1, local_label.clamp(0, shifted.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    label_logit = _tp_sum(torch.where(in_slice, picked, torch.zeros_like(picked)))
    log_sum_exp = sum_exp.log()
    log_probs = label_logit - log_sum_exp
    if not with_entropy:
        return log_probs, None
    # H = log Z - sum_v p_v * l_v, with l the shifted logits (padded entries have p = 0: skip their -inf).
    weighted = torch.where(exp > 0, exp * shifted, torch.zeros_like(shifted))
    entropy = log_sum_exp - _tp_sum(weighted.sum(dim=-1)) / sum_exp
    return log_probs, entropy
