"""Each response's routed experts from the router calls of one ``generate`` (router replay, R3).

``generate`` runs the routers once on the left-padded prompts (the prefill: ``rows x width`` tokens) and then
once per decode step on the token sampled before it (``rows`` tokens). A response token's routing is that of
the step that reads it; the last sampled token is never read, so its row is ``NOT_RECORDED`` (the actor
routes it live, and its hidden state predicts nothing the loss reads). See core's ``router_replay``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from drivetrain_engine_core.kit import NOT_RECORDED


def sequence_routes(
    calls: Sequence[Sequence[torch.Tensor]],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    width: int,
) -> list[torch.Tensor]:
    """One ``(prompt + response tokens, layers, top_k)`` record per row, on the host.

    Args:
        calls: per router (layer order), the top-k indices of each forward call of ``generate``.
        prompt_lengths: each row's prompt tokens (left-padded to ``width`` in the prefill).
        response_lengths: each row's response tokens (at least one; the rest of its steps are padding).
        width: the prefill's width.

    Raises:
        RuntimeError: the calls are not one prefill of ``rows x width`` tokens and one ``rows``-token call per
            later step (a ``generate`` that runs the model otherwise cannot be recorded this way).
    """
    rows, steps = len(prompt_lengths), max(response_lengths)
    layers = []
    for layer_calls in calls:
        shapes = [tuple(call.shape[:1]) for call in layer_calls]
        if len(layer_calls) < steps or shapes[0] != (rows * width,) or any(s != (rows,) for s in shapes[1:]):
            raise RuntimeError(
                f"router replay expected one prefill of {rows}x{width} tokens and one call of {rows} tokens per "
                f"later step ({steps} steps) from generate, got calls of {shapes} tokens."
            )
        prefill = layer_calls[0].view(rows, width, -1)
        decode = torch.stack(list(layer_calls[1:steps]), dim=1) if steps > 1 else prefill[:, :0]
        layers.append((prefill, decode))
    records = []
    for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        per_layer = [
            torch.cat(
                [
                    prefill[row, width - prompt :],
                    decode[row, : response - 1],
                    prefill.new_full((1, prefill.shape[-1]), NOT_RECORDED),
                ]
            )
            for prefill, decode in layers
        ]
        records.append(torch.stack(per_layer, dim=1).cpu())
    return records
