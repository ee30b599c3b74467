"""``FSDPEngineConfig``: the FSDP2 backend's own knobs on top of core's :class:`EngineConfig`."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from drivetrain_engine_core.backend import DTYPES, ConfigError, EngineConfig

ATTENTION_BACKENDS = ("varlen", "sdpa", "eager")


@dataclass(kw_only=True, frozen=True)
class FSDPEngineConfig(EngineConfig):
    """Settings of the FSDP2 engine.

    Attributes:
        fsdp_size: ranks one parameter is sharded over; ``-1`` shards over every rank. A smaller size that
            divides the world size gives hybrid sharding (shard inside groups of ``fsdp_size``, replicate
            across them).
        ulysses_sequence_parallel_size: ranks that split one packed row by tokens (DeepSpeed-Ulysses); the
            data-parallel size is ``world_size / ulysses_sequence_parallel_size``.
        defer_gradient_sync: reduce(-scatter) gradients once per step, after the last micro-batch, instead of
            after each: less communication, but every rank holds unsharded (full-size, ``reduce_dtype``)
            gradients between micro-batches, so off by default (torchtitan's choice). With hybrid sharding the
            all-reduce across replicas runs once per step either way.
        reshard_after_forward: free gathered parameters after forward (saves memory, costs one more
            all-gather in backward).
        cpu_offload_policy: let FSDP2 keep parameters, gradients and optimizer state on CPU
            (``CPUOffloadPolicy``); the optimizer then steps on CPU.
        reduce_dtype: dtype of gradient reduction; keep ``float32`` for stable sums under bf16 compute.
        attention_backend: ``varlen`` attends per packed sequence (torch's variable-length flash kernel, one
            launch per layer, on CUDA in bf16/fp16; SDPA per sequence otherwise); ``sdpa`` and ``eager`` are
            transformers' own (a block mask over a packed row, so they cost what the row costs); ``eager`` is
            the one that soft-caps attention logits (Gemma 2). Padded rows use ``sdpa`` unless ``eager``.
        meta_init: build the model on the meta device, shard it there, and read into each rank only its
            shards of the safetensors weights (peak host memory per rank near ``1 / world_size`` of the
            model). ``False`` loads the whole model on every rank with ``from_pretrained`` first, for
            checkpoints whose tensor names transformers converts while loading, or that are not safetensors.
        compile_layers: ``torch.compile`` each decoder layer before sharding (torchtitan's per-layer compile:
            fuses norms, rotary and the MLP's elementwise work); off by default, refused on CPU without a C++
            compiler.
        log_prob_kernel: how the log-probs of a language model come from its last hidden states: ``torch``
            (chunked, exact, any device) or ``liger`` (Liger-Kernel's fused linear cross-entropy, CUDA only,
            ``pip install "drivetrain-engine-fsdp[liger]"``; calls that ask for entropy, or for a temperature
            other than 1 in half precision, still take the torch path). Chunks hold about
            ``entropy_chunk_size`` positions either way.
        router_aux_loss_coef: weight of a mixture-of-experts router's load-balancing loss in the loss
            (``router_loss.py``: transformers' formula per sequence, averaged over the global batch's
            sequences, so it does not depend on micro-batching or rank count). ``None`` follows the model's
            config as transformers does: its ``router_aux_loss_coef`` when ``output_router_logits`` is true,
            else off. The unscaled value is the metric ``router_aux_loss`` of every MoE model trained or
            evaluated with a loss, whatever the weight.
    """

    fsdp_size: int = -1
    ulysses_sequence_parallel_size: int = 1
    defer_gradient_sync: bool = False
    reshard_after_forward: bool = True
    cpu_offload_policy: bool = False
    reduce_dtype: str = "float32"
    attention_backend: str = "varlen"
    meta_init: bool = True
    compile_layers: bool = False
    log_prob_kernel: str = "torch"
    router_aux_loss_coef: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fsdp_size != -1 and self.fsdp_size < 1:
            raise ConfigError(f"engine.fsdp_size must be -1 (all ranks) or >= 1, got {self.fsdp_size}.")
        if self.ulysses_sequence_parallel_size < 1:
            raise ConfigError(
                "engine.ulysses_sequence_parallel_size must be >= 1 (1 disables sequence parallelism), "
                f"got {self.ulysses_sequence_parallel_size}."
            )
        if self.reduce_dtype not in DTYPES:
            raise ConfigError(
                f"engine.reduce_dtype={self.reduce_dtype!r} is not supported; choose one of {list(DTYPES)}."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"engine.attention_backend={self.attention_backend!r} is not supported; choose one of "
                f"{list(ATTENTION_BACKENDS)}."
            )
        if self.compile_layers and self.device == "cpu" and not _cpp_compiler():
            raise ConfigError(
                "engine.compile_layers=True on device 'cpu' needs a C++ compiler for torch.compile's inductor "
                "backend, and none was found (set CXX or install g++); or set engine.compile_layers=False."
            )
        if self.log_prob_kernel not in ("torch", "liger"):
            raise ConfigError(
                f"engine.log_prob_kernel={self.log_prob_kernel!r} is not supported; choose 'torch' or 'liger'."
            )
        if self.log_prob_kernel == "liger":
            from .liger import check_liger_available  # torch: the config of every run is built without it

            check_liger_available(self.device)
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ConfigError(
                f"engine.router_aux_loss_coef must be >= 0 (0 turns the load-balancing loss off, unset follows "
                f"the model's config), got {self.router_aux_loss_coef}."
            )
        if self.cpu_offload_policy and self.param_offload:
            raise ConfigError(
                "engine.cpu_offload_policy and engine.param_offload both move parameters to CPU; set only one "
                "(cpu_offload_policy keeps them there during compute, param_offload only between calls)."
            )

    def check_world(self, world_size: int) -> None:
        """Check the parallel sizes against the launched world.

        Raises:
            ConfigError: a size does not divide the world size; the message says which sizes would.
        """
        sp = self.ulysses_sequence_parallel_size
        if world_size % sp:
            raise ConfigError(
                f"engine.ulysses_sequence_parallel_size={sp} does not divide the world size {world_size}; "
                f"use one of {_divisors(world_size)}."
            )
        if self.fsdp_size != -1 and world_size % self.fsdp_size:
            raise ConfigError(
                f"engine.fsdp_size={self.fsdp_size} does not divide the world size {world_size}; "
                f"use -1 or one of {_divisors(world_size)}."
            )

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / ulysses_sequence_parallel_size``: a Ulysses group shares its sequences."""
        self.check_world(world_size)
        return world_size // self.ulysses_sequence_parallel_size

    def resolved_fsdp_size(self, world_size: int) -> int:
        """Ranks per shard group (``fsdp_size`` with ``-1`` resolved to the world size)."""
        return world_size if self.fsdp_size == -1 else self.fsdp_size


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU (``CXX``, else ``g++``/``c++``/``clang++`` on the path)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((found for name in names if (found := shutil.which(name))), None)


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
