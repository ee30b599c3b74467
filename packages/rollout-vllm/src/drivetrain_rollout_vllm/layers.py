"""A weight stream grouped by the vLLM layer each tensor loads into, each layer handed on once the stream has
accounted for all of it.

vLLM rebuilds a layer (a fused ``qkv_proj``, an embedding) from the checkpoint tensors of one load, so a layer
is applied only once every tensor of it was sent or listed unchanged by a delta stream; then the unchanged
ones are read back from what vLLM serves (a delta that sends ``q_proj`` alone still rebuilds ``qkv_proj`` with
the served ``k_proj`` and ``v_proj``). A stream lists an unchanged tensor in the bucket that covers its place in
the stream, so a layer's fate is known by the bucket that holds its last part.

NOTE: bounded memory. What a bucket completes is applied from views into its buffer; only the tensors of a
layer a bucket boundary cuts are copied and held until the bucket that completes it, so between buckets the
receiver holds at most about one layer (:attr:`LayerAssembler.held_bytes`), whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from drivetrain_engine_core.rollout import HandoffError


@dataclass(frozen=True)
class ReadyLayer:
    """A layer the stream has fully accounted for.

    Attributes:
        module: the vLLM module the tensors load into (``model.layers.0.self_attn.qkv_proj``).
        weights: the tensors the stream sent for it, by checkpoint name.
        rest: its other tensors (unchanged in a delta stream), to load as vLLM serves them now.
    """

    module: str
    weights: tuple[tuple[str, torch.Tensor], ...]
    rest: tuple[str, ...]


class LayerAssembler:
    """One stream's tensors, grouped by layer until each layer is complete.

    Args:
        layers: the vLLM layer of each checkpoint tensor (checkpoint name -> module name).
        optional: names a stream may leave out (a tied ``lm_head.weight``): a layer never waits for them.
    """

    def __init__(self, layers: Mapping[str, str], optional: Iterable[str] = ()) -> None:
        self._layer_of = dict(layers)
        skipped = set(optional)
        self._needed: dict[str, set[str]] = {}
        for name, layer in self._layer_of.items():
            if name not in skipped:
                self._needed.setdefault(layer, set()).add(name)
        self._accounted: set[str] = set()
        self._held: dict[str, dict[str, torch.Tensor]] = {}
        self.applied_layers = 0
        """How many layers of this stream were handed on (and so applied in place)."""

    @property
    def held_bytes(self) -> int:
        """Bytes of the tensors held for layers the stream has not completed yet."""
        return sum(t.numel() * t.element_size() for held in self._held.values() for t in held.values())

    def add(self, sent: Iterable[tuple[str, torch.Tensor]], unchanged: Iterable[str]) -> list[ReadyLayer]:
        """Take one bucket (its tensors, views into its buffer, and the names it lists as unchanged); returns
        the layers it completes. The tensors of a layer it leaves incomplete are copied (the views would keep
        the bucket's buffer alive).

        Raises:
            HandoffError: a tensor this stream already sent or listed.
        """
        fresh = []
        for name, tensor in sent:
            self._account(name)
            self._held.setdefault(self._layer_of[name], {})[name] = tensor
            fresh.append(name)
        for name in unchanged:
            self._account(name)
        ready = [
            self._ready(layer)
            for layer in list(self._held)
            if self._needed.get(layer, set()) <= self._accounted
        ]
        for name in fresh:
            held = self._held.get(self._layer_of[name])
            if held is not None:
                held[name] = held[name].clone()
        self.applied_layers += len(ready)
        return ready

    def missing(self) -> list[str]:
        """The names no bucket of the stream sent or listed (optional ones aside), sorted."""
        return sorted(set().union(*self._needed.values()) - self._accounted)

    def _account(self, name: str) -> None:
        if name in self._accounted:
            raise HandoffError(
                f"the weight stream holds {name} twice; a stream sends or lists each tensor once (send the version "
                "again from a fresh engine.weight_buckets(...))."
            )
        self._accounted.add(name)

    def _ready(self, layer: str) -> ReadyLayer:
        weights = self._held.pop(layer)
        rest = sorted(self._needed.get(layer, set()) - set(weights))
        return ReadyLayer(module=layer, weights=tuple(weights.items()), rest=tuple(rest))
