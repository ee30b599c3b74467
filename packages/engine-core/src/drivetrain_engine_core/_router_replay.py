"""Router replay (R3, "rollout routing replay"): the rollout records each token's routed experts, the actor
replays them.

A mixture-of-experts router picks each token's top-k experts from its logits. The rollout and the actor
compute those logits with different kernels (a KV cache, another batch shape, another engine), so near-tied
choices flip and the two score a token through different experts: the log-probs then differ by far more than
the weights explain. With replay, the rollout returns the indices it routed each token to (per layer, top-k)
as the batch's per-token field :data:`ROUTED_EXPERTS`, and the actor's forward takes its top-k *choice* from
that record while the gating weights still come from the current router's softmax at the recorded experts
(renormalised as the model does), so the router keeps its gradient.

The record of a sequence is ``(tokens, layers, top_k)`` in the batch's token order: prompt tokens hold the
routing of the rollout's prefill, response tokens the routing of the decode step that read them. The last
token of a sequence is never read during generation (nothing is sampled after it) and holds
:data:`NOT_RECORDED`: the actor routes such positions live; their hidden states predict no token the loss
reads.

This module works on transformers' MoE modules (Qwen3-MoE, Qwen2-MoE, Mixtral): their routers are
``*TopKRouter`` modules returning ``(logits, top_k_weights, top_k_indices)``, and hooks on them record or
replay. Shared by the ``hf`` rollout (recording) and the FSDP engine (replay); the Megatron engine replays
through megatron-core's own hook and shares the record's layout and checks (:func:`micro_batch_routes`,
:func:`check_routes_shape`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor

from ._data.batch import ROUTED_EXPERTS
from ._errors import BatchError
from ._round_trip import MicroBatch

__all__ = [
    "NOT_RECORDED",
    "ROUTED_EXPERTS",
    "ROUTES_DTYPE",
    "check_routes_shape",
    "hf_routers",
    "micro_batch_routes",
    "recording_routes",
    "refuse_routes",
    "replaying_routes",
    "routers_of",
]

NOT_RECORDED = -1
"""The index of a position the rollout did not route (each sequence's last token): the actor routes it live."""

ROUTES_DTYPE = torch.int16
"""Recorded indices are stored small (a 48-layer top-8 model holds 768 of them per token)."""


def hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a transformers mixture-of-experts model, in layer order (``[]`` for a dense one)."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


def routers_of(model: torch.nn.Module, what: str) -> list[torch.nn.Module]:
    """:func:`hf_routers`, refusing a model without any.

    Raises:
        BatchError: the model has no transformers ``TopKRouter`` (a dense model, or another MoE implementation).
    """
    routers = hf_routers(model)
    if not routers:
        raise BatchError(
            f"{what}: router replay needs a mixture-of-experts model whose routers are transformers' TopKRouter "
            f"modules (Qwen3-MoE, Qwen2-MoE, Mixtral), and {type(model).__name__} has none. Turn router replay "
            "off (rollout.router_replay=disabled) for this model."
        )
    return routers


@contextmanager
def recording_routes(routers: Sequence[torch.nn.Module]) -> Iterator[list[list[Tensor]]]:
    """Record every forward call's top-k indices: per router, one ``(tokens, top_k)`` tensor per call."""
    calls: list[list[Tensor]] = [[] for _ in routers]

    def recorder(index: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> None:
            calls[index].append(output[2].detach().to(ROUTES_DTYPE))

        return hook

    handles = [router.register_forward_hook(recorder(i)) for i, router in enumerate(routers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def replaying_routes(routers: Sequence[torch.nn.Module], routes: Tensor | None) -> Iterator[None]:
    """Route through the recorded experts while the context is open (forward and backward, as activation
    checkpointing runs the routers again in backward).

    Args:
        routers: the model's routers (:func:`hf_routers`).
        routes: ``(tokens, layers, top_k)`` indices in the layout of the forward's ``input_ids`` (padding and
            unrecorded positions :data:`NOT_RECORDED`), or ``None``: route live.

    Raises:
        BatchError: the record's layer count or top-k is not the model's.
    """
    if routes is None:
        yield
        return
    check_routes_shape(routes, len(routers), cast(int, routers[0].top_k))
    routes = routes.long()
    recorded = routes[:, 0, :1] != NOT_RECORDED  # a position is recorded in every layer or in none
    handles = [
        router.register_forward_hook(_replay(router, routes[:, layer], recorded))
        for layer, router in enumerate(routers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_routes_shape(routes: Tensor, layers: int, top_k: int) -> None:
    """Refuse a ``(tokens, layers, top_k)`` record of another model than one of ``layers`` routed layers x
    ``top_k`` (shared by the backends that replay).

    Raises:
        BatchError: the record's layer count or top-k is not the model's.
    """
    if routes.shape[1] != layers or routes.shape[2] != top_k:
        raise BatchError(
            f"the batch's {ROUTED_EXPERTS} records {routes.shape[1]} layers x top-{routes.shape[2]} per token, but "
            f"the model routes {layers} layers x top-{top_k}; record them with this model."
        )


def _replay(router: torch.nn.Module, chosen: Tensor, recorded: Tensor) -> Any:
    """The forward hook that swaps the router's top-k choice for the recorded one.

    The weights are the router's own formula at the chosen experts: ``softmax(logits)`` gathered there, divided
    by their sum where the model normalises its top-k (Mixtral always; Qwen's ``norm_topk_prob``), cast as the
    model casts them. Where the choice is the live one this gives the live weights bit for bit.
    """
    normalise = bool(getattr(router, "norm_topk_prob", True))

    def hook(module: torch.nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> Any:
        logits, live_weights, live = output
        experts = torch.where(recorded, chosen, live)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
        if normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(live_weights.dtype), experts

    return hook


def micro_batch_routes(micro_batch: MicroBatch) -> Tensor | None:
    """The micro-batch's :data:`ROUTED_EXPERTS` in the layout of its ``input_ids`` (``(rows x width, layers,
    top_k)``, padding :data:`NOT_RECORDED`), or ``None`` when the batch has none."""
    if ROUTED_EXPERTS not in micro_batch.batch:
        return None
    values = micro_batch.batch[ROUTED_EXPERTS].values()
    positions = getattr(micro_batch.inputs, "token_positions", None)
    if positions is None:  # the packed row: tokens in batch order
        return values
    rows, width = micro_batch.inputs.input_ids.shape
    dense = values.new_full((rows * width, *values.shape[1:]), NOT_RECORDED)
    dense[positions] = values
    return dense


def refuse_routes(micro_batches: Sequence[MicroBatch], backend: str) -> None:
    """Refuse recorded routes on a backend that does not replay them (it would route live without a word).

    Raises:
        BatchError: the batch carries :data:`ROUTED_EXPERTS`; on every rank, as every rank's batch has the field.
    """
    if micro_batches and ROUTED_EXPERTS in micro_batches[0].batch:
        raise BatchError(
            f"the batch carries {ROUTED_EXPERTS!r} (router replay, rollout.router_replay=R3), which the {backend} "
            "engine does not replay; set rollout.router_replay=disabled, or use a backend that replays "
            "(engine.backend=fsdp or megatron)."
        )
