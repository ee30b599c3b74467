"""Adapter-only hand-offs on vLLM: each version a LoRA adapter of its own, served through vLLM's LoRA support.

An adapter stream (``weight_buckets(lora="adapter")``) carries only the PEFT adapter tensors; the base weights vLLM
loaded at start stay as they are. Each complete version is written as a PEFT adapter folder and added to vLLM
under a new LoRA id (``add_lora``), and requests are tagged with the newest version's ``LoRARequest``. vLLM keys
its prefix cache by the adapter, so a new version needs no cache reset, and a request started under an older
version keeps its adapter while it runs: the last ``keep`` versions stay loaded (``max_staleness + 1`` for an
asynchronous trainer), older ones are removed (``remove_lora``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.kit import PEFT_PREFIX
from drivetrain_engine_core.rollout import HandoffError, WeightBucket, check_adapter_binding


class AdapterVersions:
    """The adapter versions a vLLM rollout serves, and the adapter stream in progress.

    Args:
        add: vLLM's ``add_lora`` (takes a ``LoRARequest``).
        remove: vLLM's ``remove_lora`` (takes a LoRA id).
        keep: how many versions stay loaded (the newest serves new requests, older ones finish theirs).
        modules: the served model's modules under their Hugging Face names (what an adapter binds to).
    """

    def __init__(
        self, add: Callable[[Any], bool], remove: Callable[[int], bool], *, keep: int, modules: Iterable[str]
    ) -> None:
        self._add, self._remove, self._keep = add, remove, keep
        self._modules = sorted(modules)
        self._folder = Path(tempfile.mkdtemp(prefix="drivetrain-vllm-adapters-"))
        weakref.finalize(self, shutil.rmtree, self._folder, ignore_errors=True)
        self._loaded: list[Any] = []  # LoRARequests, oldest first
        self._tensors: dict[str, torch.Tensor] = {}  # the newest version's (the base of a delta)
        self._config: Mapping[str, Any] | None = None
        self._version = 0  # the stream in progress's
        self._incoming: dict[str, torch.Tensor] = {}
        self._unchanged: list[str] = []
        self._next_id = 1

    @property
    def current(self) -> Any | None:
        """The ``LoRARequest`` of the newest version (``None`` before any adapter version)."""
        return self._loaded[-1] if self._loaded else None

    @property
    def loaded_ids(self) -> list[int]:
        """The LoRA ids of the versions kept loaded, oldest first."""
        return [request.lora_int_id for request in self._loaded]

    def add(self, bucket: WeightBucket) -> None:
        """Keep an adapter bucket's tensors (copies: the bucket's buffer is reused) until the stream ends."""
        self._config, self._version = bucket.adapter_config, bucket.version
        self._incoming.update((name, tensor.clone()) for name, tensor in bucket.tensors())
        self._unchanged.extend(held.name for held in bucket.unchanged)

    def finish(self) -> None:
        """Serve the stream's adapter as its version: written as a PEFT folder, added to vLLM under a new id,
        the oldest version beyond ``keep`` removed.

        Raises:
            HandoffError: a delta named adapter tensors no version sent, the adapter left a module its
                ``target_modules`` selects unbound (or bound none: :func:`check_adapter_binding`), or vLLM
                refused it.
        """
        missing = [name for name in self._unchanged if name not in self._tensors]
        if missing:
            raise HandoffError(
                f"the adapter delta lists {missing[:3]} as unchanged, which no served adapter version holds; hand "
                "the adapter version off in full."
            )
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        version = self._version
        tensors = {name: self._tensors[name] for name in self._unchanged} | self._incoming
        bound = [n.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") for n in tensors if "lora_A" in n]
        check_adapter_binding(self._config or {}, self._modules, bound)
        folder = self._folder / f"v{version}-{self._next_id}"
        folder.mkdir()
        save_file(
            {name: t.contiguous() for name, t in tensors.items()}, str(folder / "adapter_model.safetensors")
        )
        (folder / "adapter_config.json").write_text(json.dumps(dict(self._config or {})))
        request = LoRARequest(f"drivetrain-v{version}-{self._next_id}", self._next_id, str(folder))
        self._next_id += 1
        try:
            self._add(request)
        except Exception as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise HandoffError(f"vLLM refused adapter version {version}: {e}") from e
        self._loaded.append(request)
        self._tensors = tensors
        while len(self._loaded) > self._keep:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        old = self._loaded.pop(0)
        self._remove(old.lora_int_id)
        shutil.rmtree(old.lora_path, ignore_errors=True)

    def abort(self) -> None:
        """Forget the stream in progress (the served versions stay)."""
        self._incoming, self._unchanged = {}, []

    def scaling(self) -> float:
        """``lora_alpha / r`` of the served adapter (vLLM folds it into ``lora_B``)."""
        config = self._config or {}
        return float(config["lora_alpha"]) / float(config["r"])

    def sent(self, name: str) -> torch.Tensor | None:
        """The newest version's tensor ``name`` as it arrived."""
        return self._tensors.get(name)

    def clear(self) -> None:
        """Remove every version from vLLM (the base weights serve again)."""
        while self._loaded:
            self._drop_oldest()
        self._tensors, self._config = {}, None
        self.abort()


def served_adapter_tensor(
    versions: AdapterVersions, name: str, read_back: Callable[[int, str], torch.Tensor | None]
) -> torch.Tensor | None:
    """The adapter tensor ``name`` of the newest version as vLLM holds it, in the stream's terms.

    vLLM keeps ``lora_A`` as sent and ``lora_B`` multiplied by the scaling (``lora_B *= alpha / r``, in place):
    a ``lora_B`` that equals what arrived times the scaling, bit for bit, is read back as what arrived, and
    otherwise as vLLM's divided by the scaling (which then fails the digest check). ``read_back`` is
    :func:`.worker.served_adapter` for the current LoRA id.
    """
    current = versions.current
    if current is None:
        return None
    served = read_back(current.lora_int_id, name)
    if served is None or not name.endswith("lora_B.weight"):
        return served
    sent = versions.sent(name)
    scaling = versions.scaling()
    if (
        sent is not None
        and sent.shape == served.shape
        and torch.equal(sent.to(served.dtype) * scaling, served)
    ):
        return sent
    return served / scaling
