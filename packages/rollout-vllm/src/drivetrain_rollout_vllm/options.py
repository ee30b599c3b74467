"""The vLLM rollouts' own options (a job's ``rollout.options.<key>``): vLLM's engine settings a user changes for
a GPU, and, for ``vllm-server``, how long the trainer waits for one answer.

Each vLLM setting keeps the name of vLLM's ``LLM`` argument it sets (verl's ``rollout.gpu_memory_utilization``,
``rollout.max_model_len``, ``rollout.max_num_seqs``, ``rollout.enforce_eager`` have the same names); one left
unset is left to vLLM, except the CPU KV cache (:func:`memory_options`). The separate placement sends them to
its server with the start request, so no environment variable configures the server's vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.rollout import RolloutOptions

from .deadline import RequestDeadline

CPU_KV_CACHE_BYTES = 1 << 30

WEIGHT_TRANSFERS = ("drivetrain", "vllm")
"""How merged weights reach vLLM's model (``rollout.options.weight_transfer``)."""
DEFAULT_MAX_LORAS = 2
"""Adapter versions kept loaded when ``max_loras`` is unset outside a job (a job sizes it from its trainer)."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM sizes its LoRA buffers for (``max_lora_rank``)."""


def cpu_scheduling(device: str) -> dict[str, Any]:
    """How vLLM schedules prompts on CPU: whole, never a prefill cut across engine steps.

    NOTE: vLLM cuts a prefill that does not fit a step's token budget (4,096 tokens on CPU) across steps and
    drops the token sampled after each partial one, rewinding a seeded request's generator by its offset; a CPU
    generator has no offset, so the first call whose prompts pass the budget (64 episodes of 110 tokens, 40
    prompts of 150) stopped the engine with "CPU Generator does not use offset". Every request drivetrain sends
    is seeded (:mod:`.sampling`). Without chunked prefill vLLM schedules each prompt whole, in a later step when
    the budget is spent (the budget grows to ``max_model_len`` so that any prompt fits one step).
    """
    return {"enable_chunked_prefill": False} if device == "cpu" else {}


def memory_options(device: str) -> dict[str, Any]:
    """How much memory vLLM takes beside the training engine in the same process when no option says.

    NOTE: on CPU vLLM otherwise reserves 92% of the host's memory (``gpu_memory_utilization``) and refuses to
    start when that much is not free; colocated with training it gets a 1 GiB KV cache unless
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB, vLLM's own variable) says otherwise. On GPUs vLLM's own default applies.
    """
    if device == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    return {}


@dataclass(kw_only=True, frozen=True)
class VLLMOptions(RolloutOptions):
    """The ``vllm`` rollout's options; each sets vLLM's ``LLM`` argument of the same name.

    Attributes:
        gpu_memory_utilization: the share of the device's memory vLLM takes for weights, activations and KV
            cache, in (0, 1] (unset: vLLM's 0.9 on GPUs; on CPU a 1 GiB KV cache instead). Colocated with
            training on a GPU, lower it to leave the trainer room (verl's examples: 0.4-0.6).
        kv_cache_memory_bytes: the KV cache's size in bytes, instead of a share of memory (unset: as
            ``gpu_memory_utilization`` says). Set at most one of the two.
        max_model_len: the longest prompt plus response vLLM serves (unset: the model's context length); a
            long-context model on a small GPU needs it lowered for its KV cache to fit.
        max_num_seqs: the most sequences vLLM schedules in one step (unset: vLLM's default).
        enforce_eager: run every step eagerly (true: no CUDA-graph capture, whose memory the trainer would
            lose); false captures CUDA graphs on GPUs: faster decoding after a slower start.
        enable_lora: serve adapter-only hand-offs (``weight_buckets(lora="adapter")``) through vLLM's LoRA
            support, each version an adapter of its own (false: merged weights only).
        max_lora_rank: the largest adapter rank served, one of vLLM's sizes (:data:`LORA_RANKS`).
        max_loras: how many adapter versions stay loaded: the newest serves new requests, older ones finish
            theirs (unset: as many as the job's trainer samples from at once, ``trainer.max_staleness + 1``
            asynchronous, 2 one step off, 1 in sync; :data:`DEFAULT_MAX_LORAS` outside a job).
        weight_transfer: how merged weight streams reach vLLM's model: ``drivetrain`` (layer by layer through
            vLLM's layerwise reload, deltas too) or ``vllm`` (vLLM's own weight-transfer protocol, start/update/
            finish, with drivetrain's transport and each tensor's digest checked in vLLM's worker; full versions
            only: vLLM reloads the whole model each version).
    """

    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = True
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int | None = None
    weight_transfer: str = "drivetrain"

    def __post_init__(self) -> None:
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ConfigError(
                f"rollout.options.gpu_memory_utilization={share} must be in (0, 1] (a share of the device's "
                "memory, e.g. 0.5); unset it for vLLM's default."
            )
        if share is not None and self.kv_cache_memory_bytes is not None:
            raise ConfigError(
                "rollout.options.gpu_memory_utilization and rollout.options.kv_cache_memory_bytes are both set; "
                "vLLM sizes its memory by one of them: unset the other."
            )
        if self.max_lora_rank not in LORA_RANKS:
            raise ConfigError(
                f"rollout.options.max_lora_rank={self.max_lora_rank} is not a rank vLLM serves; set one of "
                f"{list(LORA_RANKS)} at least the adapters' rank (model.lora.rank)."
            )
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ConfigError(
                f"rollout.options.weight_transfer={self.weight_transfer!r} is not one of {list(WEIGHT_TRANSFERS)}; "
                "set drivetrain (the default) or vllm (vLLM's weight-transfer protocol)."
            )
        for name in ("kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "max_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(
                    f"rollout.options.{name}={value} must be >= 1; unset it for vLLM's default."
                )

    @property
    def kept_loras(self) -> int:
        """How many adapter versions stay loaded: ``max_loras``, else :data:`DEFAULT_MAX_LORAS`."""
        return DEFAULT_MAX_LORAS if self.max_loras is None else self.max_loras

    def serving_versions(self, versions: int, *, why: str) -> VLLMOptions:
        """``max_loras`` set to ``versions`` where unset, so every version a request may still run under stays
        loaded; one set below it is refused (with LoRA support on: otherwise nothing is kept).

        Raises:
            ConfigError: ``max_loras`` set below ``versions``, naming ``why`` and the fix.
        """
        if self.max_loras is None:
            return dataclasses.replace(self, max_loras=versions)
        if self.enable_lora and self.max_loras < versions:
            raise ConfigError(
                f"rollout.options.max_loras={self.max_loras} keeps fewer adapter versions than the trainer samples "
                f"from at once: {why} needs {versions} kept; set "
                f"rollout.options.max_loras={versions} (or more), or unset it to follow the trainer."
            )
        return self

    def length_limit(self) -> tuple[str, int] | None:
        """``max_model_len`` where set: vLLM refuses a longer prompt (unset, vLLM serves the model's context
        length, which jobs check against the model)."""
        return None if self.max_model_len is None else ("max_model_len", self.max_model_len)

    def engine_arguments(self, device: str) -> dict[str, Any]:
        """The ``vllm.LLM`` arguments these options set (unset ones left out), with, on CPU, whole prefills
        (:func:`cpu_scheduling`) and the memory default (:func:`memory_options`) when neither memory option is
        set."""
        names = ("gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len", "max_num_seqs")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        memory = (
            {} if {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(given) else memory_options(device)
        )
        # NOTE: vLLM holds max_cpu_loras adapters and evicts the least recently used one to add another: one
        # place more than the versions kept, so adding a version never evicts a kept one (the oldest is removed
        # after the new one is in).
        kept = self.kept_loras
        lora = {"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": kept}
        lora = {**lora, "max_cpu_loras": kept + 1} if self.enable_lora else {}
        transfer = (
            {"weight_transfer_config": {"backend": "drivetrain"}} if self.weight_transfer == "vllm" else {}
        )
        return {
            "enforce_eager": self.enforce_eager,
            **cpu_scheduling(device),
            **memory,
            **given,
            **lora,
            **transfer,
        }

    def vllm_fields(self) -> dict[str, Any]:
        """The :class:`VLLMOptions` part of these options as plain values (what the server's vLLM takes), with
        ``max_loras`` resolved (:attr:`kept_loras`), as a server of 0.5.0 or older needs it.

        NOTE: ``weight_transfer`` is left out at its default, so a server of 0.5.0 (same wire protocol, without
        the option) still takes the options of a trainer that does not use it.
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(VLLMOptions)}
        if self.weight_transfer == "drivetrain":
            del fields["weight_transfer"]
        return {**fields, "max_loras": self.kept_loras}


@dataclass(kw_only=True, frozen=True)
class VLLMServerOptions(VLLMOptions):
    """The ``vllm-server`` rollout's options: its vLLM's (:class:`VLLMOptions`) and the trainer's wait.

    Attributes:
        request_timeout_s: how long the trainer waits for any one answer of the server before it names the
            server hung and stops it, in seconds (unset: derived from each request, 120 s plus its tokens at
            10 tokens/s and its weight bytes at 10 MB/s; set it for a model slower than that).
    """

    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        RequestDeadline(fixed_seconds=self.request_timeout_s)  # its check, named by the option

    def deadline(self) -> RequestDeadline:
        """The requests' deadline: ``request_timeout_s`` when set, else the deprecated
        ``$DRIVETRAIN_VLLM_REQUEST_SECONDS`` (:meth:`RequestDeadline.from_environment`), else derived."""
        if self.request_timeout_s is not None:
            return RequestDeadline(fixed_seconds=self.request_timeout_s)
        return RequestDeadline.from_environment()
