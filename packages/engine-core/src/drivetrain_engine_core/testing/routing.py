"""References for router replay (R3) tests, written out on plain Hugging Face models, not drivetrain's hooks.

Shared by the FSDP and Megatron tests: a plain forward's own routing, a record chosen by a formula (so that
it differs from the live routing), and a plain forward whose routers are forced to a record by the R3 formula
(the recorded experts, the live softmax at them renormalised, as Qwen3-MoE's ``norm_topk_prob`` says; an
unrecorded position, -1, keeps the live choice).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict

from drivetrain_engine_core._data.batch import make_batch
from drivetrain_engine_core._router_replay import NOT_RECORDED, ROUTED_EXPERTS, ROUTES_DTYPE

__all__ = ["forced_log_probs", "forced_routing", "formula_routes", "plain_hf_top_k", "with_routes"]


def plain_hf_top_k(model: Any, sequence: torch.Tensor) -> torch.Tensor:
    """``(tokens, layers, k)``: the experts a plain HF forward of ``sequence`` alone routes each token to."""
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(input_ids=sequence[None], output_router_logits=True)
    return torch.stack([logits.softmax(-1).topk(top_k).indices for logits in out.router_logits], dim=1)


def formula_routes(length: int, layers: int, experts: int, top_k: int) -> torch.Tensor:
    """A ``(length, layers, top_k)`` record: token ``t`` of layer ``l`` to the ``top_k`` experts from
    ``(3t + 2l + 1) mod experts`` on; the last token :data:`NOT_RECORDED`, as a rollout records it."""
    t = torch.arange(length).view(-1, 1, 1)
    layer = torch.arange(layers).view(1, -1, 1)
    routes = (3 * t + 2 * layer + 1 + torch.arange(top_k).view(1, 1, -1)) % experts
    routes[-1] = NOT_RECORDED
    return routes.to(ROUTES_DTYPE)


def with_routes(batch: TensorDict, routes: Sequence[torch.Tensor]) -> TensorDict:
    """``batch``'s sequences and loss mask with one record per sequence as its ``routed_experts`` field."""
    return make_batch(
        list(batch["input_ids"].unbind()),
        loss_mask=list(batch["loss_mask"].unbind()),
        **{ROUTED_EXPERTS: list(routes)},
    )


@contextmanager
def forced_routing(model: Any, record: torch.Tensor) -> Iterator[None]:
    """Force a plain HF model's routers (``model.model.layers[i].mlp.gate``) to ``record``, ``(tokens,
    layers, k)`` of the one sequence the forward runs, by the R3 formula."""
    handles = []
    for layer, block in enumerate(model.model.layers):
        recorded = record[:, layer].long()

        def hook(module, args, out, recorded=recorded):  # type: ignore[no-untyped-def]
            logits, _, live = out
            experts = torch.where(recorded[:, :1] >= 0, recorded, live)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
            return logits, weights / weights.sum(-1, keepdim=True), experts

        handles.append(block.mlp.gate.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def forced_log_probs(model: Any, sequence: torch.Tensor, record: torch.Tensor) -> torch.Tensor:
    """``log p(token i | tokens < i)`` for ``i >= 1`` of a plain forward of ``sequence`` forced to ``record``."""
    with forced_routing(model, record), torch.no_grad():
        logits = model(input_ids=sequence[None]).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, sequence[1:, None]).squeeze(-1)
