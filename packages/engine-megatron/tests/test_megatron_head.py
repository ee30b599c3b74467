"""The output layer passed through (with and without sequence parallelism) and this rank's projection rows give,
through core's linear_log_probs on 2 gloo ranks, the gradients of a single-process full-vocabulary head."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.testing.launcher import run_distributed

TOKENS, HIDDEN, VOCAB, SHARD = 8, 16, 11, 6  # 11 ids padded to 12 rows: rank 1's last row is padding


class _OutputLayer(torch.nn.Module):
    """Stands in for ``ColumnParallelLinear``: the attributes the head reads, a forward that must not run."""

    def __init__(self, weight: torch.Tensor, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.sequence_parallel = sequence_parallel
        self.tp_group = dist.group.WORLD

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        raise AssertionError("the output layer ran inside hidden_states_out")


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, 1, HIDDEN, generator=generator, dtype=torch.float64).float()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) / HIDDEN**0.5).float()
    return hidden, weight, torch.randint(0, VOCAB, (TOKENS,), generator=generator)


def _loss(log_probs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 2.0, TOKENS) / TOKENS
    return (log_probs * weights).sum() + (entropy * weights.flip(0)).sum() * 0.3


def _rank_grads(rank: int, sequence_parallel: bool) -> dict:
    from drivetrain_engine_core.kit import linear_log_probs
    from drivetrain_engine_megatron.cpu_compat import apply_cpu_compat
    from drivetrain_engine_megatron.head import hidden_states_out, output_shard

    apply_cpu_compat()  # megatron's sequence gather allocates on torch.cuda.current_device()
    hidden, weight, labels = _inputs()
    padded = torch.cat([weight, torch.zeros(2 * SHARD - VOCAB, HIDDEN)])
    layer = _OutputLayer(padded[rank * SHARD : (rank + 1) * SHARD].clone(), sequence_parallel)
    model = SimpleNamespace(output_layer=layer, share_embeddings_and_output_weights=False)
    half = TOKENS // 2
    local = (hidden[rank * half : (rank + 1) * half] if sequence_parallel else hidden).requires_grad_()
    with hidden_states_out(model):
        out, bias = layer(local, weight=None, runtime_gather_output=None)
    shard = output_shard(model, VOCAB)
    log_probs, entropy = linear_log_probs(
        out[:, 0],
        shard.weight,
        labels,
        temperature=0.7,
        compute_entropy=True,
        chunk_size=3,
        group=shard.group,
        vocab_start=shard.vocab_start,
        vocab_size=shard.vocab_size,
    )
    grad_hidden, grad_weight = torch.autograd.grad(_loss(log_probs, entropy), (local, shard.weight))
    restored = "forward" not in vars(layer)
    return {
        "bias": bias,
        "vocab_start": shard.vocab_start,
        "log_probs": log_probs.detach(),
        "grad_hidden": grad_hidden,
        "grad_weight": grad_weight,
        "restored": restored,
    }


def _worker(rank: int, world_size: int) -> dict:
    del world_size
    return {mode: _rank_grads(rank, mode == "sequence_parallel") for mode in ("plain", "sequence_parallel")}


@pytest.mark.slow
def test_passed_through_output_layer_gives_the_full_head_gradients():
    per_rank = run_distributed(_worker, world_size=2, timeout_s=180)
    hidden, weight, labels = _inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    log_softmax = torch.log_softmax(hidden[:, 0] @ weight.T / 0.7, dim=-1)
    log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    grad_hidden, grad_weight = torch.autograd.grad(_loss(log_probs, entropy), (hidden, weight))
    grad_padded = torch.cat([grad_weight, torch.zeros(2 * SHARD - VOCAB, HIDDEN)])
    half = TOKENS // 2
    for rank, modes in enumerate(per_rank):
        for mode, got in modes.items():
            assert got["bias"] is None and got["restored"] and got["vocab_start"] == rank * SHARD
            torch.testing.assert_close(got["log_probs"], log_probs.detach(), atol=1e-6, rtol=0)
            expected_hidden = grad_hidden[rank * half : (rank + 1) * half] if mode != "plain" else grad_hidden
            torch.testing.assert_close(got["grad_hidden"], expected_hidden, atol=1e-6, rtol=0)
            torch.testing.assert_close(
                got["grad_weight"], grad_padded[rank * SHARD : (rank + 1) * SHARD], atol=1e-6, rtol=0
            )


def test_an_output_layer_with_a_bias_is_refused():
    from drivetrain_engine_megatron.head import check_output_layer

    model = SimpleNamespace(output_layer=torch.nn.Linear(4, 8), config=SimpleNamespace(mtp_num_layers=None))
    with pytest.raises(
        ConfigError, match=r"'gemma' model .*: its output layer is a Linear, not .* Use backend 'fsdp'"
    ):
        check_output_layer(model, "gemma")
