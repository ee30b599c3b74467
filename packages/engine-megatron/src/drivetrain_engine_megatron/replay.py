"""Router replay (R3) on the Megatron engine, through megatron-core's own ``RouterReplay`` hook.

megatron-core 0.16 gives every ``TopKRouter`` a ``router_replay`` slot (filled with a
``moe.router_replay.RouterReplay`` when ``TransformerConfig.moe_enable_routing_replay`` is set) that its
top-k routing asks for the indices: in ``REPLAY_FORWARD`` it takes the slot's target indices and gathers the
router's scores there, so the gating weights still come from the live router (the formula of core's
``drivetrain_engine_core.kit``'s router replay: for Qwen3-MoE, ``moe_router_pre_softmax=False``, a softmax over the
logits at the chosen experts, the renormalised top-k probabilities). drivetrain fills the slot with
:class:`PartialRouterReplay`, megatron's class that also routes the positions the rollout did not record
(each sequence's last token, padding: ``NOT_RECORDED``) live, as the FSDP engine does, where megatron's own
would fail to gather at -1.

:class:`MegatronRouterReplay` feeds a micro-batch's ``routed_experts`` to the routers before its forward and
clears them afterwards. The record is in the layout of core's ``input_ids`` (``[rows x width]``, row-major);
megatron's routers see ``[width, rows]`` flattened sequence first, so the record is transposed to it. The
schedule does not pipeline a mixture-of-experts model (pipeline parallelism is refused for it), so a
micro-batch's backward, and the layer recomputation in it, runs before the next micro-batch is set.
Expert parallelism needs nothing more: each rank routes its own tokens over all experts before the
all-to-all. Sequence parallelism (a rank routes a slice of the row) is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from drivetrain_engine_core.backend import BatchError, MicroBatch
from drivetrain_engine_core.kit import NOT_RECORDED, ROUTED_EXPERTS, check_routes_shape, micro_batch_routes
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

_TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class PartialRouterReplay(RouterReplay):
    """megatron's ``RouterReplay`` whose forward replay routes the unrecorded positions live.

    A position is recorded in every one of its top-k slots or in none (:data:`NOT_RECORDED` throughout).
    """

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: _TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or default_compute_topk is None:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = self.target_topk_idx.to(scores.device)  # type: ignore[union-attr]
        experts = torch.where(chosen[:, :1] != NOT_RECORDED, chosen, live)
        return scores.gather(1, experts), experts


class MegatronRouterReplay:
    """The replay slots of every router of ``chunks`` (in layer order), fed one micro-batch at a time.

    Args:
        chunks: the unwrapped model chunks.
        sequence_parallel: ``engine.sequence_parallel`` (replay refused under it).
    """

    def __init__(self, chunks: list[torch.nn.Module], sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [module for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
        # NOTE: megatron's class also lists every instance in a process-wide list for its static setters; the
        # slots are driven here one by one instead, as other engines in the process (a reference) have their own.
        self._slots = [PartialRouterReplay() for _ in routers]
        for router, slot in zip(routers, self._slots, strict=True):
            router.router_replay = slot
        self._top_k = routers[0].topk if routers else 0
        self._sequence_parallel = sequence_parallel

    def set(self, micro_batch: MicroBatch) -> None:
        """Route ``micro_batch``'s next forward through its recorded experts (a no-op without a record).

        Raises:
            BatchError: a record for a model without routers, of another layer count or top-k, or under
                sequence parallelism; on every rank (each rank's batch carries the field).
        """
        self.clear()
        routes = micro_batch_routes(micro_batch)
        if routes is None:
            return
        self._refuse(routes)
        rows, width = micro_batch.inputs.input_ids.shape
        # NOTE: megatron's routers read the tokens sequence first ([width, rows] flattened).
        routes = routes.view(rows, width, *routes.shape[1:]).transpose(0, 1).reshape(routes.shape).long()
        for layer, slot in enumerate(self._slots):
            slot.set_target_indices(routes[:, layer])
            slot.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        """Route live again and drop the record (after a micro-batch's forward and backward)."""
        for slot in self._slots:
            slot.clear_indices()
            slot.clear_router_replay_action()

    def _refuse(self, routes: torch.Tensor) -> None:
        if not self._slots:
            raise BatchError(
                f"the batch carries {ROUTED_EXPERTS!r} (router replay), but the megatron model has no "
                "mixture-of-experts router to replay them through (a dense model?); turn router replay off "
                "(rollout.router_replay=disabled) or drop the field."
            )
        if self._sequence_parallel:
            raise BatchError(
                f"router replay ({ROUTED_EXPERTS!r} in the batch) with engine.sequence_parallel=True is not "
                "supported (each tensor rank routes a slice of the row); set engine.sequence_parallel=False or "
                "rollout.router_replay=disabled."
            )
        check_routes_shape(routes, len(self._slots), self._top_k)
