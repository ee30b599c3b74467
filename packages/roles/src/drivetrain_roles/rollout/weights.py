"""Served weights of the Hugging Face rollout: full tensors copied in place, or LoRA adapters folded in.

Streams are in checkpoint layout; a tensor the model holds in another layout (mixture-of-experts experts fused
by transformers) is copied into the elements it comes from (:mod:`..hf_layout`).

Adapters are folded exactly as the engines merge them for ``export_weights`` (``W + (B @ A in fp32) * alpha / r``
cast back), so an adapter hand-off serves the same bits as a merged one. A delta stream sends only what changed:
the tensors it lists as unchanged count as covered (merged), or are taken from the adapters folded last time
(adapter mode). What is served is read back by stream name for verification: a model weight from the model, an
adapter tensor from the adapters folded in.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import torch
from drivetrain_engine_core.kit import PEFT_PREFIX
from drivetrain_engine_core.rollout import HandoffError, WeightBucket, check_adapter_binding

from ..hf_layout import CheckpointLayout


class ServedWeights:
    """The rollout model's tensors by Hugging Face name, and what the current stream has covered.

    Args:
        model: the served ``transformers`` model.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._layout = CheckpointLayout(model)
        self._stream: dict[str, torch.Tensor] | None = None
        tied = getattr(model.config, "tie_word_embeddings", False)
        self._optional = {"lm_head.weight"} if tied else set()
        self._base: dict[str, torch.Tensor] | None = None
        self._merged_seen = False
        self._seen: set[str] = set()
        self._incoming: dict[str, torch.Tensor] = {}  # the adapter tensors of the stream in progress
        self._unchanged_adapters: set[str] = set()
        self._adapter_config: Mapping[str, Any] | None = None
        self._adapters: dict[str, torch.Tensor] = {}  # the adapter tensors folded into the served weights

    @property
    def _tensors(self) -> dict[str, torch.Tensor]:
        # NOTE: read once per stream, never cached across streams: moving the model (sleep/wake) replaces the
        # parameters' storage, and copies into an old state dict would silently never reach the model.
        if self._stream is None:
            self._stream = dict(self._model.state_dict())
        return self._stream

    def load(self, bucket: WeightBucket) -> None:
        """Copy a merged bucket's tensors in place, or keep an adapter bucket's tensors for :meth:`finish`."""
        if bucket.lora == "adapter":
            if self._merged_seen:
                raise HandoffError(
                    "this rollout already served merged weights, so its model no longer holds the base weights "
                    "adapters fold into; hand off with one lora mode for the rollout's whole life."
                )
            self._adapter_config = bucket.adapter_config
            self._incoming.update((name, tensor.clone()) for name, tensor in bucket.tensors())
            self._unchanged_adapters.update(held.name for held in bucket.unchanged)
            return
        self._merged_seen = True
        with torch.no_grad():
            for name, tensor in bucket.tensors():
                self._copy(name, tensor)
                self._seen.add(name)
        self._seen.update(held.name for held in bucket.unchanged)

    def finish(self) -> None:
        """Fold held adapters in, or check that a merged stream covered every weight of the model."""
        try:
            if self._adapter_config is not None:
                self._fold_adapters()
                return
            missing = sorted(set(self._layout.owner) - self._seen - self._optional)
            if missing:
                raise HandoffError(
                    f"the weight stream missed {len(missing)} of the model's tensors ({missing[:3]}); the sender's "
                    "export must yield every Hugging Face weight."
                )
        finally:
            self.forget_stream()

    def forget_stream(self) -> None:
        """Drop what the current stream covered and held back; after :meth:`finish`, or a stream that failed.

        A failed stream's leftovers used to reach the next one: its covered names passed the next stream's
        coverage check for tensors it never sent, its adapters were folded in again, and its cached state dict
        (stale once sleep/wake moved the model) took the next stream's copies away from the model.
        """
        self._seen, self._incoming, self._adapter_config, self._stream = set(), {}, None, None
        self._unchanged_adapters = set()
        self._layout.forget()

    def served(self, name: str) -> torch.Tensor | None:
        """The served tensor under a stream name: an adapter tensor folded in, or the model's weight."""
        if name in self._adapters:
            return self._adapters[name]
        return self._layout.read_piece(name)

    def move_base(self, device: str) -> None:
        """Move the base weights and adapters kept for adapter folding with the model (``sleep``/``wake``)."""
        if self._base is not None:
            self._base = {name: tensor.to(device) for name, tensor in self._base.items()}
        self._adapters = {name: tensor.to(device) for name, tensor in self._adapters.items()}

    def _stream_adapters(self) -> dict[str, torch.Tensor]:
        """The adapters of the version: those sent, and those listed unchanged from the ones folded last."""
        missing = sorted(self._unchanged_adapters - set(self._adapters))
        if missing:
            raise HandoffError(
                f"the adapter stream lists {missing[:3]} as unchanged, but this rollout holds no such adapter; "
                "send the version in full."
            )
        return {**{name: self._adapters[name] for name in self._unchanged_adapters}, **self._incoming}

    def _fold_adapters(self) -> None:
        config = self._adapter_config or {}
        adapters = self._stream_adapters()
        scale = float(config["lora_alpha"]) / float(config["r"])
        modules = [n.removesuffix(".lora_A.weight") for n in adapters if n.endswith(".lora_A.weight")]
        adapted = {module: module.removeprefix(PEFT_PREFIX) + ".weight" for module in modules}
        check_adapter_binding(
            config,
            [name for name, _ in self._model.named_modules()],
            [m.removeprefix(PEFT_PREFIX) for m in modules],
        )
        if self._base is None:
            # The first adapter hand-off: the model still holds the base weights. Only the adapted ones are kept
            # (a copy of the whole model doubled the rollout's memory for the run).
            self._base = {name: self._target(name, self._tensors[name]).clone() for name in adapted.values()}
        new = sorted(set(adapted.values()) - set(self._base))
        if new:
            raise HandoffError(
                f"the adapter stream adapts {new[:3]}, which the first adapter hand-off did not; their base weights "
                "are gone (folded). Keep the adapter's target modules for the whole run."
            )
        with torch.no_grad():
            for module, hf_name in adapted.items():
                base = self._base[hf_name]
                delta = (
                    adapters[f"{module}.lora_B.weight"].float() @ adapters[f"{module}.lora_A.weight"].float()
                ).to(base.dtype)
                self._target(hf_name, base).copy_(base + delta * scale)
        self._adapters = adapters

    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        """Copy a streamed tensor into the served weight, or into its elements of a fused one."""
        owner = self._layout.owner.get(name)
        if owner is None or self._layout.is_direct(name):
            self._target(name, tensor).copy_(tensor)
            return
        try:
            self._layout.copy_piece(self._tensors[owner], name, tensor)
        except ValueError as e:
            raise HandoffError(f"{e}; hand off weights of the same architecture.") from e

    def _target(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        target = self._tensors.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(self._layout.owner), n=1)
            raise HandoffError(
                f"the weight stream holds {name!r}, which the served model does not have"
                f"{f' (closest: {close[0]!r})' if close else ''}; hand off weights of the same architecture."
            )
        if target.shape != tensor.shape:
            raise HandoffError(
                f"{name}: the stream sends shape {tuple(tensor.shape)}, the served model has {tuple(target.shape)}."
            )
        return target
